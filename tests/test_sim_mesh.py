"""Several models on one simulated mesh: alone it is the single-engine simulator, and sharing costs what it says."""

from __future__ import annotations

import dataclasses

import pytest

from serving.perf.hardware import get_gpu, get_model
from serving.perf.latency import RooflineLatency
from serving.perf.slo import derive_slo
from serving.policy.config import PolicyConfig
from serving.policy.request import Prediction
from serving.sim.engine import poisson_arrivals, simulate
from serving.sim.mesh import MeshModel, simulate_mesh
from serving.sim.workload import TraceRequest

CONFIG = PolicyConfig(block_size=16, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048, tfs=2048)


def _model(name: str, rate: float, seed: int, n: int = 150, **kw) -> MeshModel:
    lat = RooflineLatency(get_model("llama-7b"), get_gpu("a100-80gb"), 1)
    times = poisson_arrivals(n, rate, seed)
    reqs = [TraceRequest(k, float(t), 100 + (k * 37) % 200, 50 + (k * 53) % 300) for k, t in enumerate(times)]
    slo = derive_slo(lat, [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs], 8.0)
    return MeshModel(name, reqs, [Prediction(length=200.0)] * n, "vllm-v0", CONFIG, 2000, lat, slo, **kw)


def test_one_model_alone_on_a_mesh_is_the_single_engine_simulator() -> None:
    m = _model("a", 8.0, 1)
    alone = simulate(m.requests, m.predictions, m.policy, m.config, m.kv_blocks, m.latency, m.slo)
    mesh = simulate_mesh([m])["a"]
    for k in ("requests_completed", "slo_attainment", "jct_p99_s", "ttft_p50_s", "steps", "preemptions"):
        assert getattr(mesh, k) == pytest.approx(getattr(alone, k)), k
    assert mesh.extra["waited_for_mesh_s"] == 0.0


def test_models_sharing_a_mesh_slow_each_other_and_temporal_sharing_more_than_mps() -> None:
    a, b = _model("a", 10.0, 1), _model("b", 10.0, 2)
    alone = simulate_mesh([a])["a"]
    mps = simulate_mesh([a, b], "mps")
    temporal = simulate_mesh([a, b], "temporal")
    # both decode at the same time: each one's reads share the bandwidth with the other's (two steps that mostly read
    # take nearly twice as long), and their prefills take turns
    assert mps["a"].tbt_p50_s > alone.tbt_p50_s * 1.8
    assert mps["a"].extra["waited_for_mesh_s"] > 0 and mps["b"].extra["waited_for_mesh_s"] > 0
    # one step at a time on the mesh: a decode waits out the other model's step as well
    assert temporal["a"].jct_p50_s > mps["a"].jct_p50_s
    assert {r.requests_completed for r in (*mps.values(), *temporal.values())} == {150}


def test_a_smaller_share_of_the_sms_slows_only_the_compute_bound_prefill() -> None:
    full, third = _model("a", 4.0, 3), _model("a", 4.0, 3, prefill_share=0.3, decode_share=0.3)
    f, t = simulate_mesh([full])["a"], simulate_mesh([third])["a"]
    assert t.ttft_p50_s > f.ttft_p50_s * 1.5  # the prompt's FLOPs at 30% of the SMs
    # a memory-bound decode keeps close to its pace (what it loses is the slower prefills that pause it, in vLLM v0)
    assert f.tbt_p50_s <= t.tbt_p50_s < f.tbt_p50_s * 1.3


def test_a_mesh_rejects_shares_outside_0_1_and_an_unknown_sharing() -> None:
    with pytest.raises(ValueError, match="decode_share"):
        _model("a", 1.0, 1, n=2, decode_share=1.5)
    with pytest.raises(ValueError, match="unknown sharing"):
        simulate_mesh([_model("a", 1.0, 1, n=2)], "fair")
    with pytest.raises(ValueError, match="predictions"):
        dataclasses.replace(_model("a", 1.0, 1, n=2), predictions=[])
