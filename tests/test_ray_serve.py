"""The Ray Serve backend end to end: a local Ray cluster, two CPU vLLM engine replicas (dummy weights), the real sidecar
deployment with a small ONNX package, the ingress, and the ``openai`` client and ``vllm bench serve`` as clients.

Every request completes with exactly its ``max_tokens`` (``ignore_eos``), streamed or not; its prediction came from the
sidecar deployment; and the requests spread over both engine replicas (counted per replica on ``/health``). The
application runs two ingress replicas (``replicas=2``, each with its own router), as a user scaling out the ingress
would: each counts what it served, so the test reads ``/health`` from both.

Then the faults, last on the same application (starting it costs minutes here, so the module shares one):

* **The sidecar down** (its application deleted, as a scale to zero): requests still complete with exactly their
  length, on the fallback prediction, and ``/health`` says ``degraded`` with the predictor's reason; deployed again,
  predictions come from it again.
* **An engine replica killed mid-load** (``ray.kill`` on its actor): every stream that had sent events from it ends
  with an error event and ``[DONE]`` (never a hang, never a cut connection), counted on ``/health`` (summed over both
  ingress replicas); every other request (the survivor's streams, the non-streamed ones in flight, those sent after
  the kill) completes with exactly its length; Ray starts a new replica and it serves again.

Stale routing stats (the router's power-of-two fallback, counted by reason) are covered at unit level and on a live
application of cheap replicas in tests/test_ray_router.py.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.ray_app import RayApp, start_app
from tests.sidecar_proc import wait_for
from tests.vllm_bench import bench_sharegpt

pytest.importorskip("ray")
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]
LONG = 1000  # tokens of the streams the kill cuts: long enough to be in flight when it comes


@pytest.fixture(scope="module")
def ray_app(model_dir, data, tmp_path_factory) -> Iterator[RayApp]:
    with start_app(model_dir, data, tmp_path_factory.mktemp("ray-serve"), replicas=2) as app:
        yield app


@dataclass
class Seen:
    """What a client saw of one streamed request."""

    status: int = 0
    engine: str = ""
    tokens: int = 0  # events with text
    usage: int | None = None
    error: str | None = None
    done: bool = False
    first: threading.Event = field(default_factory=threading.Event)
    over: threading.Event = field(default_factory=threading.Event)


def stream(url: str, model: str, prompt: str, n: int, seen: Seen) -> Seen:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=httpx.Timeout(600, connect=30)) as r:
            seen.status, seen.engine = r.status_code, r.headers.get("x-lengthwise-engine", "")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    seen.done = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    seen.error = event["error"]["message"]
                    continue
                if any(c.get("text") for c in event.get("choices") or ()):
                    seen.tokens += 1
                    seen.first.set()
                if event.get("usage"):
                    seen.usage = event["usage"]["completion_tokens"]
    finally:
        seen.first.set()
        seen.over.set()
    return seen


def unary(url: str, model: str, prompt: str, n: int) -> tuple[int, int | None, str, str]:
    """Status, completion tokens, the engine replica and the prediction's source of one non-streamed request."""
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True},
                   timeout=600)
    tokens = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
    return r.status_code, tokens, r.headers.get("x-lengthwise-engine", ""), r.headers.get("x-lengthwise-prediction", "")


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=30).json()


def engine_replicas() -> set[str]:
    """The unique ids of the engine deployment's replica actors that are not dead (named actors, from Ray's GCS)."""
    from ray.util import list_named_actors

    prefix = "SERVE_REPLICA::lengthwise#engine#"
    return {a["name"].removeprefix(prefix) for a in list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def health_by_ingress(url: str) -> dict[int, dict]:
    """``/health`` of each ingress replica by rank: Ray's proxy spreads the calls over them, so read until both answer."""
    by_ingress: dict[int, dict] = {}
    for _ in range(60):
        h = health(url)
        by_ingress[h["ingress"]["rank"]] = h
        if len(by_ingress) == 2:
            break
    assert sorted(by_ingress) == [0, 1], by_ingress.keys()
    return by_ingress


def test_every_request_completes_with_its_exact_length(ray_app, model_dir):
    from openai import OpenAI

    client = OpenAI(base_url=ray_app.url + "/v1", api_key="none", timeout=180, max_retries=0)
    lengths = [3, 7, 12, 20, 5, 16, 9, 24, 4, 11, 30, 6]

    def one(i: int) -> tuple[int, int, str]:
        n = lengths[i]
        if i % 2:
            stream = client.completions.create(model=str(model_dir), prompt=f"tell me a story number {i}", max_tokens=n,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            usage = [c.usage.completion_tokens for c in stream if c.usage is not None]
            return n, usage[-1], "stream"
        raw = client.chat.completions.with_raw_response.create(
            model=str(model_dir), messages=[{"role": "user", "content": f"question {i}: why is the sky blue?"}],
            max_tokens=n, extra_body={"ignore_eos": True})
        return n, raw.parse().usage.completion_tokens, raw.headers["x-lengthwise-prediction"]

    with ThreadPoolExecutor(len(lengths)) as pool:
        results = list(pool.map(one, range(len(lengths))))
    assert [got for _, got, _ in results] == lengths
    assert {how for _, _, how in results if how != "stream"} == {"sidecar"}, results

    by_ingress = health_by_ingress(ray_app.url)
    assert all(h["ingress"]["replicas"] == 2 and h["predictor"]["state"] == "ok" for h in by_ingress.values()), by_ingress
    served: dict[str, int] = {}
    for h in by_ingress.values():
        for engine, n in h["served_by_engine"].items():
            served[engine] = served.get(engine, 0) + n
    print("requests per engine replica:", served, "per ingress:", {r: h["served_by_engine"] for r, h in by_ingress.items()})
    assert sum(served.values()) == len(lengths) and len(served) == 2 and min(served.values()) >= 1, served


def test_each_engine_replica_runs_pinned_to_cores_of_its_own(ray_app):
    """Each engine replica claimed a core no other holds and pinned itself whole to it before its engine started, so its
    engine core and model worker processes run there, as the HTTP backend pins the engines it starts."""
    import psutil

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: nothing to keep apart")
    by_replica: dict[int, set[tuple[int, ...]]] = {}
    for p in psutil.process_iter(["name"]):
        if p.info["name"] != "VLLM::EngineCore":
            continue
        replica = p.parent()
        if replica is None or not replica.name().startswith("ray::"):
            continue  # not one of this application's engines
        tree = [replica, p, *p.children(recursive=True)]
        by_replica[replica.pid] = {tuple(q.cpu_affinity()) for q in tree}
    print("cores per engine replica:", by_replica)
    assert len(by_replica) == 2, by_replica
    pinned = list(by_replica.values())
    assert all(len(c) == 1 and len(next(iter(c))) == 1 for c in pinned), by_replica  # one core for the whole tree
    assert pinned[0] != pinned[1], by_replica


def test_vllm_bench_serve_against_the_ray_application(ray_app, model_dir, data, tmp_path):
    """vLLM's own load generator, pointed at the Ray application's OpenAI endpoint, with real ShareGPT conversations:
    every request completes with exactly the tokens it asked for."""
    res = bench_sharegpt(ray_app.url, str(model_dir), data, tmp_path)
    assert res["completed"] == 6 and res.get("failed", 0) == 0, res
    assert res["total_output_tokens"] == 6 * 24


def test_bad_input_is_a_4xx_with_a_message(ray_app):
    r = httpx.post(ray_app.url + "/v1/completions", content=b"{not json", timeout=30)
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = httpx.post(ray_app.url + "/v1/completions", json={"model": "no-such-model", "prompt": "hi"}, timeout=30)
    assert r.status_code == 404 and "does not exist" in r.json()["error"]["message"]


def test_cli_refuses_what_does_not_apply_in_one_line():
    import subprocess

    lengthwise = str(Path(os.sys.executable).parent / "lengthwise")
    r = subprocess.run([lengthwise, "serve", "--backend", "ray", "--engine-url", "http://127.0.0.1:9"], capture_output=True,
                       text=True, timeout=120, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--backend ray starts its own engine replicas" in r.stderr
    r = subprocess.run([lengthwise, "serve", "--backend", "ray", "--model", "m", "--engine-bound", "slo"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--engine-bound slo" in r.stderr, r.stderr
    r = subprocess.run([lengthwise, "serve", "--backend", "ray", "--model", "m", "--replicas", "2", "--replica-index", "1"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "leave out --replica-index" in r.stderr, r.stderr


def test_each_engine_replica_runs_on_the_systems_tcmalloc_where_it_is_installed(ray_app):
    """The replica and its engine's processes have the system's tcmalloc mapped, as the HTTP backend's engines do
    (serving/launch/malloc.py); without one installed, glibc's malloc."""
    import psutil

    from serving.launch.malloc import find_tcmalloc

    lib = find_tcmalloc()
    trees = [[p.parent(), p, *p.children(recursive=True)] for p in psutil.process_iter(["name"])
             if p.info["name"] == "VLLM::EngineCore" and p.parent() is not None and p.parent().name().startswith("ray::")]
    assert len(trees) == 2, trees
    for tree in trees:
        for q in tree:
            maps = Path(f"/proc/{q.pid}/maps").read_text()
            assert (lib is not None) == ("libtcmalloc" in maps), (lib, q.pid, q.name())


@pytest.mark.fault("Ray Serve: the sidecar application deleted, then deployed again",
                   saw="answers of the length asked on the fallback prediction; /health degraded, then ok and predictions again",
                   lost="nothing")
def test_sidecar_down_requests_run_on_the_fallback_and_health_says_why(ray_app, model_dir):
    from ray import serve

    from serving.ray.app import sidecar_app
    from serving.ray.sidecar import ROUTE

    url, model = ray_app.url, str(model_dir)
    wait_for(lambda: health(url)["predictor"]["state"] == "ok", 300, 1.0, "the sidecar is ready")
    serve.delete("predictor")
    down = wait_for(lambda: (h := health(url))["status"] == "degraded" and h, 60, 1.0, "/health says the predictor is down")
    print("health with the sidecar down:", down["reasons"], down["predictor"])
    assert down["predictor"]["state"] not in ("ok", "unchecked"), down
    assert [r for r in down["reasons"] if r.startswith("predictor ") and "fallback length" in r], down
    lengths = [4, 9, 13, 6]
    with ThreadPoolExecutor(len(lengths)) as pool:
        answers = list(pool.map(lambda i: unary(url, model, f"the sidecar is down {i}", lengths[i]), range(len(lengths))))
        seen = list(pool.map(lambda i: stream(url, model, f"still down {i}", lengths[i], Seen()), range(2)))
    assert [(s, n) for s, n, _, _ in answers] == [(200, n) for n in lengths], answers
    assert all(src.startswith("fallback:") for _, _, _, src in answers), answers
    assert [(s.usage, s.error, s.done) for s in seen] == [(lengths[i], None, True) for i in range(2)]

    serve.run(sidecar_app(ray_app.sidecar), name="predictor", route_prefix=ROUTE)
    wait_for(lambda: health(url)["predictor"]["state"] == "ok", 300, 1.0, "the sidecar is ready again")
    assert health(url)["status"] == "ok"
    assert unary(url, model, "the sidecar is back", 5)[1:4:2] == (5, "sidecar")


# slow (72 s with its replacement's start); the default tier's counterpart: tests/test_gateway.py, an engine killed
# under load (the same cut streams on the gateway backend)
@pytest.mark.slow
@pytest.mark.fault("Ray Serve: an engine replica killed under streams",
                   saw="streams on it end with an error event and [DONE]; new requests answered; Ray starts a replacement",
                   lost="the rest of the streams on the dead replica")
def test_killed_engine_replica_cuts_its_streams_with_an_error_event_and_is_replaced(ray_app, model_dir):
    import ray

    url, model = ray_app.url, str(model_dir)
    before = engine_replicas()
    assert len(before) == 2, before
    base = sum(h["stream_errors"] for h in health_by_ingress(url).values())  # each ingress counts what it served
    with ThreadPoolExecutor(16) as pool:
        # load on both replicas: long streams, and non-streamed requests in flight
        streams = [Seen() for _ in range(6)]
        futures = [pool.submit(stream, url, model, f"a long story {i}", LONG, s) for i, s in enumerate(streams)]
        inflight_unary = [pool.submit(unary, url, model, f"a long answer {i}", 300) for i in range(2)]
        for s in streams:
            assert s.first.wait(600), "every stream sends its first event"
        assert all(s.status == 200 and not s.over.is_set() for s in streams), streams
        on = {e: [s for s in streams if s.engine == e] for e in {s.engine for s in streams}}
        print("streams per replica before the kill:", {e: len(v) for e, v in on.items()})
        victim = max(on, key=lambda e: len(on[e]))
        assert victim in before, (victim, before)
        t_kill = time.time()
        ray.kill(ray.get_actor(f"SERVE_REPLICA::lengthwise#engine#{victim}", namespace="serve"), no_restart=True)

        after = [pool.submit(unary, url, model, f"sent after the kill {i}", n) for i, n in enumerate([5, 11, 17, 8])]
        after_streams = [Seen() for _ in range(2)]
        futures += [pool.submit(stream, url, model, f"streamed after the kill {i}", 7 + i, s)
                    for i, s in enumerate(after_streams)]
        for f in futures:
            f.result(timeout=900)
        cut = time.time() - t_kill
        answers_after = [f.result(timeout=900) for f in after]
        answers_inflight = [f.result(timeout=900) for f in inflight_unary]

    killed = on[victim]
    survived = [s for s in streams if s.engine != victim]
    print(f"{len(killed)} stream(s) on the killed replica; all streams over {cut:.1f} s after the kill; tokens they got:",
          [s.tokens for s in killed], "error:", killed[0].error)
    for s in killed:  # an error event, then [DONE]: never a hang, never a cut connection
        assert s.error is not None and "engine replica failed" in s.error and s.done and s.usage is None, s
        assert 0 < s.tokens < LONG, s
    assert [(s.usage, s.error, s.done) for s in survived] == [(LONG, None, True)] * len(survived), survived
    assert [(s.usage, s.error, s.engine != victim) for s in after_streams] == [(7, None, True), (8, None, True)]
    assert [(st, n, e != victim) for st, n, e, _ in answers_after] == [(200, n, True) for n in [5, 11, 17, 8]], answers_after
    assert [(st, n) for st, n, _, _ in answers_inflight] == [(200, 300)] * 2, answers_inflight
    hs = health_by_ingress(url)
    print("health after the kill:", {r: {k: h[k] for k in ("engine_retries", "stream_errors", "served_by_engine")}
                                     for r, h in hs.items()})
    assert sum(h["stream_errors"] for h in hs.values()) - base == len(killed), hs

    t0 = time.time()

    def replaced() -> set[str]:
        now = engine_replicas()
        return now - before if len(now) == 2 else set()

    fresh = wait_for(replaced, 900, 5.0, "Ray starts a new engine replica")
    print(f"new replica {fresh} alive {time.time() - t0:.0f} s after the kill")
    new = next(iter(fresh))

    def new_one_serves() -> bool:
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(lambda i: unary(url, model, f"after the restart {i}", 20), range(6)))
        assert [(st, n) for st, n, _, _ in got] == [(200, 20)] * 6, got
        return any(e == new for _, _, e, _ in got)

    wait_for(new_one_serves, 900, 2.0, "the new replica answers requests")
    print(f"the new replica serves {time.time() - t0:.0f} s after the kill")
