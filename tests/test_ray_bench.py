"""``lengthwise bench ray``: a handful of requests through the two Ray Serve arms (Ray's default router and
``LengthwiseRequestRouter``), no calibration burst (``slow``: a Ray cluster and fresh engine replicas per arm); and the
same bench with each arm's run stood in for (the default tier's counterpart: every step from the trace to the JSON,
the table and the PNG, with what a Ray arm reports). The HTTP arm reuses ``bench fleet``'s engines and gateway, which
other engine tests drive; here it would add two more engine starts to CI's time. This checks the bench's contract, not
the comparison.

What is checked is the JSON contract and what must hold at any scale: every request of every arm completes at exactly
its true length, each arm's requests add up over its replicas, each Ray arm's router counted at least one decision
per request and its time, and the table and PNG are written. The comparison itself needs a bigger machine.
"""

from __future__ import annotations

import io
import json

import pytest

from tests.datafiles import need_files

N = 8


def _check_contract(out: dict, tmp_path, arms: list[str]) -> None:
    from serving.bench.ray.bench import ARMS

    assert json.loads((tmp_path / "bench_ray.json").read_text())["arms"].keys() == out["arms"].keys()
    assert list(out["arms"]) == arms and set(arms) <= set(ARMS) and out["rate"] == 2.0 and out["slo"]["calibrated"] is False
    assert (tmp_path / "bench_ray.png").stat().st_size > 0
    n = out["requests"]
    assert 1 <= n <= N
    for arm, r in out["arms"].items():
        print(arm, {k: r[k] for k in ("slo_attainment", "jct_p50_s", "jct_p99_s", "per_replica_requests", "router")})
        assert r["requests_total"] == r["requests_completed"] == n and r["wrong_or_lost"] == 0, (arm, r)
        assert sum(r["per_replica_requests"].values()) == n and "(none)" not in r["per_replica_requests"], (arm, r)
        assert 0.0 <= r["slo_attainment"] <= 1.0 and 0 < r["jct_p50_s"] <= r["jct_p99_s"], (arm, r)
        router = r["router"]
        if arm == "http":
            assert router is None
            continue
        want = "TimedPowerOfTwoRouter" if arm == "ray-power-of-two" else "LengthwiseRequestRouter"
        assert router["class"] == want and router["decisions"] >= n and router["us_per_decision"] > 0, (arm, router)
        assert r["engine_retries"] == 0 and r["stream_errors"] == 0, (arm, r)
    assert out["arms"]["ray-power-of-two"]["router"]["fallbacks"] == {}


def test_bench_ray_steps_with_each_arm_stood_in_for(tmp_path, data, monkeypatch):
    """Every request answered at its true length by one of two replicas, and the router counters a Ray ingress's /health
    reports: the trace, the predictions, the default SLO, the rows, the table, the PNG and the JSON are the bench's own."""
    # the fleet's workload and tokenizer (serving/bench/fleet.py)
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    from rich.console import Console

    from serving.bench.ray import bench
    from serving.bench.replay import Result

    seen = []

    def ray_arm(cfg, cal, model, jobs, trace, dtype, work, router, console):
        seen.append((router, len(jobs), model))
        res = []
        for j in jobs:
            r = Result(j.index, j.arrival, j.max_tokens, j.trace_output_tokens, j.prompt_tokens, sent=j.arrival)
            r.ok, r.ttft, r.jct, r.output_tokens = True, 0.05, 0.05 + 0.01 * j.trace_output_tokens, j.trace_output_tokens
            r.engine = f"replica-{j.index % 2}"
            res.append(r)
        name = "TimedPowerOfTwoRouter" if router == "power-of-two" else "LengthwiseRequestRouter"
        health = {"routers": {name: {"decisions": len(jobs), "choose_s": 1e-4 * len(jobs), "fallbacks": {}}},
                  "engine_retries": 0, "stream_errors": 0}
        return res, max(r.sent + r.jct for r in res), health

    monkeypatch.setattr(bench, "_ray_arm", ray_arm)
    arms = ["ray-power-of-two", "ray-lengthwise"]
    cfg = bench.RayBenchConfig(arms=arms, max_requests=N, calibrate=False, rate=2.0, kv_blocks=160, max_num_seqs=16, seed=1)
    out = bench.run_ray_bench(cfg, tmp_path / "bench_ray.json", Console(width=200, file=io.StringIO()))
    assert [r for r, _, _ in seen] == ["power-of-two", "lengthwise"] and all(n == out["requests"] for _, n, _ in seen)
    _check_contract(out, tmp_path, arms)


@pytest.mark.slow
def test_bench_ray_json_contract(tmp_path, data):
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    from rich.console import Console

    from serving.bench.ray.bench import RayBenchConfig, run_ray_bench

    arms = ["ray-power-of-two", "ray-lengthwise"]
    cfg = RayBenchConfig(arms=arms, max_requests=N, calibrate=False, rate=2.0, kv_blocks=160, max_num_seqs=16, seed=1)
    out = run_ray_bench(cfg, tmp_path / "bench_ray.json", Console(width=200))
    _check_contract(out, tmp_path, arms)
