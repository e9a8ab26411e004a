"""``lengthwise bench ray`` at CI scale: a handful of requests through the two Ray Serve arms (Ray's default router and
``LengthwiseRequestRouter``), no calibration burst. The HTTP arm reuses ``bench fleet``'s engines and gateway, which
other engine tests drive; here it would add two more engine starts to CI's time. This checks the bench's contract, not
the comparison.

What is checked is the JSON contract and what must hold at any scale: every request of every arm completes at exactly
its true length, each arm's requests add up over its replicas, each Ray arm's router counted at least one decision
per request and its time, and the table and PNG are written. The comparison itself needs a bigger machine.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray")
pytest.importorskip("vllm")

N = 8


def test_bench_ray_json_contract(tmp_path, data):
    from rich.console import Console

    from serving.bench.ray.bench import ARMS, RayBenchConfig, run_ray_bench

    arms = ["ray-power-of-two", "ray-lengthwise"]
    cfg = RayBenchConfig(arms=arms, max_requests=N, calibrate=False, rate=2.0, kv_blocks=160, max_num_seqs=16, seed=1)
    out = run_ray_bench(cfg, tmp_path / "bench_ray.json", Console(width=200))
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
