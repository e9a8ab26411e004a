"""The policy core under hostile predictions, in the simulator (which drives the same policy objects as the engine).

A predictor can be wrong in every way at once: 10x too low, 10x too high, zero, the largest length there is, 16x
multiplicative noise, or a bucket distribution with all its mass in one wrong bucket. None of that may break the
scheduler: the run ends (no deadlock: the simulator raises when a policy schedules nothing with work left), every
request finishes exactly once, the KV ledger stays consistent (``check``: the policy's own ledger check after every
step) and never holds more blocks than the pool. Workloads are small and tight (a pool a few requests fill, arrivals
faster than service), so admission, preemption and re-prediction all run.

The aging bound: ``sjf``, ``lengthwise-sjf`` and ``lengthwise`` order the waiting queue by
``predicted length + alpha x arrival`` (alpha = max_model_len / aging_s), so a request that waited ``aging_s`` outranks
any new arrival. That bounds its *rank*, not its wait: it still waits for the requests ahead of it and for KV. There is no
absolute bound on a request's wait to test; what is tested is the rank property's consequence for a trace whose
arrivals all come within ``aging_s``: nothing is starved (every request finishes), whatever the predictions.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.perf.latency import LinearLatency
from serving.perf.slo import SLO
from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy
from serving.policy.request import Prediction
from serving.sim.engine import repredict_hook
from serving.sim.instance import SimInstance, new_request
from serving.sim.metrics import RequestRecord
from tests.hostile import MODES, TraceRequest, hostile_prediction

pytestmark = pytest.mark.unit

MAX_LEN = 2048
EDGES = (32, 64, 128, 256, 512, 1024)
POLICIES = ("lengthwise", "lengthwise-sjf", "lengthwise-fcfs", "sjf", "ecoserve", "sarathi", "vllm", "orca")


def hostile(mode: str, true_len: int, rng: random.Random) -> Prediction:
    """A prediction of ``true_len`` that is wrong the way ``mode`` says, on this module's lengths and buckets."""
    return hostile_prediction(mode, true_len, rng, MAX_LEN, EDGES)


def run(policy_name: str, mode: str, seed: int, n: int = 24, kv_blocks: int = 96) -> dict[int, RequestRecord]:
    """The simulator's loop (serving/sim/engine.py: simulate), with the checks of this module after every step."""
    rng = random.Random(seed)
    t = 0.0
    trace = []
    for rid in range(n):
        t += rng.expovariate(40.0)  # far faster than one engine serves: a queue forms
        prompt = rng.randint(8, 700)
        trace.append(TraceRequest(rid, t, prompt, rng.randint(1, min(900, MAX_LEN - prompt))))
    preds = {r.rid: hostile(mode, r.output_tokens, rng) for r in trace}
    cfg = PolicyConfig(max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=512, tfs=512, aging_s=60.0)
    by_rid = {r.rid: r for r in trace}

    def repredict(tr, generated: int, pred: Prediction) -> float:
        return pred.remaining_after(generated)

    policy = make_policy(policy_name, cfg, kv_blocks, repredict_hook(repredict, by_rid, preds))
    slo = SLO(2.0, 0.03, 0.015, 0.06, 0.03)
    records: dict[int, RequestRecord] = {}
    inst = SimInstance("i0", policy, LinearLatency(2000, 20, 200), {r.rid: r.output_tokens for r in trace}, records,
                       check=True)
    finished: list[int] = []
    now, nxt = 0.0, 0
    for _ in range(200_000):
        if not (nxt < len(trace) or inst.has_work):
            break
        while nxt < len(trace) and trace[nxt].arrival <= now:
            tr = trace[nxt]
            inst.inbox.append(new_request(tr, preds[tr.rid], slo.jct_limit, MAX_LEN - tr.prompt_tokens))
            records[tr.rid] = RequestRecord(tr.rid, tr.arrival, tr.prompt_tokens, tr.output_tokens,
                                            slo.jct_limit(tr.output_tokens))
            nxt += 1
        if not inst.start(now):
            assert nxt < len(trace), (f"deadlock: {policy_name} scheduled nothing with {len(policy.requests)} requests "
                                      f"left (KV {policy.kv.used}/{policy.kv.total})")
            now = max(now, trace[nxt].arrival)
            continue
        step = inst.end()  # runs the policy's ledger check (check=True)
        now = step.now
        assert 0 <= policy.kv.used <= policy.kv.total, (policy.kv.used, policy.kv.total)
        finished += step.finished
    else:
        raise AssertionError(f"{policy_name} did not finish {n} requests in 200,000 steps")
    assert sorted(finished) == list(range(n)), "every request finishes exactly once"
    assert all(records[r].finished is not None and math.isfinite(records[r].finished) for r in records)
    return records


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_hostile_predictions_never_deadlock_lose_or_overfill(policy, mode, seed):
    run(policy, mode, seed)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_on_the_policy_that_trusts_predictions_most(mode):
    """lengthwise admits by projected peak over predictions: the policy a hostile predictor could hurt most."""
    records = run("lengthwise", mode, seed=7, n=32, kv_blocks=64)
    assert len(records) == 32
