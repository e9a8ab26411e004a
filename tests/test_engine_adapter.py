"""The lengthwise scheduler plug-in on vLLM 0.32's real scheduler (real KV manager; fabricated model outputs).

``tests/vllm_harness.py`` builds vLLM's own scheduler over a chosen number of KV blocks and drives it the
way EngineCore does. Every request must end with exactly its ``max_tokens`` tokens, in order, once.
"""

from __future__ import annotations

import json
import random
import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.request import RequestStatus

from serving.engine.inputs import parse_inputs
from serving.engine.scheduler import LengthwiseScheduler
from serving.engine.settings import ENV, SchedulerSettings
from tests.vllm_harness import (
    ForeignBlocks,
    check_queues,
    expected_tokens,
    make_request,
    make_scheduler,
    run_to_completion,
    step_full,
)

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


@pytest.mark.parametrize("policy", ["vllm", "lengthwise", "ecoserve", "muxserve"])
def test_no_plan_runs_more_adapters_than_the_engine_holds(monkeypatch, policy):
    """An engine serving two LoRA adapters with one slot (``max_loras=1``) and base-model requests beside them: the
    plug-in reads the slots from vLLM, its plans never put both adapters in one step (vLLM would skip one and the plan
    would differ from the step; on running requests vLLM asserts it), and every request still ends exactly."""
    _configure(monkeypatch, policy)
    s = make_scheduler(num_blocks=60, max_num_seqs=8, max_num_batched_tokens=64, scheduler_cls=LengthwiseScheduler,
                       max_loras=1)
    assert s.lw_policy.cfg.max_loras == 1
    rng = random.Random(4)
    adapters = [None, ("terse", 1), ("long", 2)]
    reqs = [make_request(f"r{i}", rng.randint(4, 40), rng.randint(1, 40), extra_args={"pred_len": 20},
                         lora=adapters[i % 3]) for i in range(18)]
    lora_of = {r.request_id: r.lora_request.lora_name for r in reqs if r.lora_request}
    run = run_to_completion(s, reqs, arrivals={r.request_id: i // 6 for i, r in enumerate(reqs)}, max_steps=5000)
    _assert_exact(run, reqs)
    steps = [{lora_of[rid] for rid in st["num_scheduled_tokens"] if rid in lora_of} for st in run.steps]
    assert all(len(x) <= 1 for x in steps) and {"terse", "long"} <= set().union(*steps)
    assert s.lw_stats["plan_mismatch_steps"] == 0 and s.lw_stats["finished"] == 18


@pytest.mark.parametrize("policy", ["vllm", "lengthwise", "ecoserve", "muxserve"])
@pytest.mark.parametrize("max_loras", [2, 0], ids=["lora", "no-lora"])
def test_with_lora_a_request_computing_prompt_logprobs_has_its_prefill_steps_alone(monkeypatch, policy, max_loras):
    """vLLM 0.32 computes prompt logprobs with one LoRA row per request in the step; on an engine with LoRA on, a step
    that prefills such a request beside any other kills the engine core (serving/engine/levers.py). With LoRA on, each
    such step carries that request alone; without LoRA, nothing changes; every request still ends exactly."""
    _configure(monkeypatch, policy)
    s = make_scheduler(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=32, scheduler_cls=LengthwiseScheduler,
                       max_loras=max_loras)
    reqs = [make_request(f"r{i}", 20 + 7 * i, 12, extra_args={"pred_len": 12},
                         lora=(None, ("terse", 1), ("long", 2))[i % 3] if max_loras else None) for i in range(9)]
    asking = {"r2", "r5"}  # long prompts: prefilled in several chunks of the 32-token budget
    for r in reqs:
        if r.request_id in asking:
            r.sampling_params.prompt_logprobs = 1
    run = run_to_completion(s, reqs, arrivals={r.request_id: i // 3 for i, r in enumerate(reqs)}, max_steps=5000)
    _assert_exact(run, reqs)
    prompt_of = {r.request_id: r.num_prompt_tokens for r in reqs}
    computed = dict.fromkeys(prompt_of, 0)
    shared = 0
    for st in run.steps:
        tokens = st["num_scheduled_tokens"]
        shared += any(rid in asking and computed[rid] < prompt_of[rid] for rid in tokens) and len(tokens) > 1
        for rid, n in tokens.items():
            computed[rid] += n
    if max_loras:
        assert shared == 0 and s.lw_stats["alone_steps"] > 0
    else:
        assert shared > 0 and s.lw_stats["alone_steps"] == 0, "without LoRA the plan is left as it is"


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


# ---------------------------------------------------------------------------------------------------------------------
# KV pressure the plan did not foresee: vLLM's own preemption must never take what the plan holds
# ---------------------------------------------------------------------------------------------------------------------

def _undershooting_workload(seed: int, n: int) -> tuple[list, dict]:
    """Predictions at 20-60% of the true length: the policies pause (ecoserve) or re-predict under pressure."""
    rng = random.Random(seed)
    reqs, arrivals = [], {}
    for i in range(n):
        prompt, out = rng.randint(8, 40), rng.randint(20, 80)
        pred = max(1, round(out * rng.uniform(0.2, 0.6)))
        reqs.append(make_request(f"r{i}", prompt, out, extra_args={"pred_len": pred}, priority=rng.randint(0, 3)))
        arrivals[f"r{i}"] = rng.randint(0, 20)
    return reqs, arrivals


def pressure_run(scheduler_cls, policy: str, tfs: int | None, foreign: bool, vllm_policy: str, pipelined: bool,
                 seed: int = 4):
    """A tight pool (15 blocks of 16 tokens for 14 requests), under-shooting predictions, and optionally KV held
    outside the ledger's view; every step checks that no request is lost or duplicated between vLLM's queues."""
    settings = {"policy": policy, "knobs": {"padding": 0.0, "reserve": 0.0}, "default_pred_len": 32}
    if tfs:
        settings["tfs"] = tfs
    s = make_scheduler(num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64, scheduler_cls=scheduler_cls,
                       policy=vllm_policy, additional_config={"lengthwise": settings})
    reqs, arrivals = _undershooting_workload(seed, 14)
    hold = ForeignBlocks(k=3, period=40) if foreign else None

    def before_step(sched, i):
        check_queues(sched)
        if hold is not None:
            hold(sched, i)

    run = run_to_completion(s, reqs, arrivals=arrivals, max_steps=5000, pipelined=pipelined, before_step=before_step)
    return s, reqs, run


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("vllm_policy", ["fcfs", "priority"])
@pytest.mark.parametrize(("policy", "tfs", "foreign"), [("ecoserve", None, False), ("ecoserve", None, True),
                                                        ("lengthwise", 8, True)],
                         ids=["ecoserve-pipelining", "ecoserve-foreign-kv", "lengthwise-foreign-kv"])
def test_vllm_never_preempts_a_request_the_plan_holds(policy, tfs, foreign, vllm_policy, pipelined, record_property):
    """When vLLM's allocation fails mid-step (EcoServe's KVC pipelining lends spans in tokens, while a hosted GT
    needs whole blocks of its own; or KV held outside the ledger), vLLM preempts on its own: its victim is the
    request the plan lets go first, never one the plan holds out of the step with its KV (a paused or waiting
    GT), and the policy is told, so it does not keep planning for KV that is gone."""
    s, reqs, run = pressure_run(LengthwiseScheduler, policy, tfs, foreign, vllm_policy, pipelined)
    _assert_exact(run, reqs)
    st = s.lengthwise_stats()
    for key in ("vllm_preemptions", "vllm_preempted_held", "plan_mismatch_steps", "steps", "held_request_steps"):
        record_property(key, st[key])
    assert st["vllm_preemptions"] > 0  # not trivial: vLLM had to choose a victim
    assert st["vllm_preempted_held"] == 0
    if policy == "ecoserve":
        assert st["pauses"] > 0 and st["held_request_steps"] > 0
    assert not s.lw_policy.requests and s.lw_policy.kv.used == 0


@pytest.mark.parametrize("vllm_policy", ["fcfs", "priority"])
def test_vllm_victim_is_the_plans_last_request_not_a_held_one(monkeypatch, vllm_policy):
    """The lever itself: c is held by the plan and is vLLM's natural victim (last in ``running`` and, under the
    priority policy, the worst priority); a needs a block that is not there. vLLM preempts b, the plan's last."""
    _configure(monkeypatch, "vllm")
    s = make_scheduler(num_blocks=5, max_num_batched_tokens=64, scheduler_cls=LengthwiseScheduler, policy=vllm_policy)
    a, b, c = (make_request(k, n, 6, extra_args={"pred_len": 6}, priority=p)
               for k, n, p in (("a", 16, 0), ("b", 8, 1), ("c", 8, 2)))
    for r in (a, b, c):
        s.add_request(r)
    step_full(s)  # the three prompts: 3 of the 4 blocks
    assert [r.request_id for r in s.running] == ["a", "b", "c"]
    foreign = s.kv_cache_manager.block_pool.get_new_blocks(1)  # the 4th block, outside the plan's view
    real, rid_c = s.lw_policy.schedule, s._rid_of["c"]

    def hold_c(now):
        plan = real(now)
        plan.tokens.pop(rid_c, None)
        return plan

    s.lw_policy.schedule = hold_c
    rec = step_full(s)  # a's first decode needs a second block
    s.lw_policy.schedule = real
    assert rec.preempted_ids == {"b"} and rec.num_scheduled_tokens == {"a": 1}
    assert c.status == RequestStatus.RUNNING and c.num_computed_tokens == 8  # c keeps its KV
    assert s.lw_stats["vllm_preemptions"] == 1 and s.lw_stats["vllm_preempted_held"] == 0
    twin_b = s.lw_policy.requests[s._rid_of["b"]]
    assert twin_b.computed == 0 and twin_b in s.lw_policy.waiting  # the policy knows b's KV is gone
    s.kv_cache_manager.block_pool.free_blocks(foreign)
    run_to_completion(s, [])
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED and list(r.output_token_ids) == expected_tokens(6)
               for r in (a, b, c))


def test_the_kv_holding_queue_is_found_under_either_vllm_name(monkeypatch):
    """vLLM 0.32 calls the queue of requests that wait holding KV ``kv_holding_waiting``; 0.26 (the newest CUDA build
    for torch 2.11) ``skipped_waiting``. The plug-in works on whichever the scheduler has, and refuses at start a
    vLLM with neither, naming the version to install."""
    _configure(monkeypatch, "vllm")
    assert make_scheduler(scheduler_cls=LengthwiseScheduler)._lw_kv_queue == "kv_holding_waiting"
    init = AsyncScheduler.__init__

    def renamed(to):
        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            queue = self.__dict__.pop("kv_holding_waiting")
            if to:
                setattr(self, to, queue)
        return __init__

    monkeypatch.setattr(AsyncScheduler, "__init__", renamed("skipped_waiting"))
    assert make_scheduler(scheduler_cls=LengthwiseScheduler)._lw_kv_queue == "skipped_waiting"
    monkeypatch.setattr(AsyncScheduler, "__init__", renamed(None))
    with pytest.raises(RuntimeError, match=r"install vllm==0\.32\.0"):
        make_scheduler(scheduler_cls=LengthwiseScheduler)


def test_kv_holding_waiting_is_gated_by_the_plan(monkeypatch):
    """vLLM drains ``kv_holding_waiting`` (requests that hold KV while waiting: a KV connector's finished load,
    a streaming session) before ``waiting``. The plug-in presents it holding only what the plan admits, and
    puts the rest back: here the plan gives the whole budget to b, which came first."""
    _configure(monkeypatch, "vllm")
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=32, scheduler_cls=LengthwiseScheduler)
    b = make_request("b", 40, 4, extra_args={"pred_len": 4})
    a = make_request("a", 40, 4, extra_args={"pred_len": 4})
    s.add_request(b)
    # a arrives with KV for 16 prompt tokens, the state a connector's async load leaves it in (WAITING,
    # num_computed_tokens > 0): vLLM queues it in kv_holding_waiting
    assert s.kv_cache_manager.allocate_slots(a, 16) is not None
    a.num_computed_tokens = 16
    s.add_request(a)
    assert list(s.kv_holding_waiting) == [a] and list(s.waiting) == [b]
    rec = step_full(s)
    assert rec.num_scheduled_tokens == {"b": 32}
    assert list(s.kv_holding_waiting) == [a] and a.num_computed_tokens == 16 and s.lw_stats["plan_mismatch_steps"] == 0
    check_queues(s)
    rec = step_full(s)  # b's last 8 prompt tokens, then a's 24 as the plan admits it
    assert rec.num_scheduled_tokens == {"b": 8, "a": 24} and not s.kv_holding_waiting
    run_to_completion(s, [])
    for r in (a, b):
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and list(r.output_token_ids) == expected_tokens(4)
    assert s.lw_stats["plan_mismatch_steps"] == 0


def test_speculative_decoding_is_refused_at_start(monkeypatch):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    from tests.vllm_harness import tiny_model_dir

    _configure(monkeypatch, "lengthwise")
    target = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True, dtype="float32", seed=0, max_model_len=4096)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3, prompt_lookup_min=1,
                             target_model_config=target, target_parallel_config=ParallelConfig())
    with pytest.raises(ValueError, match="speculative decoding .* not supported; drop --speculative-config") as err:
        make_scheduler(scheduler_cls=LengthwiseScheduler, speculative_config=spec, async_scheduling=False)
    assert "\n" not in str(err.value)
    stock = make_scheduler(scheduler_cls=AsyncScheduler, speculative_config=spec, async_scheduling=False)
    assert stock.num_spec_tokens == 2  # the configuration itself is valid: stock vLLM takes it


def test_policy_preemption_is_stamped_on_vllms_clock(monkeypatch):
    """A preemption the policy chooses is recorded (request events, log_stats) on the clock vLLM's own schedule()
    passes to _preempt_request: time.monotonic(), not time.time()."""
    _configure(monkeypatch, "vllm")
    s = make_scheduler(num_blocks=8, max_num_batched_tokens=256, scheduler_cls=LengthwiseScheduler, log_stats=True)
    reqs = [make_request(f"p{i}", 30, 30, extra_args={"pred_len": 30}) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    stamps = []
    while not stamps:
        t0 = time.monotonic()
        rec = step_full(s)
        t1 = time.monotonic()
        for rid in rec.preempted_ids:
            stamps += [(t0, e.timestamp, t1) for e in s.requests[rid].events if e.type.name == "PREEMPTED"]
    assert s.lw_stats["policy_preemptions"] == 1 and s.lw_stats["vllm_preemptions"] == 0
    assert all(t0 <= t <= t1 for t0, t, t1 in stamps), stamps
    _assert_exact(run_to_completion(s, []), [])


@pytest.mark.parametrize("policy", ["ecoserve", "lengthwise"])
def test_preemptions_between_steps_reach_the_policy_before_it_plans(monkeypatch, policy):
    """``reset_prefix_cache(reset_running_requests=True)`` preempts every running request outside schedule(): the
    policy learns it before its next plan (nothing planned for KV that is gone) and every request still ends exactly."""
    _configure(monkeypatch, policy, padding=0.15, reserve=0.03)
    s = make_scheduler(num_blocks=60, max_num_seqs=8, max_num_batched_tokens=64, scheduler_cls=LengthwiseScheduler,
                       enable_prefix_caching=True)
    reqs = [make_request(f"r{i}", 20, 30, extra_args={"pred_len": 30}) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    for _ in range(6):
        step_full(s)
    dropped = {r.request_id for r in s.running}
    assert dropped and s.reset_prefix_cache(reset_running_requests=True)
    step_full(s)
    assert all(s.lw_policy.requests[s._rid_of[req_id]].preemptions == 1 for req_id in dropped)
    assert s.lw_stats["vllm_preemptions"] == len(dropped)
    assert s.lw_stats["plan_mismatch_steps"] == 0  # the plan already had them recompute from scratch
    run_to_completion(s, [])
    assert all(list(r.output_token_ids) == expected_tokens(30) for r in reqs)
    assert not s.lw_policy.requests and s.lw_policy.kv.used == 0
