"""The hostile-input probes of docs/results/reliability.md ("Hostile input, round two"), run by hand against a live
``lengthwise serve`` with a client key, its engine's URL and a sidecar with a token; one line per finding.

    python -m tests.hostile_probes GATEWAY_URL CLIENT_KEY ENGINE_URL SIDECAR_URL SIDECAR_TOKEN

The feedback attack runs first (the streamed-NaN probe runs last: before the fix it leaves every place in flight
held, and everything after it would be refused). The tests in tests/test_gateway_hostile.py make the same probes.
"""

from __future__ import annotations

import json
import lzma
import sys
import threading
import time

import httpx

from predictor.common import data_dir

SHAREGPT = "prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"


def main(url: str, key: str, engine: str, sidecar: str, token: str) -> None:
    h = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    sch = {"Authorization": f"Bearer {token}"}
    model = httpx.get(url + "/v1/models", headers=h).json()["data"][0]["id"]

    def post(path: str, raw: bytes, client: httpx.Client | None = None, timeout: float = 30) -> tuple:
        try:
            r = (client or httpx.Client()).post(url + path, content=raw, headers=h, timeout=timeout)
            return r.status_code, r.text[:120]
        except httpx.HTTPError as exc:
            return type(exc).__name__, ""

    # 4: the feedback attack: prompts the predictor puts at 400+ tokens, ended early by stop strings
    with lzma.open(data_dir() / SHAREGPT) as f:
        convs = json.load(f)
    prompts = [t[0]["value"] for c in convs[:3000] if (t := c.get("conversations")) and t[0].get("from") == "human"
               and 20 < len(t[0]["value"]) < 1500]
    chosen: list[str] = []
    for i in range(0, len(prompts), 64):
        preds = httpx.post(sidecar + "/v1/predict", headers=sch, json={"prompts": prompts[i:i + 64]}, timeout=120).json()
        chosen += [p for p, d in zip(prompts[i:i + 64], preds["predictions"]) if d["expected_tokens"] >= 400]
        if len(chosen) >= 30:
            break
    answers = []
    for p in chosen[:30]:
        a = httpx.post(url + "/v1/chat/completions", headers=h, timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": 32,
            "stop": [" ", "\n", ".", ","]}).json()
        answers.append((a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"]))
    print(f"4 {len(answers)} answers (tokens, finish): {sorted(t for t, _ in answers)} {sorted({f for _, f in answers})}")
    time.sleep(65)  # the sidecar closes a window after --window-seconds (60)
    print("4 sidecar drift:", json.dumps(httpx.get(sidecar + "/health", headers=sch).json().get("drift")))
    gw = httpx.get(url + "/metrics", headers=h).text
    print("4 gateway:", [ln for ln in gw.splitlines() if ln.startswith(("lengthwise_gateway_feedback_total",
                                                                         "lengthwise_gateway_feedback_withheld_total"))])
    # 3
    print("3 structured_outputs 5:", post("/v1/completions", json.dumps(
        {"model": model, "prompt": "hi", "max_tokens": 2, "structured_outputs": 5}).encode()))
    # 5
    for path, body in (("/invocations", {"model": model, "prompt": "hi", "max_tokens": 2,
                                         "vllm_xargs": {"pred_len": 1, "deadline": 0}}),
                       ("/tokenize", {"model": model, "prompt": "hi"}), ("/detokenize", {"model": model, "tokens": [1, 2]})):
        print(f"5 engine {path} without the key:", httpx.post(engine + path, json=body, timeout=60).status_code)
    print("5 the open /health lists the engine's address:", engine in httpx.get(url + "/health").text)
    # 6
    big = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}] * 100_000}).encode()
    delays: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            httpx.get(url + "/health", timeout=120)
            delays.append(time.perf_counter() - t)
            time.sleep(0.02)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(0.3)
    t = time.perf_counter()
    status = post("/v1/chat/completions", big, timeout=300)[0]
    took = time.perf_counter() - t
    time.sleep(0.3)
    stop.set()
    thread.join()
    print(f"6 100,000 messages ({len(big) / 1e6:.1f} MB): {status} in {took:.2f} s; slowest /health {max(delays):.2f} s")
    # 2
    fragments = {"NaN": b'"temperature": NaN', "Infinity": b'"temperature": Infinity', "1e999": b'"temperature": 1e999',
                 "top_p NaN": b'"top_p": NaN', "logit_bias NaN": b'"logit_bias": {"5": NaN}',
                 "vllm_xargs NaN": b'"vllm_xargs": {"k": NaN}', "unknown NaN": b'"whatever": NaN',
                 "seed of 5000 digits": b'"seed": ' + b"9" * 5000}
    plain = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}).encode()
    for name, fragment in fragments.items():
        with httpx.Client(limits=httpx.Limits(max_connections=1)) as c:
            first = post("/v1/completions", plain[:-1] + b", " + fragment + b"}", c)[0]
            print(f"2 {name}: {first} | the next on the same connection: {post('/v1/completions', plain, c)[0]}")
    # 1
    raw = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                      "stream": True}).encode()[:-1] + b', "temperature": NaN}'
    res = [post("/v1/chat/completions", raw, timeout=3)[0] for _ in range(16)]
    time.sleep(1)
    inflight = httpx.get(url + "/health", headers=h).json()["inflight"]
    again = post("/v1/completions", plain)[0]
    print(f"1 16 streams with NaN: { {s: res.count(s) for s in set(res)} } | in flight after: {inflight} | next: {again}")


if __name__ == "__main__":
    main(*sys.argv[1:6])
