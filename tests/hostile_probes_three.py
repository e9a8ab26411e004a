"""The hostile-input probes of docs/results/reliability.md ("Hostile input, round three"), run by hand against a live
``lengthwise serve --models`` over one real engine serving a base and LoRA adapters, with two client keys; one line
per finding. ``PID`` is the gateway's process (its open files are read).

    python -m tests.hostile_probes_three GATEWAY_URL KEY_A KEY_B PID [BASE_NAME]

A: nothing of the deployment on the open ``/health`` or in ``/v1/models``, short echoes; B: an ask hidden in a
``refusal`` or ``thinking`` part; C: one key's share, sequences; D: slow bodies, a client that reads nothing; E: prompt
logprobs on the adapters' engine. The probes that could take the engine down run last (E). The tests in
tests/test_engine_crashes.py, tests/test_gateway_shares.py, tests/test_gateway_slow_clients.py and
tests/test_gateway_hostile.py make the same probes.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

import httpx
import psutil

# what an open page must not show: a URL, a host address, an absolute path of two parts or more (not an API route)
EXPOSED = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"]*|\b(?:\d{1,3}\.){3}\d{1,3}\b|(?<![\w:/.~-])~?/(?!v1/)[\w.@+-]+/[^\s\"]*")
CARD_FIELDS = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len"}  # OpenAI's, and vLLM's two
ASK = ("Write a detailed tutorial on building a small web server in Rust: the project layout, the dependencies, "
       "routing, handlers, error handling, logging, tests and deployment, with code for every step.")


def exposed(text: str) -> list[str]:
    """What of the deployment ``text`` shows (at most five)."""
    return sorted(set(EXPOSED.findall(text)))[:5]


def main(url: str, key_a: str, key_b: str, pid: int, model: str = "smol") -> None:
    ha, hb = ({"Authorization": f"Bearer {k}"} for k in (key_a, key_b))
    gw = psutil.Process(pid)

    def health() -> dict:
        return httpx.get(url + "/health", headers=ha, timeout=30).json()

    # nothing about the deployment on open pages, and short echoes
    print("A the open /health shows (URL, address, path):", exposed(httpx.get(url + "/health", timeout=30).text))
    cards = httpx.get(url + "/v1/models", headers=ha, timeout=30).json()["data"]
    print("A /v1/models shows (path):", exposed(json.dumps([{k: v for k, v in c.items() if k not in ("id", "parent")}
                                                            for c in cards])),
          "| fields beyond OpenAI's:", sorted({k for c in cards for k in c} - CARD_FIELDS),
          "| root is the served name:", all(c.get("root") == c["id"] for c in cards))
    for what, body in (("a 60,000-character model name", {"model": "m" * 60_000, "prompt": "hi", "max_tokens": 2}),
                       ("100,000 stop_token_ids", {"model": model, "prompt": "hi", "max_tokens": 2,
                                                   "stop_token_ids": list(range(100_000))})):
        r = httpx.post(url + "/v1/completions", headers=ha, json=body, timeout=120)
        try:
            valid = isinstance(r.json()["error"]["message"], str)
        except (ValueError, KeyError, TypeError):
            valid = False
        print(f"A {what}: {r.status_code}, {len(r.content)} bytes, OpenAI error JSON: {valid}")

    # the ask in a part the gateway did not read
    for kind in ("text", "refusal", "thinking"):
        r = httpx.post(url + "/v1/chat/completions", headers=ha, timeout=300, json={
            "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Hi"}, {"type": kind, kind: ASK}]}]})
        usage = r.json().get("usage", {}).get("prompt_tokens") if r.status_code == 200 else "-"
        print(f"B the ask in a {kind} part: {r.status_code}, predicted {r.headers.get('x-lengthwise-pred-len')}, "
              f"counted {r.headers.get('x-lengthwise-prompt-tokens')}, the engine's {usage}")

    # one key fills every place; n and beams multiply the work behind one place
    def burst(headers: dict, n: int, body: dict) -> list[int]:
        def one(_: int) -> int:
            try:
                with httpx.stream("POST", url + "/v1/completions", headers=headers, json=body, timeout=600) as r:
                    for _line in r.iter_lines():
                        pass
                    return r.status_code
            except httpx.HTTPError:
                return 0
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))

    slow = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 96, "ignore_eos": True, "stream": True}
    held = threading.Thread(target=lambda: print("C key A's 20 streams:", sorted(burst(ha, 20, slow))))
    held.start()
    time.sleep(3)
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", headers=hb, json={"model": model, "prompt": "hi", "max_tokens": 2}, timeout=600)
    print(f"C key B while A holds its places: {r.status_code} after {time.perf_counter() - t:.1f} s; in flight "
          f"{health()['inflight']} of {health()['max_outstanding']}")
    held.join()
    statuses = burst(ha, 16, {**slow, "n": 4, "max_tokens": 32})
    print(f"C key A's 16 requests with n 4: {sorted(statuses)}; most places held {health()['inflight_peak']}")
    r = httpx.post(url + "/v1/completions", headers=ha, timeout=600, json={
        "model": model, "prompt": "hi", "max_tokens": 8, "use_beam_search": True, "n": 4})
    print(f"C a beam search of width 4: {r.status_code} {r.text[:160] if r.status_code != 200 else ''}")

    # connections that send headers and 20 bytes of a 16 MB body; then a client that does not read its stream
    host, port = urlsplit(url).hostname, urlsplit(url).port
    fds0 = gw.num_fds()
    socks = []
    for _ in range(150):
        s = socket.create_connection((host, port))
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key_a}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 16777216\r\n\r\n".encode() + b'{"model": "x", "pr')
        socks.append(s)
    time.sleep(2)
    fds1, t0 = gw.num_fds(), time.monotonic()
    closed, answers = 0, set()
    for s in socks:
        s.settimeout(max(0.1, 120 - (time.monotonic() - t0)))
        try:
            data = s.recv(200)
            closed += 1
            answers.add(data.split(b"\r\n", 1)[0].decode(errors="replace"))
        except OSError:
            pass
        s.close()
    print(f"D 150 slow bodies: the gateway's open files {fds0} -> {fds1}; closed by the gateway {closed} after "
          f"{time.monotonic() - t0 + 2:.0f} s ({', '.join(sorted(answers)) or 'no answer'}); open files then {gw.num_fds()}")
    stalled = socket.create_connection((host, port))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    # about 5 MB of events (4 sequences of 1,800 tokens with 5 logprobs each): more than the sockets' buffers hold
    body = json.dumps({**slow, "max_tokens": 1800, "n": 4, "logprobs": 5}).encode()
    stalled.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key_a}\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 240 and health()["inflight"] > 0 or time.monotonic() - t0 < 3:
        time.sleep(1)
    print(f"D a client that reads nothing of its stream: in flight {health()['inflight']} after "
          f"{time.monotonic() - t0:.0f} s")
    stalled.close()

    # last: what took the engine down
    ask = {"model": "detailed", "prompt": ASK, "max_tokens": 4, "prompt_logprobs": 1}
    r = httpx.post(url + "/v1/completions", headers=ha, json=ask, timeout=300)
    print(f"E prompt_logprobs alone: {r.status_code} {r.text[:200] if r.status_code != 200 else ''}")
    decoding = threading.Thread(target=lambda: print("E the request decoding beside:", burst(hb, 1, slow)))
    decoding.start()
    time.sleep(2)
    for name, body in (("prompt_logprobs", ask), ("echo with logprobs", {**ask, "echo": True, "logprobs": 2,
                                                                          "prompt_logprobs": None})):
        r = httpx.post(url + "/v1/completions", headers=ha, json=body, timeout=300)
        print(f"E {name} beside a decoding request: {r.status_code} {r.text[:200] if r.status_code != 200 else ''}")
    decoding.join()
    time.sleep(3)
    h = health()
    print(f"E then: /health {h['status']}, healthy engines {h['healthy_engines']}, reasons {h['reasons']}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
