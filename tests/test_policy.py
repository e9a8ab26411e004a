"""Scheduling policies driven directly, the way vLLM's tests/v1/core drive schedule()/update_from_output().

``drive`` plays the host: it adds requests when their arrival step comes, asks the policy for a plan, decides
which requests emitted their last token (it alone knows the true response lengths), applies the step and
checks the invariants (KV ledger, per-request KV coverage, EcoServe's own ``check()``) after every step.
One step is one unit of time, so ``now`` is the step index.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.policy.base import PolicyError, StepPlan
from serving.policy.config import PolicyConfig
from serving.policy.ecoserve import EcoServe
from serving.policy.registry import make_policy, policy_names
from serving.policy.request import Phase, Prediction, Request

pytestmark = pytest.mark.unit

POLICIES = ["vllm", "vllm-v0", "sarathi", "sjf", "orca", "fcfs-max-alloc", "ecoserve-D", "ecoserve-SD", "ecoserve-SDO",
            "ecoserve", "ecoserve-DP", "lengthwise", "lengthwise-sjf", "lengthwise-fcfs", "seallm", "muxserve",
            "lengthwise-posterior", "lengthwise-prior", "lengthwise-own", "lengthwise-gittins"]
VLLM_LIKE = ("vllm", "vllm-v0", "sarathi", "sjf", "lengthwise", "lengthwise-sjf", "lengthwise-fcfs", "seallm",
             "lengthwise-posterior", "lengthwise-prior", "lengthwise-own", "lengthwise-gittins",
             "muxserve")
MAX_ALLOC = ("orca", "fcfs-max-alloc")


# -- the host -------------------------------------------------------------------------------------------
@dataclass
class Step:
    now: int
    tokens: dict[int, int]
    preempted: list[int]
    paused: list[int]
    finished: list[int]


@dataclass
class Run:
    done: dict[int, int] = field(default_factory=dict)       # rid -> step that emitted its last token
    emitted: dict[int, int] = field(default_factory=dict)    # rid -> output tokens emitted
    first: dict[int, int] = field(default_factory=dict)      # rid -> first step it got tokens
    gt_start: dict[int, int] = field(default_factory=dict)   # rid -> first step it got tokens with an output token out
    scheduled: dict[int, int] = field(default_factory=dict)  # rid -> all tokens it was given
    prompt_tokens: dict[int, int] = field(default_factory=dict)  # rid -> tokens given before its first output token
    lost: dict[int, int] = field(default_factory=dict)       # rid -> computed tokens thrown away by recompute preemption
    trace: list[Step] = field(default_factory=list)
    max_batch: int = 0
    aborted: set[int] = field(default_factory=set)           # rids the host aborted while they were live


class Stuck(AssertionError):
    pass


def drive(policy, requests_with_truth, arrivals=None, max_steps=100_000, on_plan=None, aborts=None) -> Run:
    """Run requests (``(Request, true output length)``) to completion; ``arrivals`` are steps (default: each arrival).

    ``aborts`` maps request ids to the step at which the host aborts them (client gone).
    """
    aborts = dict(aborts or {})
    truth = {r.rid: t for r, t in requests_with_truth}
    steps_in = arrivals if arrivals is not None else [int(r.arrival) for r, _ in requests_with_truth]
    order = sorted(zip(steps_in, range(len(requests_with_truth))))
    pending = [(a, requests_with_truth[i][0]) for a, i in order]
    eco = isinstance(policy, EcoServe)
    bs = policy.cfg.block_size
    run = Run()
    now = nxt = 0
    while nxt < len(pending) or policy.has_work:
        while nxt < len(pending) and pending[nxt][0] <= now:
            policy.add(pending[nxt][1], float(now))
            nxt += 1
        for rid in [rid for rid, t in aborts.items() if t <= now and any(rid == r.rid for _, r in pending[:nxt])]:
            del aborts[rid]
            if policy.abort(rid, float(now)):
                run.aborted.add(rid)
                assert rid not in policy.requests and policy.kv.of(rid) == 0
        if not policy.has_work and nxt == len(pending):
            break
        before = {rid: r.computed for rid, r in policy.requests.items()}
        plan: StepPlan = policy.schedule(float(now))
        if not plan.tokens:
            if nxt < len(pending):
                now = pending[nxt][0]  # idle until the next arrival
                continue
            raise Stuck(f"{policy.name}: empty plan at step {now} with {len(policy.requests)} requests left, "
                        f"preempted={plan.preempted} paused={plan.paused}")
        assert len(set(plan.preempted)) == len(plan.preempted), plan
        for rid in plan.preempted:
            run.lost[rid] = run.lost.get(rid, 0) + before[rid]
            r = policy.requests[rid]
            if rid not in plan.tokens:  # (EcoServe may restart a preempted PT in the same step)
                assert r.computed == 0 and policy.kv.of(rid) == 0 and r.phase is Phase.WAITING, (rid, r)
        for rid in plan.paused:
            if rid not in plan.preempted:  # offload-free: the KV stays
                assert policy.kv.of(rid) > 0 and policy.requests[rid].computed == before[rid], rid
        if on_plan is not None:
            on_plan(now, plan, policy)
        finished = []
        for rid, n in plan.tokens.items():
            assert rid in policy.requests, f"finished or unknown request {rid} scheduled"
            r = policy.requests[rid]
            assert n >= 1 and r.computed + n <= r.seq_len, (rid, n, r.computed, r.seq_len)
            if not (eco and rid in policy.host_of):  # a hosted GT writes into its host's span
                assert policy.kv.of(rid) * bs >= r.computed + n, (policy.name, rid, r.computed, n, policy.kv.of(rid))
            run.scheduled[rid] = run.scheduled.get(rid, 0) + n
            run.first.setdefault(rid, now)
            if r.generated == 0:
                run.prompt_tokens[rid] = run.prompt_tokens.get(rid, 0) + n
            else:
                run.gt_start.setdefault(rid, now)
            if r.emits_token(n):
                run.emitted[rid] = run.emitted.get(rid, 0) + 1
                assert run.emitted[rid] <= truth[rid]
                if run.emitted[rid] == truth[rid]:
                    finished.append(rid)
        run.max_batch = max(run.max_batch, len(plan.tokens))
        retired = {rid: policy.requests[rid] for rid in finished}
        policy.update(plan, finished, float(now))
        run.trace.append(Step(now, dict(plan.tokens), list(plan.preempted), list(plan.paused), finished))
        for rid, r in retired.items():
            assert rid not in run.done and rid not in policy.requests
            assert r.generated == truth[rid] and r.phase is Phase.FINISHED
            run.done[rid] = now
        policy.kv.check()
        for rid, r in policy.requests.items():
            assert r.generated == run.emitted.get(rid, 0)
            if eco and rid in policy.host_of:
                assert policy.kv.of(rid) * bs >= policy.origin[rid]
            else:
                assert policy.kv.of(rid) * bs >= r.computed, (policy.name, rid, r.computed, policy.kv.of(rid))
        if eco:
            policy.check()
        now += 1
        assert len(run.trace) <= max_steps, f"{policy.name}: no finish within {max_steps} steps"
    assert policy.kv.used == 0 and not policy.kv.held, "KV leaked after every request finished"
    if eco:
        assert not (policy.running or policy.prefilling or policy.gt_queue or policy.pt_queue or policy.by_rl or policy.groups
                    or policy.host_of or policy.cap or policy.origin or any(policy.lends.values()))
    return run


def cfg(**kw) -> PolicyConfig:
    """Small, exact numbers for hand-built scenarios: 4-token blocks, no padding, no reserve, no aging."""
    base = {"block_size": 4, "max_num_seqs": 64, "max_num_batched_tokens": 256, "tfs": 256, "max_model_len": 1024,
            "padding": 0.0, "reserve": 0.0, "buffer": 0.15, "group_tokens": 8, "aging_s": 1e9}
    return PolicyConfig(**{**base, **kw})


def req(rid, prompt, pred, arrival=0, **kw) -> Request:
    return Request(rid, float(arrival), prompt, Prediction(length=pred), **kw)


# -- vllm -----------------------------------------------------------------------------------------------
def test_vllm_first_scheduling_is_fcfs():
    pol = make_policy("vllm", cfg(max_num_batched_tokens=8), kv_blocks=200)
    order = [3, 1, 4, 0, 2]
    reqs = [(req(rid, 8, 5), 5) for rid in order]
    run = drive(pol, reqs, arrivals=[0] * len(reqs))
    firsts = [run.first[rid] for rid in order]
    assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts), firsts


def test_vllm_chunked_prefill_respects_token_budget():
    budget = 16
    pol = make_policy("vllm", cfg(max_num_batched_tokens=budget), kv_blocks=200)
    reqs = [(req(0, 50, 4), 4), (req(1, 30, 3), 3), (req(2, 5, 2), 2)]
    run = drive(pol, reqs, arrivals=[0, 0, 2])
    assert all(sum(s.tokens.values()) <= budget for s in run.trace)
    assert [s.tokens.get(0) for s in run.trace[:4]] == [16, 16, 16, 2]  # 50 = 16+16+16+2, then decodes
    assert run.prompt_tokens == {0: 50, 1: 30, 2: 5}
    assert max(sum(s.tokens.values()) for s in run.trace) == budget  # the budget is actually filled


def test_vllm_preempts_newest_running_by_recompute():
    # three 8-token prompts in 4-token blocks: 9 blocks hold 3 x 12 tokens; the 13th token needs a 4th block each
    pol = make_policy("vllm", cfg(), kv_blocks=9)
    reqs = [(req(rid, 8, 8), 8) for rid in range(3)] + [(req(3, 8, 8, arrival=1), 8)]  # rid 3 waits: no KV left
    seen = {}

    def on_plan(now, plan, p):
        if plan.preempted and "step" not in seen:
            seen.update(step=now, preempted=list(plan.preempted), tokens=dict(plan.tokens), head=p.waiting.peek(0).rid,
                        computed=p.requests[2].computed, running=[r.rid for r in p.running])

    run = drive(pol, reqs, on_plan=on_plan)
    assert seen["step"] == 5
    assert seen["preempted"] == [2]                 # the newest running request, not the one that needed a block
    assert seen["computed"] == 0 and seen["head"] == 2  # recompute: KV dropped, back at the head of waiting (before rid 3)
    assert 2 not in seen["tokens"] and set(seen["tokens"]) == {0, 1} and seen["running"] == [0, 1]
    assert run.lost == {2: 12} and pol.stats["preemptions"] == 1
    assert run.done[0] < run.done[2] and run.done[1] < run.done[2]
    assert run.emitted == {0: 8, 1: 8, 2: 8, 3: 8}
    assert run.scheduled[2] == 8 + 8 - 1 + 12        # the 12 lost tokens were computed again
    resume = min(s.now for s in run.trace if s.now > 5 and 2 in s.tokens)
    assert run.trace[resume].tokens[2] == 8 + 5      # prompt + the 5 tokens it had generated, in one recompute


def test_vllm_v0_prefill_steps_stall_decodes():
    """The old prefill-first scheduler: a step with a whole prompt in it carries no decode token."""
    pol = make_policy("vllm-v0", cfg(max_num_batched_tokens=16, max_model_len=64), kv_blocks=200)
    reqs = [(req(0, 10, 6), 6), (req(1, 40, 3), 3), (req(2, 12, 2), 2)]
    run = drive(pol, reqs, arrivals=[0, 2, 3])
    assert run.trace[0].tokens == {0: 10}
    assert run.trace[2].tokens == {1: 40}          # whole prompt beyond the 16-token budget (budget >= max_model_len)
    assert run.trace[3].tokens == {2: 12}          # rid 0 and 1 decode nothing while a prompt runs
    for s in run.trace:
        prompts = [rid for rid, n in s.tokens.items() if n > 1]
        assert not prompts or all(n > 1 for n in s.tokens.values()), s
    assert run.emitted == {0: 6, 1: 3, 2: 2}


def test_vllm_admission_needs_whole_sequence_to_fit():
    # request 0 holds 4 of 6 blocks for two steps; request 1's first 1-token chunk would fit, its 12-token prompt not
    pol = make_policy("vllm", cfg(max_num_batched_tokens=16), kv_blocks=6)
    run = drive(pol, [(req(0, 15, 2), 2), (req(1, 12, 3), 3)])
    assert run.trace[0].tokens == {0: 15}
    assert run.trace[1].tokens == {0: 1}
    assert run.first[1] == 2 and run.done[0] == 1


@pytest.mark.parametrize("name", ["sjf", "vllm"])
def test_no_admission_in_a_step_that_preempted(name):
    """vLLM admits nobody in a step that preempted.

    Only sjf (vLLM's priority policy, victim re-queued by priority) can show it: there a better-ranked newcomer is at
    the head of waiting and would fit. vllm's FCFS victim goes back to the head and never fits in the step that evicted it.
    """
    c = cfg()
    base = [(req(0, 8, 10), 10), (req(1, 8, 20), 8)]
    dry = drive(make_policy(name, c, 6), [(req(r.rid, r.prompt_len, r.pred.length), t) for r, t in base])
    s = next(x.now for x in dry.trace if x.preempted)
    pol = make_policy(name, c, 6)
    newcomer = req(2, 4, 1, arrival=s)
    run = drive(pol, [*base, (newcomer, 1)])
    assert run.trace[s].preempted == [1]
    assert 2 not in run.trace[s].tokens            # it would fit (1 block of 2 free), but a preempting step admits nobody
    if name == "sjf":
        assert run.first[2] == s + 1               # next step: at the head of the priority queue
    assert run.done[2] > s


def test_sjf_priority_victim_does_not_empty_the_step():
    """The priority victim can be the request being scheduled while better-ranked ones follow it in the running list."""
    pol = make_policy("sjf", cfg(), kv_blocks=4)
    run = drive(pol, [(req(0, 4, 100), 13), (req(1, 4, 1, arrival=1), 8)])
    s = next(x for x in run.trace if x.preempted)
    assert s.preempted == [0] and s.tokens == {1: 1}  # worst priority (oldest) goes; the short one still runs
    assert run.done[1] < run.done[0]


# -- sjf ------------------------------------------------------------------------------------------------
def test_sjf_shorter_prediction_first_on_equal_arrival():
    pol = make_policy("sjf", cfg(max_num_seqs=1), kv_blocks=200)
    preds = {0: 50, 1: 10, 2: 30, 3: 20}
    run = drive(pol, [(req(rid, 8, p), 3) for rid, p in preds.items()])
    assert sorted(preds, key=lambda rid: run.first[rid]) == [1, 3, 2, 0]
    fcfs = drive(make_policy("vllm", cfg(max_num_seqs=1), kv_blocks=200), [(req(rid, 8, p), 3) for rid, p in preds.items()])
    assert sorted(preds, key=lambda rid: fcfs.first[rid]) == [0, 1, 2, 3]


@pytest.mark.parametrize("aging_s, bounded", [(20.0, True), (1e9, False)])
def test_sjf_aging_bounds_starvation(aging_s, bounded):
    """A long request amid a stream of short ones: after ``aging_s`` no fresh arrival outranks it."""
    c = cfg(max_num_seqs=1, max_model_len=512, aging_s=aging_s)
    n_short = 150
    reqs = [(req(0, 4, 300), 5)] + [(req(i, 4, 3, arrival=i - 1), 3) for i in range(1, n_short + 1)]
    run = drive(make_policy("sjf", c, 200), reqs)
    assert len(run.done) == n_short + 1
    after = [rid for rid in range(1, n_short + 1) if reqs[rid][0].arrival >= aging_s]
    if bounded:
        assert all(run.first[rid] > run.first[0] for rid in after)
        assert run.first[0] <= 3 * aging_s + 3      # only shorts that arrived within aging_s (3 steps each) go first
    else:
        assert run.first[0] > max(run.first[rid] for rid in range(1, n_short + 1))  # starved to the very end


# -- orca / fcfs-max-alloc -------------------------------------------------------------------------------
# -- lengthwise: the late tier ---------------------------------------------------------------------------
def _late_tier_run(name, aging_s=1e9, late_deadline=12.0):
    """One slot free beside a long running request: a short request that can no longer meet its deadline (8 steps
    to go, 2 left) and a longer one that can; one step is one second, so the measured TBT is 1 s."""
    pol = make_policy(name, cfg(max_num_seqs=2, aging_s=aging_s), kv_blocks=400)
    reqs = [(req(0, 4, 30), 30), (req(1, 4, 8, arrival=10, deadline=late_deadline), 8),
            (req(2, 4, 20, arrival=10, deadline=100.0), 20)]
    return pol, drive(pol, reqs)


def test_lengthwise_late_request_yields_to_one_that_can_still_make_it():
    pol, run = _late_tier_run("lengthwise")
    assert run.first[2] == 10 and run.first[1] > 10  # the on-time request takes the slot, the late one waits
    assert run.done[2] <= 100 and pol.stats["late"] == 1
    assert run.emitted[1] == 8  # late is not dropped: it runs when a slot frees
    sjf_pol, sjf = _late_tier_run("lengthwise-sjf")  # the ablation: shortest predicted first, late or not
    assert sjf.first[1] == 10 and sjf.first[2] > 10 and "late" not in sjf_pol.stats or sjf_pol.stats["late"] == 0


def test_lengthwise_nobody_is_late_before_a_step_was_timed_or_without_a_deadline():
    pol = make_policy("lengthwise", cfg(max_num_seqs=1), kv_blocks=400)
    reqs = [(req(0, 4, 8, deadline=0.5), 8), (req(1, 4, 20), 20)]  # first step: no TBT measured yet; 1 has no deadline
    run = drive(pol, reqs)
    assert run.first[0] == 0 and pol.stats["late"] == 0 and set(run.done) == {0, 1}


def test_lengthwise_late_request_returns_after_aging():
    """aging_s still bounds starvation: once the late request has waited that long it competes as on-time again
    (and, aged, outranks the newer request)."""
    pol = make_policy("lengthwise", cfg(max_num_seqs=2, aging_s=15.0, max_model_len=64), kv_blocks=400)
    reqs = [(req(0, 4, 40), 40), (req(1, 4, 8, arrival=10, deadline=12.0), 8),
            (req(2, 4, 20, arrival=10, deadline=100.0), 20), (req(3, 4, 5, arrival=26, deadline=1000.0), 5)]
    run = drive(pol, reqs)
    assert run.first[2] == 10 and pol.stats["late"] == 1
    assert run.first[1] < run.first[3]  # back among the on-time requests at 25, and first by its age


@pytest.mark.parametrize("name", MAX_ALLOC)
def test_max_alloc_reserves_max_model_len(name):
    c = cfg(max_model_len=32, orca_batch_size=8, max_num_batched_tokens=8)
    pol = make_policy(name, c, kv_blocks=20)
    held, together = [], []

    def expected(r):  # 32 tokens = 8 blocks; with max_tokens=4, prompt + 4 = 8 tokens = 2 blocks
        return 8 if r.max_tokens is None else 2

    def on_plan(now, plan, p):
        held.extend(p.kv.of(rid) == expected(p.requests[rid]) for rid in plan.tokens)
        assert p.kv.used == sum(expected(r) for r in p.running)
        together.append(sum(rid < 5 for rid in plan.tokens))

    reqs = [(req(rid, 4, 2), 3) for rid in range(5)]
    reqs.insert(2, (req(5, 4, 2, max_tokens=4), 4))  # third in line: fits in the 4 blocks the first two leave
    run = drive(pol, reqs, on_plan=on_plan)
    assert all(held) and max(together) == 2         # reserved from the first step; 20 blocks take two 8-block requests
    assert run.max_batch == 3 and pol.stats["preemptions"] == 0  # the 2-block one fits beside them


def test_orca_batch_cap_and_whole_prompts():
    c = cfg(orca_batch_size=2, max_model_len=64, max_num_batched_tokens=8)
    orca = drive(make_policy("orca", c, 200), [(req(rid, 40, 3), 3) for rid in range(5)])
    assert orca.max_batch == 2 and all(len(s.tokens) <= 2 for s in orca.trace)
    assert orca.trace[0].tokens == {0: 40, 1: 40}  # ORCA runs a prompt whole, not in chunks
    chunked = drive(make_policy("fcfs-max-alloc", c, 200), [(req(rid, 40, 3), 3) for rid in range(5)])
    assert chunked.trace[0].tokens == {0: 8}     # fcfs-max-alloc chunks prompts within the token budget
    wide = drive(make_policy("fcfs-max-alloc", cfg(orca_batch_size=2, max_model_len=64), 200),
                 [(req(rid, 40, 3), 3) for rid in range(5)])
    assert wide.max_batch == 5                   # control: the cap of 2 is ORCA's, not the KV's


# -- ecoserve ---------------------------------------------------------------------------------------------
def _group_scenario(name):
    """X (long) holds the KV; g1, h, g2, g3 queue behind it in that order; g* share a predicted RL, h is longer."""
    pol = make_policy(name, cfg(), kv_blocks=19)
    reqs = [(req(0, 4, 40), 40), (req(1, 4, 20, arrival=1), 20), (req(2, 4, 60, arrival=1), 60),
            (req(3, 4, 20, arrival=1), 20), (req(4, 4, 20, arrival=1), 20)]
    return drive(pol, reqs)


def test_ecoserve_time_synced_group_admitted_and_finished_together():
    run = _group_scenario("ecoserve-SD")
    g = (1, 3, 4)
    assert len({run.gt_start[rid] for rid in g}) == 1     # admitted in the same step (group mates skip past h)
    assert len({run.done[rid] for rid in g}) == 1          # exact predictions: finished in the same step
    assert run.gt_start[1] == run.done[0] + 1              # the step after X freed its KV
    assert run.gt_start[2] > run.done[1]                   # h waits for the group
    unsynced = _group_scenario("ecoserve-D")               # control: FCFS head-of-line, the group is split
    assert len({unsynced.gt_start[rid] for rid in g}) > 1


def test_ecoserve_group_split_when_kv_is_short_and_reserve_kept():
    """Three same-RL GTs, room (outside the reserve) for two: two start together, the third when they finish."""
    pol = make_policy("ecoserve-SD", cfg(reserve=0.3), kv_blocks=20)  # reserve: 6 blocks; each GT needs 5 more
    run = drive(pol, [(req(rid, 4, 20), 20) for rid in range(3)])
    assert run.gt_start[0] == run.gt_start[1] == 1 and run.done[0] == run.done[1]
    assert run.gt_start[2] == run.done[0] + 1        # 7 blocks were free, but 6 of them are the reserve


@pytest.mark.parametrize("name", ["ecoserve-SD", "ecoserve"])
def test_ecoserve_pause_keeps_kv_and_resumes(name):
    # u (rid 0) predicts 8 but needs 30; w holds the rest of the KV, so u cannot extend and is paused
    calls = []

    def repredict(r):
        calls.append((r.rid, r.generated))
        return 16.0

    c = cfg(buffer=0.45)  # no half-region small enough to host u: the pause path, not pipelining
    pol = make_policy(name, c, kv_blocks=14, repredict=repredict)
    seen = {}

    def on_plan(now, plan, p):
        if 0 in plan.paused and "step" not in seen:
            u = p.requests[0]
            seen.update(step=now, held=p.kv.of(0), free=p.kv.free, phase=u.phase, planned=u.planned_rl, generated=u.generated,
                        in_plan=0 in plan.tokens, queued=u in p.gt_queue)

    run = drive(pol, [(req(0, 4, 8), 30), (req(1, 4, 40), 40)], on_plan=on_plan)
    assert seen, "u was never paused"
    assert seen["held"] == 3 and seen["free"] == 0            # KV kept (no offload, no recompute)
    assert seen["phase"] is Phase.PAUSED and seen["queued"] and not seen["in_plan"]
    assert seen["planned"] == seen["generated"] + 16 and (0, seen["generated"]) in calls  # re-predicted
    assert pol.stats["pauses"] >= 1 and pol.stats["preemptions"] == 0 and pol.stats["hosted"] == 0
    assert 0 not in run.lost
    assert run.done[1] < run.done[0] and run.emitted[0] == 30  # resumed once w left, and completed


def test_ecoserve_extends_from_reserve_instead_of_pausing():
    c = cfg(reserve=0.2)  # 4 of 18 blocks: GTs may not be admitted into them, but may extend into them
    pol = make_policy("ecoserve-SD", c, kv_blocks=18, repredict=lambda r: 8.0)
    at_cap = []

    def on_plan(now, plan, p):
        u = p.requests.get(0)
        if u is not None and u.computed == 12 and 0 in plan.tokens:  # the step past its 3-block allocation
            at_cap.append((p.kv.of(0), p.cap[0], u.planned_rl - u.generated))

    run = drive(pol, [(req(0, 4, 8), 14), (req(1, 4, 40), 40)], on_plan=on_plan)
    assert at_cap == [(5, 20, 8)]                  # grown by the re-predicted 8 tokens in one go: 12 + 8 = 20 = 5 blocks
    assert pol.stats["pauses"] == 0 and run.done[0] < run.done[1]


@pytest.mark.parametrize("name", ["ecoserve-SDO", "ecoserve"])
def test_ecoserve_ordering_tightest_deadline_pt_first(name):
    c = cfg(tfs=8, deadline_bin_s=1.0)
    deadlines = {0: 1000.0, 1: 10.0, 2: 500.0, 3: math.inf, 4: 50.0}
    run = drive(make_policy(name, c, 400), [(req(rid, 8, 4, deadline=d), 4) for rid, d in deadlines.items()])
    assert sorted(deadlines, key=lambda rid: run.first[rid]) == [1, 4, 2, 0, 3]
    fcfs = drive(make_policy("ecoserve-SD", c, 400), [(req(rid, 8, 4, deadline=d), 4) for rid, d in deadlines.items()])
    assert sorted(deadlines, key=lambda rid: fcfs.first[rid]) == [0, 1, 2, 3, 4]


def _pipeline_scenario(name, short_truth=9, reserve=0.0, kv_blocks=12, repredict=None, short_pred=9):
    """Host h (rid 0): 40 tokens left, region 40, so its second half lends up to 20 - 6 = 14 tokens; s (rid 1) needs 8.

    12 blocks hold h's 11 and s's prompt block: s cannot get an allocation of its own while h runs.
    """
    pol = make_policy(name, cfg(reserve=reserve), kv_blocks=kv_blocks, repredict=repredict)
    held = []
    run = drive(pol, [(req(0, 4, 41), 41), (req(1, 4, short_pred), short_truth)],
                on_plan=lambda now, plan, p: held.append(p.kv.of(1)) if 1 in p.requests else None)
    return pol, run, held


@pytest.mark.parametrize("name", ["ecoserve", "ecoserve-DP"])
def test_ecoserve_kvc_pipelining_hosts_short_gt(name):
    pol, run, held = _pipeline_scenario(name)
    assert pol.stats["hosted"] == 1
    assert run.gt_start[1] == run.gt_start[0] == 1        # hosted in the step its host was admitted
    assert set(held) == {1}                               # only its prompt block: the rest lives in the host's span
    assert run.done[1] < run.done[0] and run.done[1] == 8 and run.done[0] == 40
    _, plain, _ = _pipeline_scenario("ecoserve-SDO")       # control: without P it waits for the host to finish
    assert plain.gt_start[1] > plain.done[0]


@pytest.mark.parametrize("short_pred, hosted", [(15, True), (16, False)])
def test_ecoserve_kvc_pipelining_buffer_boundary(short_pred, hosted):
    """Hosted only if the padded remaining RL is <= half the region minus the buffer: 14 tokens fit, 15 do not."""
    pol, run, _ = _pipeline_scenario("ecoserve", short_truth=short_pred, short_pred=short_pred)
    assert pol.stats["hosted"] == int(hosted)
    assert (run.done[1] < run.done[0]) is hosted


def test_ecoserve_hosted_gt_outliving_its_span_is_recomputed_not_paused():
    """No free KV to move out: the hosted GT's tokens are in the host's span, so it is preempted (recompute)."""
    pol, run, _ = _pipeline_scenario("ecoserve", short_truth=30)
    assert pol.stats["hosted"] == 1 and pol.stats["preemptions"] == 1 and pol.stats["pauses"] == 0
    assert run.lost[1] == 4 + 8 and run.emitted[1] == 30 and run.done[0] < run.done[1]


def test_ecoserve_hosted_gt_moves_out_into_free_kv():
    pol, run, held = _pipeline_scenario("ecoserve", short_truth=12, reserve=0.25, kv_blocks=16, repredict=lambda r: 4.0)
    assert pol.stats["hosted"] == 1 and pol.stats["relocations"] == 1 and pol.stats["preemptions"] == 0
    assert max(held) > 1 and run.done[1] < run.done[0]


@pytest.mark.parametrize("name", ["ecoserve-D", "ecoserve-SD", "ecoserve"])
def test_ecoserve_liveness_guard_never_leaves_the_step_empty(name):
    # both GTs under-predicted fill the KV and pause together; the guard recomputes one so the other can go on
    pol = make_policy(name, cfg(buffer=0.45), kv_blocks=4)
    run = drive(pol, [(req(0, 4, 5), 12), (req(1, 4, 5), 12)])
    guard = next(s for s in run.trace if s.preempted)
    assert guard.tokens and set(guard.paused) >= set(guard.preempted)
    assert pol.stats["preemptions"] == 1 and sorted(run.done) == [0, 1]


# -- registry and admission ---------------------------------------------------------------------------------
def test_make_policy_names():
    for bad in ("fifo", "", "ecoserve-XYZ", "ecoserve-", "ecoserve-SDQ"):
        with pytest.raises(PolicyError) as e:
            make_policy(bad, cfg(), 10)
        assert isinstance(e.value, ValueError)
        if bad.startswith("ecoserve-"):
            assert "D, S, O, P" in str(e.value)
        else:
            assert "unknown policy" in str(e.value) and "vllm" in str(e.value) and "ecoserve-SDO" in str(e.value)
    oracle = make_policy("oracle", cfg(), 10)
    assert isinstance(oracle, EcoServe) and oracle.name == "ecoserve" and (oracle.D, oracle.S, oracle.O, oracle.P) == (True,) * 4
    v = make_policy(" EcoServe-sdo ", cfg(), 10)
    assert (v.D, v.S, v.O, v.P) == (True, True, True, False) and v.name == "ecoserve-SDO"
    assert make_policy("orca", cfg(orca_batch_size=3), 10).batch_size == 3
    assert {"vllm", "vllm-v0", "sarathi", "sjf", "orca", "fcfs-max-alloc", "ecoserve", "oracle", "lengthwise",
            "lengthwise-fcfs", "lengthwise-sjf"} <= set(policy_names())


def test_policy_names_is_the_one_list():
    """Every listed name builds a policy, the benchmark's default set and the CLI's help draw from the same list."""
    from serving.cli import build_parser
    from serving.sim.sweep import BENCH_POLICIES

    fixed = [n for n in policy_names() if "<" not in n]
    for name in fixed:
        assert make_policy(name, cfg(), 10).name in (name, "ecoserve")
    assert {n for n in BENCH_POLICIES if not n.startswith("ecoserve-")} <= set(fixed)
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    help_text = sub.choices["simulate"].format_help()
    assert all(n in help_text for n in policy_names())
    with pytest.raises(ValueError):
        make_policy("vllm", cfg(), 0)


@pytest.mark.parametrize("name", POLICIES)
def test_add_rejects_what_cannot_fit(name):
    pol = make_policy(name, cfg(), kv_blocks=2)    # 8 tokens of KV
    with pytest.raises(ValueError, match="cannot fit"):
        pol.add(req(0, 8, 4), 0.0)                   # the prompt and its first token need 9
    with pytest.raises(ValueError, match="at least one token"):
        pol.add(req(1, 0, 4), 0.0)
    pol.add(req(2, 7, 4), 0.0)
    with pytest.raises(ValueError, match="added twice"):
        pol.add(req(2, 7, 4), 0.0)
    assert set(pol.requests) == {2}
    run = drive(make_policy(name, cfg(), kv_blocks=2), [(req(2, 7, 4), 2)])  # 7 + 1 tokens: exactly the KV
    assert run.done == {2: 1}


# -- properties over random small workloads -------------------------------------------------------------------
@st.composite
def workloads(draw):
    bs = 16
    blocks = draw(st.integers(20, 120))
    cap = blocks * bs
    c = PolicyConfig(
        block_size=bs, max_model_len=1024,
        max_num_seqs=draw(st.integers(1, 16)), max_num_batched_tokens=draw(st.integers(8, 512)), tfs=draw(st.integers(8, 512)),
        padding=draw(st.sampled_from([0.0, 0.1, 0.2])), reserve=draw(st.sampled_from([0.0, 0.03, 0.2])),
        buffer=draw(st.sampled_from([0.0, 0.15, 0.4])), group_tokens=draw(st.sampled_from([8, 16, 32])),
        orca_batch_size=draw(st.integers(1, 8)), pipeline_depth=draw(st.integers(1, 4)), aging_s=50.0,
        deadline_bin_s=draw(st.sampled_from([1.0, 50.0])), kv_bin_tokens=draw(st.sampled_from([16, 128])),
        max_loras=draw(st.sampled_from([0, 0, 1, 2])),
    )
    specs = _random_specs(random.Random(draw(st.integers(0, 2**32 - 1))), draw(st.integers(5, 40)), cap)
    return c, blocks, specs


def _random_specs(rng: random.Random, n: int, cap: int) -> list[tuple]:
    """``n`` requests ``(rid, arrival step, prompt, predicted RL, bucket distribution?, deadline, true RL)`` fitting
    ``cap`` tokens.

    Output lengths are uniform or bimodal (short answers among long ones, what KVC pipelining feeds on); predictions
    are exact, off by a factor 0.3-2, or unrelated.
    """
    bimodal = rng.random() < 0.5
    specs, t = [], 0
    for rid in range(n):
        prompt = rng.randint(1, min(300, cap - 1))
        out = rng.choice([rng.randint(1, 40), rng.randint(150, 300)]) if bimodal else rng.randint(1, 300)
        out = min(out, cap - prompt + 1)  # the whole sequence (prompt + out - 1 computed tokens) fits the KV
        t += rng.choice([0, 0, 1, 3, 10])
        mode = rng.random()
        pred = out if mode < 0.3 else max(1, round(out * rng.uniform(0.3, 2.0))) if mode < 0.7 else rng.randint(1, 300)
        dist = rng.random() < 0.3
        deadline = t + rng.uniform(0, 500) if rng.random() < 0.5 else math.inf
        specs.append((rid, t, prompt, pred, dist, deadline, out))
    return specs


def _materialize(specs):
    out = []
    for rid, t, prompt, pred, dist, deadline, truth in specs:
        p = Prediction(length=pred, edges=(32, 64, 128, 256), probs=(0.2,) * 5) if dist else Prediction(length=pred)
        # three services (models or adapters of one engine): the policies that tell them apart see them all
        out.append((Request(rid, float(t), prompt, p, deadline=deadline, service=("", "x", "y")[rid % 3]), truth))
    return out


def _run_workload(name, c, blocks, specs):
    pol = make_policy(name, c, blocks)
    reqs = _materialize(specs)
    bound = sum(p + o for _, _, p, _, _, _, o in specs) * 4 + 1000
    run = drive(pol, reqs, max_steps=bound)
    return pol, reqs, run, bound


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=workloads())
def test_policy_properties(name, w):
    c, blocks, specs = w
    pol, reqs, run, bound = _run_workload(name, c, blocks, specs)  # drive checks the KV ledger and check() every step
    truth = {r.rid: t for r, t in reqs}
    service = {r.rid: r.service for r, _ in reqs}
    # every request completes exactly once, with exactly its true output length, within the step bound
    assert set(run.done) == set(truth) and run.emitted == truth
    assert all(r.generated == truth[r.rid] and r.phase is Phase.FINISHED for r, _ in reqs)
    last_arrival = max(s[1] for s in specs)
    assert max(run.done.values()) <= last_arrival + bound
    # token conservation: every prompt token computed at least once; recompute explains every extra token
    assert sum(run.prompt_tokens.values()) >= sum(r.prompt_len for r, _ in reqs)
    for r, t in reqs:
        assert run.prompt_tokens[r.rid] >= r.prompt_len
        assert run.scheduled[r.rid] == r.prompt_len + t - 1 + run.lost.get(r.rid, 0)
    # step limits
    for s in run.trace:
        n = sum(s.tokens.values())
        if name in ("vllm", "sjf", "fcfs-max-alloc", "seallm", "muxserve"):
            assert n <= c.max_num_batched_tokens
        elif name == "vllm-v0":
            assert n <= max(c.max_num_batched_tokens, c.max_model_len)
        elif name in ("sarathi", "lengthwise", "lengthwise-sjf", "lengthwise-fcfs"):
            assert n <= c.tfs
        elif name.startswith("ecoserve"):
            assert n <= max(c.tfs, len(s.tokens))
        assert len(s.tokens) <= (c.orca_batch_size if name == "orca" else c.max_num_seqs)
        if c.max_loras:  # vLLM's LoRA rule: no step runs more distinct adapters than the engine holds
            assert len({service[rid] for rid in s.tokens} - {""}) <= c.max_loras, (s.now, s.tokens)
    if name in MAX_ALLOC:
        assert pol.stats["preemptions"] == 0 and not any(s.preempted for s in run.trace)
    if name in VLLM_LIKE or name in MAX_ALLOC:
        assert pol.stats["pauses"] == 0 and pol.stats["hosted"] == 0
    if not name.endswith("P") and name != "ecoserve":
        assert pol.stats["hosted"] == 0
    # determinism: the same workload gives the same schedule
    _, _, again, _ = _run_workload(name, c, blocks, specs)
    assert again.done == run.done and [s.tokens for s in again.trace] == [s.tokens for s in run.trace]


def test_random_workloads_reach_every_kv_pressure_path():
    """The workload generator is not all easy: recompute, pauses and hosting all happen in a fixed sample.

    (Moving a hosted GT out is rarer; test_ecoserve_hosted_gt_moves_out_into_free_kv covers it.)
    """
    rng = random.Random(7)
    totals = dict.fromkeys(("preemptions", "pauses", "hosted"), 0)
    for _ in range(8):
        blocks = rng.randint(20, 60)
        specs = _random_specs(rng, 30, blocks * 16)
        for name in ("vllm", "ecoserve"):
            pol, _, _, _ = _run_workload(name, cfg(block_size=16, padding=0.1, reserve=0.03), blocks, specs)
            for k in totals:
                totals[k] += pol.stats[k]
    assert all(v > 0 for v in totals.values()), totals


@pytest.mark.parametrize("name", POLICIES)
@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(w=workloads(), seed=st.integers(0, 2**32 - 1))
def test_abort_frees_everything_and_the_rest_complete(name, w, seed):
    """A host may abort any request at any time: its KV returns, nothing else is lost or duplicated."""
    c, blocks, specs = w
    rng = random.Random(seed)
    aborts = {rid: t + rng.randint(0, 40) for rid, t, *_ in specs if rng.random() < 0.3}
    pol = make_policy(name, c, blocks)
    reqs = _materialize(specs)
    run = drive(pol, reqs, aborts=aborts, max_steps=sum(p + o for _, _, p, _, _, _, o in specs) * 4 + 1000)
    truth = {r.rid: t for r, t in reqs}
    assert run.aborted <= set(aborts)
    assert set(run.done) | run.aborted == set(truth) and not (set(run.done) & run.aborted)
    assert all(run.emitted[rid] == truth[rid] for rid in run.done)
    assert not pol.requests and pol.kv.used == 0
    assert pol.abort(next(iter(truth)), 0.0) is False  # unknown or finished ids are ignored


@pytest.mark.parametrize("name", ["vllm", "sjf", "orca", "ecoserve", "lengthwise"])
def test_abort_running_and_waiting(name):
    """With room for one request at a time, abort the running one and a queued one: the third still runs."""
    pol = make_policy(name, cfg(max_num_seqs=1, orca_batch_size=1), kv_blocks=200)
    reqs = [(req(rid, 8, 6), 6) for rid in range(3)]
    run = drive(pol, reqs, arrivals=[0, 0, 0], aborts={0: 2, 1: 1})
    assert run.aborted == {0, 1} and set(run.done) == {2} and run.emitted[2] == 6
    assert run.first[0] == 0 and 1 not in run.first and pol.kv.used == 0
