"""The Ray Serve backend end to end: a local Ray cluster, two CPU vLLM engine replicas (dummy weights), the real sidecar
deployment with a small ONNX package, the ingress, and the ``openai`` client and ``vllm bench serve`` as clients.

Every request completes with exactly its ``max_tokens`` (``ignore_eos``), streamed or not; its prediction came from the
sidecar deployment; and the requests spread over both engine replicas (counted per replica on ``/health``). The
application runs two ingress replicas (``replicas=2``, each with its own router), as a user scaling out the ingress
would: each counts what it served, so the test reads ``/health`` from both.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.ray_app import RayApp, start_app
from tests.vllm_bench import bench_sharegpt

pytest.importorskip("ray")
pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_app(model_dir, data, tmp_path_factory) -> Iterator[RayApp]:
    with start_app(model_dir, data, tmp_path_factory.mktemp("ray-serve"), replicas=2) as app:
        yield app


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

    by_ingress: dict[int, dict] = {}  # Ray's proxy spreads /health over the ingress replicas too: read until both answer
    for _ in range(60):
        health = httpx.get(ray_app.url + "/health", timeout=30).json()
        assert health["ingress"]["replicas"] == 2 and health["predictor"]["state"] == "ok", health
        by_ingress[health["ingress"]["rank"]] = health
        if len(by_ingress) == 2:
            break
    assert sorted(by_ingress) == [0, 1], by_ingress.keys()
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
