"""The lengthwise scheduler plug-in on vLLM 0.32's real scheduler (real KV manager; fabricated model outputs).

``tests/vllm_harness.py`` builds vLLM's own scheduler over a chosen number of KV blocks and drives it the
way EngineCore does. Every request must end with exactly its ``max_tokens`` tokens, in order, once.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler

from serving.engine.inputs import parse_inputs
from serving.engine.scheduler import LengthwiseScheduler
from serving.engine.settings import ENV, SchedulerSettings
from tests.vllm_harness import expected_tokens, make_request, make_scheduler, run_to_completion

pytestmark = pytest.mark.unit

POLICIES = ["vllm", "sjf", "sarathi", "lengthwise", "lengthwise-fcfs", "ecoserve-D", "ecoserve-SDO", "ecoserve", "orca"]


def _configure(monkeypatch, policy: str, **knobs) -> None:
    monkeypatch.setenv(ENV, json.dumps({"policy": policy, "knobs": knobs, "default_pred_len": 32}))


def _workload(seed: int, n: int, predict: bool = True) -> tuple[list, dict]:
    rng = random.Random(seed)
    reqs, arrivals = [], {}
    for i in range(n):
        prompt, out = rng.randint(4, 60), rng.randint(1, 60)
        pred = max(1, round(out * rng.uniform(0.4, 1.8)))
        reqs.append(make_request(f"r{i}", prompt, out, extra_args={"pred_len": pred} if predict else None))
        arrivals[f"r{i}"] = rng.randint(0, 30)
    return reqs, arrivals


def _assert_exact(run, reqs) -> None:
    for r in reqs:
        res = run.requests[r.request_id]
        assert res.finish_reason == "length", (r.request_id, res.finish_reason, res.status)
        assert list(res.output_tokens) == expected_tokens(r.max_tokens), r.request_id


def _ledger_guard(violations: list):
    def hook(s, i):
        if s.lw_policy.kv.used > s.lw_policy.kv.total or s.kv_cache_manager.block_pool.get_num_free_blocks() < 0:
            violations.append(i)
    return hook


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("blocks", [400, 24], ids=["roomy", "pressure"])
def test_every_request_returns_exactly_its_tokens(monkeypatch, policy, blocks):
    _configure(monkeypatch, policy, padding=0.15, reserve=0.03)
    s = make_scheduler(num_blocks=blocks, max_num_seqs=16, max_num_batched_tokens=64, scheduler_cls=LengthwiseScheduler)
    reqs, arrivals = _workload(1, 24)
    bad: list = []
    run = run_to_completion(s, reqs, arrivals=arrivals, max_steps=5000, before_step=_ledger_guard(bad))
    _assert_exact(run, reqs)
    assert not bad
    assert not s.requests and not s.running and not s.waiting and not s.lw_policy.requests
    assert s.lw_policy.kv.used == 0 and s.lw_stats["finished"] == 24 and s.lw_stats["fallback_predictions"] == 0


@pytest.mark.parametrize("policy", ["lengthwise", "ecoserve"])
def test_pipelined_async_scheduling(monkeypatch, policy):
    """GPU-style async scheduling: step N+1 is planned before step N's tokens arrive."""
    _configure(monkeypatch, policy)
    s = make_scheduler(num_blocks=30, max_num_seqs=8, max_num_batched_tokens=64, scheduler_cls=LengthwiseScheduler)
    reqs, arrivals = _workload(2, 16)
    run = run_to_completion(s, reqs, arrivals=arrivals, max_steps=5000, pipelined=True)
    _assert_exact(run, reqs)
    assert not s.lw_policy.requests and s.lw_policy.kv.used == 0


def test_vllm_policy_schedules_like_stock_vllm(monkeypatch):
    """Policy ``vllm`` through the plug-in makes the same per-step decisions as vLLM's own scheduler,
    KV pressure and recompute preemption included."""
    _configure(monkeypatch, "vllm")
    runs = {}
    for cls in (AsyncScheduler, LengthwiseScheduler):
        s = make_scheduler(num_blocks=20, max_num_seqs=8, max_num_batched_tokens=48, scheduler_cls=cls)
        reqs, arrivals = _workload(3, 14)
        runs[cls] = run_to_completion(s, reqs, arrivals=arrivals, max_steps=5000)
        _assert_exact(runs[cls], reqs)
    stock, ours = runs[AsyncScheduler], runs[LengthwiseScheduler]
    assert stock.total_preemptions > 0  # the case is not trivial
    assert [st["num_scheduled_tokens"] for st in ours.steps] == [st["num_scheduled_tokens"] for st in stock.steps]
    assert ours.total_preemptions == stock.total_preemptions


def test_extra_args_reach_the_policy_and_missing_ones_are_counted(monkeypatch):
    _configure(monkeypatch, "lengthwise")
    s = make_scheduler(num_blocks=200, scheduler_cls=LengthwiseScheduler)
    with_pred = make_request("a", 10, 50, extra_args={"pred_len": 40, "pred_hi": 60, "pred_bucket": 2, "slo_s": 5.0})
    without = make_request("b", 10, 20)
    broken = make_request("c", 10, 20, extra_args={"pred_len": "many"})
    for r in (with_pred, without, broken):
        s.add_request(r)
    twins = {k: s.lw_policy.requests[rid] for k, rid in s._rid_of.items()}
    assert twins["a"].pred.length == 40 and twins["a"].pred.hi == 60 and twins["a"].pred.bucket == 2
    assert twins["a"].deadline == pytest.approx(with_pred.arrival_time + 5.0)
    assert twins["b"].pred.length == 20  # default 32 clamped to max_tokens
    assert s.lw_stats["fallback_predictions"] == 2 and s.lw_stats["invalid_inputs"] == 1
    run = run_to_completion(s, [])
    assert all(res.finish_reason == "length" for res in run.requests.values())


def test_abort_leaves_the_policy(monkeypatch):
    from vllm.v1.request import RequestStatus

    _configure(monkeypatch, "ecoserve")
    s = make_scheduler(num_blocks=100, scheduler_cls=LengthwiseScheduler)
    reqs = [make_request(f"r{i}", 20, 30, extra_args={"pred_len": 30}) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    from tests.vllm_harness import step

    for _ in range(3):
        step(s)
    s.finish_requests(["r0", "r3"], RequestStatus.FINISHED_ABORTED)
    assert set(s._rid_of) == {"r1", "r2"} and len(s.lw_policy.requests) == 2 and s.lw_stats["aborted"] == 2
    run = run_to_completion(s, [])
    assert {k for k, v in run.requests.items() if v.finish_reason == "length"} == {"r1", "r2"}
    assert s.lw_policy.kv.used == 0


def test_ecoserve_pauses_hold_kv_in_vllm(monkeypatch):
    """Under-predicted GTs are paused by the policy: vLLM keeps them running with their blocks but skips them."""
    _configure(monkeypatch, "ecoserve", padding=0.0, reserve=0.0)
    s = make_scheduler(num_blocks=14, max_num_seqs=8, max_num_batched_tokens=64, scheduler_cls=LengthwiseScheduler)
    reqs = [make_request(f"r{i}", 16, 48, extra_args={"pred_len": 8}) for i in range(4)]  # predicted 8, true 48
    run = run_to_completion(s, reqs, max_steps=5000)
    _assert_exact(run, reqs)
    assert s.lw_policy.stats["pauses"] > 0 and s.lw_stats["held_request_steps"] > 0


def test_settings_errors_are_clear(monkeypatch):
    monkeypatch.setenv(ENV, "{policy: vllm")
    with pytest.raises(ValueError, match="not valid JSON"):
        SchedulerSettings.from_vllm({})
    with pytest.raises(ValueError, match="oops"):
        SchedulerSettings.from_vllm({"lengthwise": {"policy": "vllm", "oops": 1}})
    assert SchedulerSettings.from_vllm({"lengthwise": {"policy": "sjf"}}).policy == "sjf"


def test_parse_inputs_distribution_and_deadline():
    x = parse_inputs({"pred_len": 10, "pred_edges": [100, 200], "pred_probs": [0.5, 0.3, 0.2], "deadline": 99.0},
                     arrival=1.0, max_tokens=None, default_pred_len=256)
    assert x.prediction.edges == (100, 200) and x.deadline == 99.0 and not x.fallback_prediction
    y = parse_inputs({"pred_len": 10, "pred_edges": [100], "pred_probs": [1.0]}, arrival=1.0, max_tokens=5, default_pred_len=256)
    assert y.invalid and y.fallback_prediction and y.prediction.length == 5
