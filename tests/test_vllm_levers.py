"""Facts about vLLM 0.32's real V1 scheduler that a policy adapter relies on.

Every test drives the installed ``Scheduler`` / ``AsyncScheduler`` (real
``KVCacheManager``, real block pool) through ``tests/vllm_harness.py``; only the
model runner's output is fabricated.  Where a lever does not behave the way one
would naively hope, the test asserts the observed behaviour and says so.

Glossary used below: "step N" is the ``SchedulerOutput`` produced when
``scheduler.current_step`` became N (``schedule()`` increments it first, so the
first step is 1).  "sync" = ``schedule()`` then ``update_from_output()`` of the
same step (how the CPU engine runs every scheduler); "pipelined" = step N+1 is
scheduled before step N's output is applied (GPU async scheduling).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from tests.vllm_harness import (
    block_ids,
    expected_tokens,
    make_request,
    make_scheduler,
    run_to_completion,
    step_full,
)


def _free_blocks(scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _assert_exact(run, reqs, whole_life: bool = True) -> None:
    """Every request finished exactly once, by length, with exactly max_tokens tokens.

    ``whole_life=False`` when the run continued requests stepped by hand
    before: the streamed tokens are then only the tail produced in the run."""
    for r in reqs:
        want = expected_tokens(r.max_tokens)
        if r.request_id not in run.requests:  # already finished before this run
            assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and list(r.output_token_ids) == want
            continue
        res = run.requests[r.request_id]
        assert res.status == RequestStatus.FINISHED_LENGTH_CAPPED, (r.request_id, res.status)
        assert res.finish_reason == "length"
        assert res.finish_step is not None
        assert res.request_output_tokens == want, r.request_id  # the Request itself
        if whole_life:
            assert res.output_tokens == want, r.request_id  # what a client would see
        else:
            assert res.output_tokens == want[len(want) - len(res.output_tokens) :], r.request_id


class SelectiveAdmissionScheduler(AsyncScheduler):
    """Reference implementation of the "admission order" lever.

    ``admit`` = request ids to admit this step, in order (None: stock FCFS).
    The real ``waiting`` queue is swapped for a queue of the same class holding
    only the selected requests, ``super().schedule()`` runs, then everything is
    merged back.  ``schedule()`` itself may *prepend* to ``self.waiting``
    (requests it preempts, requests it skips), so whatever is left in the
    temporary queue goes back to the front, followed by the untouched rest in
    their original order.
    """

    admit: list[str] | None = None

    def schedule(self, throttle_prefills: bool = False):
        if self.admit is None:
            return super().schedule(throttle_prefills)
        original = self.waiting
        by_id = {r.request_id: r for r in original}
        chosen = [by_id[rid] for rid in self.admit if rid in by_id]
        chosen_set = set(chosen)
        selected = type(original)()
        for r in chosen:
            selected.add_request(r)
        rest = [r for r in original if r not in chosen_set]
        self.waiting = selected
        try:
            return super().schedule(throttle_prefills)
        finally:
            merged = type(original)()
            for r in [*self.waiting, *rest]:
                merged.add_request(r)
            self.waiting = merged


# ---------------------------------------------------------------------------
# a. stock behaviour
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scheduler_cls", "pipelined"),
    [(AsyncScheduler, False), (AsyncScheduler, True), (Scheduler, False)],
    ids=["async-sync", "async-pipelined", "plain-sync"],
)
def test_a_stock_scheduler_with_enough_kv_finishes_all_exactly(scheduler_cls, pipelined):
    """With ample KV (500 blocks), 8 staggered requests of mixed prompt/output
    length all finish exactly once with exactly ``max_tokens`` tokens, nobody
    is preempted, and each request is scheduled on exactly ``max_tokens``
    steps when the prompt fits in one chunk (the AsyncScheduler's guard
    ``num_computed_tokens + 2 - num_output_placeholders >= prompt + max_tokens``
    prevents a wasted extra step even when pipelined)."""
    s = make_scheduler(num_blocks=500, max_num_seqs=16, max_num_batched_tokens=512, scheduler_cls=scheduler_cls)
    reqs = [make_request(f"r{i}", 10 + 13 * i, 3 + 5 * (i % 4)) for i in range(8)]
    run = run_to_completion(s, reqs, arrivals={f"r{i}": i // 2 for i in range(8)}, pipelined=pipelined)
    _assert_exact(run, reqs)
    assert run.total_preemptions == 0
    for r in reqs:
        assert len(run.requests[r.request_id].scheduled_steps) == r.max_tokens
    assert not s.requests and not s.running and not s.waiting
    assert _free_blocks(s) == 499  # num_blocks - 1: the block pool reserves a null block


# ---------------------------------------------------------------------------
# b. KV pressure
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_b_kv_pressure_preempts_by_recompute_and_still_finishes_exactly(pipelined):
    """13 blocks (12 usable) x 16 tokens; 4 requests of 40 prompt + 40 output
    tokens (5 blocks each at the end).  All 4 are admitted (3 blocks each,
    admission checks the whole current sequence: ``scheduler_reserve_full_isl``
    defaults to True), then decode growth forces preemption of the *last* entry
    of ``scheduler.running`` (FCFS victim = ``running[-1]``): exactly 2
    preemptions, at steps 10 (r3) and 26 (r2).  Preemption is recompute: the
    resumed request is rescheduled with prompt + already-generated tokens
    (``num_computed_tokens`` reset to 0), reported in the step's
    ``preempted_req_ids`` and later in ``scheduled_cached_reqs.resumed_req_ids``.
    Each request still finishes once with exactly 40 tokens.  Pipelined, the
    in-flight token of the victim is still delivered ("stale" output) and the
    victim is not re-admitted until it has drained."""
    s = make_scheduler(num_blocks=13, max_num_seqs=8, max_num_batched_tokens=256)
    reqs = [make_request(f"r{i}", 40, 40) for i in range(4)]
    run = run_to_completion(s, reqs, pipelined=pipelined)
    _assert_exact(run, reqs)
    assert run.total_preemptions == 2
    assert [run.requests[f"r{i}"].num_preemptions for i in range(4)] == [0, 0, 1, 1]
    preempt_steps = [(st["step"], st["preempted"]) for st in run.steps if st["preempted"]]
    assert preempt_steps == [(10, ["r3"]), (26, ["r2"])]
    resumed = [st for st in run.steps if st["resumed"]]
    assert resumed and set(resumed[0]["resumed"]) == {"r2", "r3"}
    # recompute: r3 had generated 9 tokens when preempted -> 40 + 9 = 49 tokens re-prefilled
    assert resumed[0]["num_scheduled_tokens"]["r3"] == 49
    assert _free_blocks(s) == 12


# ---------------------------------------------------------------------------
# c. lever "pause": next_decode_eligible_step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_c_pause_via_next_decode_eligible_step_keeps_blocks(pipelined):
    """``schedule()`` does ``current_step += 1`` first and then skips any
    RUNNING request with ``current_step < request.next_decode_eligible_step``.
    So to skip exactly the next k ``schedule()`` calls set
    ``request.next_decode_eligible_step = scheduler.current_step + 1 + k``
    (k=1 -> ``current_step + 2``).  The paused request stays in
    ``scheduler.running`` with status RUNNING, keeps the very same KV block ids,
    gets no tokens that step, and resumes by itself afterwards; its output is
    unaffected.  Pipelined, the pause does not touch the token already in
    flight (it is delivered normally).  A paused request is still in
    ``running``, so it can still be chosen as preemption victim
    (``running[-1]``)."""
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256)
    a, b = make_request("a", 20, 10), make_request("b", 20, 10)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        step_full(s, pipelined=pipelined)
    assert s.current_step == 3
    assert s.use_v2_model_runner is False  # CPU: no Triton -> V1 runner
    assert a.next_decode_eligible_step == 0  # never written by AsyncScheduler here
    held = block_ids(s, "a")

    a.next_decode_eligible_step = s.current_step + 2  # skip step 4 only
    rec = step_full(s, pipelined=pipelined)
    assert rec.step == 4
    assert rec.num_scheduled_tokens == {"b": 1}
    assert a in s.running and a.status == RequestStatus.RUNNING
    assert block_ids(s, "a") == held
    assert a.next_decode_eligible_step == 5  # untouched (V1 runner)

    rec = step_full(s, pipelined=pipelined)
    assert rec.step == 5 and rec.num_scheduled_tokens == {"a": 1, "b": 1}
    run = run_to_completion(s, [], pipelined=pipelined)
    _assert_exact(run, [a, b], whole_life=False)


def test_c_pause_also_stops_prefill_chunks_and_keeps_the_seq_slot():
    """Despite its name, ``next_decode_eligible_step`` is checked for every
    RUNNING request, so it also pauses a request in the middle of a chunked
    prefill (its computed prefix and blocks are kept).  A paused request still
    counts against ``max_num_seqs``: with ``max_num_seqs=1`` a waiting request
    is not admitted while the only running one is paused."""
    s = make_scheduler(num_blocks=100, max_num_seqs=1, max_num_batched_tokens=32)
    a, b = make_request("a", 80, 3), make_request("b", 10, 3)
    s.add_request(a)
    s.add_request(b)
    rec = step_full(s)
    assert rec.num_scheduled_tokens == {"a": 32} and a.is_prefill_chunk
    held = block_ids(s, "a")
    a.next_decode_eligible_step = s.current_step + 3  # skip 2 steps
    for _ in range(2):
        rec = step_full(s)
        assert rec.num_scheduled_tokens == {}  # b not admitted: a holds the only slot
        assert a.num_computed_tokens == 32 and block_ids(s, "a") == held
        assert [r.request_id for r in s.waiting] == ["b"]
    assert step_full(s).num_scheduled_tokens == {"a": 32}
    _assert_exact(run_to_completion(s, []), [a, b], whole_life=False)


def test_c_pause_survives_v2_model_runner_overwrite():
    """``AsyncScheduler._update_after_schedule`` overwrites
    ``next_decode_eligible_step = current_step + decode_stagger`` (decode_stagger
    = pipeline_parallel_size = 1) for every *scheduled* non-prefill-chunk
    request, but only when ``scheduler.use_v2_model_runner`` is True.  On this
    CPU build that flag is False (Model Runner V2 needs Triton); on a GPU
    deployment of 0.32 it defaults to True.  The overwrite only touches requests
    scheduled in that step, and ``current_step + 1`` never blocks the next
    step, so a pause written before ``schedule()`` (i.e. in a subclass's
    ``schedule()`` override, or in ``update_from_output``) still works."""
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256, use_v2_model_runner=True)
    a = make_request("a", 20, 10)
    s.add_request(a)
    for i in range(1, 4):
        step_full(s)
        assert a.next_decode_eligible_step == i + 1  # overwritten each scheduled step
    a.next_decode_eligible_step = s.current_step + 2
    assert step_full(s).num_scheduled_tokens == {}
    assert a.next_decode_eligible_step == 5  # not scheduled -> not overwritten
    assert step_full(s).num_scheduled_tokens == {"a": 1}
    _assert_exact(run_to_completion(s, []), [a], whole_life=False)


# ---------------------------------------------------------------------------
# d. lever "admission order": swap scheduler.waiting
# ---------------------------------------------------------------------------


def test_d_admission_order_by_swapping_waiting_queue():
    """Temporarily replacing ``scheduler.waiting`` with a queue of the same
    class (``FCFSRequestQueue`` for policy "fcfs") holding only the selected
    requests admits exactly those, in that order (``scheduled_new_reqs`` order
    and append order in ``scheduler.running``); the others stay waiting in
    their original order and are admitted FCFS once the lever is off.
    ``kv_holding_waiting`` (requests that hold KV while waiting: async KV
    loads / streaming sessions) is always drained *before* ``waiting`` and
    ``deferred_waiting`` is just a set of skipped requests; both stay empty in
    a plain deployment and the lever must not touch them."""
    s = make_scheduler(num_blocks=200, max_num_batched_tokens=512, scheduler_cls=SelectiveAdmissionScheduler)
    reqs = [make_request(f"r{i}", 20, 4) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    assert type(s.waiting) is FCFSRequestQueue

    s.admit = ["r3", "r1"]
    rec = step_full(s)
    assert rec.new_req_ids == ["r3", "r1"]
    assert list(rec.num_scheduled_tokens) == ["r3", "r1"]
    assert [r.request_id for r in s.running] == ["r3", "r1"]
    assert [r.request_id for r in s.waiting] == ["r0", "r2", "r4"]
    assert type(s.waiting) is FCFSRequestQueue
    assert not s.kv_holding_waiting and not s.deferred_waiting

    s.admit = None
    rec = step_full(s)
    assert rec.new_req_ids == ["r0", "r2", "r4"]
    _assert_exact(run_to_completion(s, []), reqs, whole_life=False)


def test_d_admission_lever_loses_nobody_under_preemption():
    """Same lever applied on every step (admit waiting requests in *reverse*
    id order) under heavy KV pressure: ``schedule()`` prepends the requests it
    preempts to whatever ``self.waiting`` is at that moment -- the temporary
    queue -- so the merge must put the temporary queue's leftovers back in
    front.  Also: in a step that preempted anything, vLLM admits nobody
    (``if not preempted_reqs``).  With that merge, every request finishes
    exactly once with exact output."""
    s = make_scheduler(num_blocks=13, max_num_seqs=8, max_num_batched_tokens=256, scheduler_cls=SelectiveAdmissionScheduler)
    reqs = [make_request(f"r{i}", 40, 40) for i in range(5)]
    admitted_order: list[str] = []

    def plan(sched, _i):
        sched.admit = sorted((r.request_id for r in sched.waiting), reverse=True)

    run = run_to_completion(s, reqs, before_step=plan)
    for st in run.steps:
        admitted_order += st["new"]
        if st["preempted"]:
            assert st["new"] == [] and st["resumed"] == []
    _assert_exact(run, reqs)
    assert run.total_preemptions > 0
    assert admitted_order[0] == "r4"  # reverse order honoured at first admission
    assert sorted(admitted_order) == sorted(r.request_id for r in reqs)


# ---------------------------------------------------------------------------
# e. lever "budget": scheduler.max_num_scheduled_tokens
# ---------------------------------------------------------------------------


def test_e_token_budget_caps_step_first_come_chunks():
    """``schedule()`` starts from ``token_budget = self.max_num_scheduled_tokens``
    (read fresh every call), so setting it for one step caps that step's total.
    Distribution is first-come: running requests first (in ``running`` order),
    then waiting ones, each taking ``min(remaining tokens, budget left)``; the
    request that hits the cap gets a partial chunk (``is_prefill_chunk``, no
    sampled token) and the rest get nothing.  Budget 0 schedules nothing (the
    step still counts: ``current_step`` advances).  The budget cannot exceed
    ``scheduler_config.max_num_batched_tokens`` (a separate ``input_budget``)."""
    s = make_scheduler(num_blocks=200, max_num_batched_tokens=64)
    reqs = [make_request(f"r{i}", 30, 3) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    default = s.max_num_scheduled_tokens
    assert default == 64

    s.max_num_scheduled_tokens = 0
    rec = step_full(s)
    assert rec.step == 1 and rec.num_scheduled_tokens == {}
    assert len(s.waiting) == 3

    s.max_num_scheduled_tokens = 50
    rec = step_full(s)
    assert rec.num_scheduled_tokens == {"r0": 30, "r1": 20}
    assert rec.scheduler_output.total_num_scheduled_tokens == 50
    assert reqs[1].is_prefill_chunk and rec.new_tokens == {"r0": [100]}
    assert [r.request_id for r in s.waiting] == ["r2"]

    s.max_num_scheduled_tokens = default
    rec = step_full(s)
    assert rec.num_scheduled_tokens == {"r0": 1, "r1": 10, "r2": 30}

    s.max_num_scheduled_tokens = 10_000  # above max_num_batched_tokens
    rec = step_full(s)
    assert rec.scheduler_output.total_num_scheduled_tokens <= 64
    s.max_num_scheduled_tokens = default
    _assert_exact(run_to_completion(s, []), reqs, whole_life=False)


# ---------------------------------------------------------------------------
# f. lever "preempt now": _preempt_request
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_f_preempt_now_frees_blocks_and_request_recovers(pipelined):
    """``scheduler.running.remove(req); scheduler._preempt_request(req, t)``
    frees the request's blocks at once (free count rises by its block count),
    sets status PREEMPTED, ``num_computed_tokens = 0``,
    ``num_output_placeholders = 0``, ``num_stale_output_tokens =
    num_in_flight_tokens``, ``num_preemptions += 1``, *prepends* it to
    ``scheduler.waiting`` and reports it in the next ``preempted_req_ids``.

    Not as hoped: nothing stops the very next ``schedule()`` from re-admitting
    it.  Sync, it is resumed in the same step (full recompute: prompt + all
    outputs).  Pipelined, its in-flight token is still delivered (stale) and it
    is skipped into ``deferred_waiting`` until that output drained, so it is
    resumed one step later.  Either way it finishes with exact output."""
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256)
    a, b = make_request("a", 40, 10), make_request("b", 40, 10)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        step_full(s, pipelined=pipelined)
    free_before, held = _free_blocks(s), len(block_ids(s, "a"))
    in_flight = a.num_in_flight_tokens
    assert in_flight == (1 if pipelined else 0)

    s.running.remove(a)
    s._preempt_request(a, time.monotonic())
    assert _free_blocks(s) == free_before + held == free_before + 3
    assert a.status == RequestStatus.PREEMPTED and a.num_computed_tokens == 0
    assert a.num_output_placeholders == 0 and a.num_stale_output_tokens == in_flight
    assert [r.request_id for r in s.waiting] == ["a"] and a.num_preemptions == 1

    n_out = len(a.output_token_ids)
    rec = step_full(s, pipelined=pipelined)
    assert rec.preempted_ids == {"a"}
    if pipelined:
        assert rec.num_scheduled_tokens == {"b": 1}
        assert a in s.deferred_waiting
        assert rec.new_tokens["a"] == [102]  # stale in-flight token still delivered
        n_out = len(a.output_token_ids)
        rec = step_full(s, pipelined=pipelined)
    assert rec.resumed_req_ids == ["a"]
    assert rec.num_scheduled_tokens["a"] == 40 + n_out == 43  # recompute prompt + outputs
    run = run_to_completion(s, [], pipelined=pipelined)
    _assert_exact(run, [a, b], whole_life=False)
    assert a.num_preemptions == 1


def test_f_preempt_now_plus_admission_lever_holds_request_out():
    """To keep a preempted request out for a while, combine "preempt now" with
    the admission lever (leave it out of ``admit``): it then stays in
    ``waiting`` holding no blocks and is resumed only when admitted again."""
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256, scheduler_cls=SelectiveAdmissionScheduler)
    a, b = make_request("a", 40, 10), make_request("b", 40, 10)
    s.add_request(a)
    s.add_request(b)
    for _ in range(3):
        step_full(s)
    s.running.remove(a)
    s._preempt_request(a, time.monotonic())
    s.admit = []
    for _ in range(3):
        rec = step_full(s)
        assert rec.num_scheduled_tokens == {"b": 1}
        assert a.status == RequestStatus.PREEMPTED and block_ids(s, "a") == []
    s.admit = None
    rec = step_full(s)
    assert rec.resumed_req_ids == ["a"]
    _assert_exact(run_to_completion(s, []), [a, b], whole_life=False)


# ---------------------------------------------------------------------------
# g. extra_args
# ---------------------------------------------------------------------------


def test_g_sampling_params_extra_args_reach_scheduler_requests():
    """``SamplingParams.extra_args`` (``vllm_xargs`` in the OpenAI API) is kept
    by reference on ``Request.sampling_params`` inside the scheduler and is
    also shipped in ``NewRequestData.sampling_params``; a policy can read
    per-request hints (predicted length, SLO) from it.  Keys
    ``kv_transfer_params`` / ``ec_transfer_params`` / ``kv_cache_report_mode``
    are interpreted by vLLM itself -- avoid them."""
    hints = {"lengthwise": {"predicted_len": 123, "slo_ms": 500}}
    s = make_scheduler(num_blocks=100)
    r = make_request("x", 20, 3, extra_args=hints)
    s.add_request(r)
    assert s.requests["x"].sampling_params.extra_args == hints
    rec = step_full(s)
    (new,) = rec.scheduler_output.scheduled_new_reqs
    assert new.sampling_params.extra_args == hints
    assert s.running[0].sampling_params.extra_args["lengthwise"]["predicted_len"] == 123
    assert r.kv_transfer_params is None


# ---------------------------------------------------------------------------
# h. prefix caching
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("first_finished", [False, True], ids=["concurrent", "after-finish"])
@pytest.mark.parametrize(("shared", "hit"), [(48, 48), (40, 32), (64, 48)], ids=["shared48", "shared40", "identical"])
def test_h_prefix_cache_hit_jumps_num_computed_tokens_at_admission(first_finished, shared, hit):
    """With ``enable_prefix_caching=True`` a request sharing a prefix with an
    earlier one (still running or already finished -- freed blocks stay
    cached) has ``num_computed_tokens == 0`` while waiting and jumps to the
    hit at admission: ``NewRequestData.num_computed_tokens == hit`` and only
    ``prompt - hit`` tokens are scheduled.  Hits are whole blocks (16) and the
    last prompt token is always recomputed, so a 64-token identical prompt
    hits 48, not 63/64.  The shared blocks are the same physical block ids.
    An adapter must therefore read the hit (or ``num_scheduled_tokens``) from
    vLLM instead of assuming prefill cost = prompt length."""
    base = list(range(10, 74))
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=512, enable_prefix_caching=True)
    a = make_request("a", 64, 4, prompt_token_ids=base)
    s.add_request(a)
    step_full(s)
    a_blocks = block_ids(s, "a")
    if first_finished:
        run_to_completion(s, [])
    b = make_request("b", 64, 4, prompt_token_ids=base[:shared] + list(range(500, 500 + 64 - shared)))
    s.add_request(b)
    assert b.num_computed_tokens == 0
    rec = step_full(s)
    (new,) = rec.scheduler_output.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == hit
    assert rec.num_scheduled_tokens["b"] == 64 - hit
    assert b.num_computed_tokens == 64
    assert block_ids(s, "b")[: hit // 16] == a_blocks[: hit // 16]
    _assert_exact(run_to_completion(s, []), [b], whole_life=False)


def test_h_no_prefix_caching_means_full_prefill():
    """Control: same prompts with prefix caching off -> hit 0, full 64-token prefill."""
    base = list(range(10, 74))
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=512, enable_prefix_caching=False)
    s.add_request(make_request("a", 64, 4, prompt_token_ids=base))
    step_full(s)
    s.add_request(make_request("b", 64, 4, prompt_token_ids=base))
    rec = step_full(s)
    assert rec.scheduler_output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert rec.num_scheduled_tokens["b"] == 64


# ---------------------------------------------------------------------------
# extra facts: running order, async bookkeeping
# ---------------------------------------------------------------------------


def test_running_list_order_decides_budget_priority_and_victim():
    """``scheduler.running`` order is the priority order of the running loop
    (budget is handed out in that order) and, for policy "fcfs", the
    preemption victim is always ``running[-1]``.  Reordering the list in place
    before ``schedule()`` is therefore a lever for "who gets tokens first" and
    "who gets preempted"."""
    s = make_scheduler(num_blocks=100, max_num_batched_tokens=256)
    reqs = [make_request(f"r{i}", 20, 30) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step_full(s)
    s.running.reverse()  # r2, r1, r0
    s.max_num_scheduled_tokens = 2
    rec = step_full(s)
    assert rec.num_scheduled_tokens == {"r2": 1, "r1": 1}
    s.max_num_scheduled_tokens = 256

    # KV pressure: 5 usable blocks for 3 requests that each hold 2 blocks soon.
    p = make_scheduler(num_blocks=8, max_num_batched_tokens=256)
    preqs = [make_request(f"p{i}", 30, 30) for i in range(3)]
    for r in preqs:
        p.add_request(r)
    step_full(p)
    assert [r.request_id for r in p.running] == ["p0", "p1", "p2"]
    p.running[:] = [preqs[2], preqs[0], preqs[1]]  # make p1 the last
    victims: list[str] = []
    while not victims:
        victims = sorted(step_full(p).preempted_ids)
    assert victims == ["p1"]
    _assert_exact(run_to_completion(p, []), preqs, whole_life=False)
    _assert_exact(run_to_completion(s, []), reqs, whole_life=False)


def test_async_bookkeeping_sync_vs_pipelined():
    """What a policy sees inside ``schedule()`` (current_step semantics,
    placeholders).  Sync: after each step ``num_output_placeholders == 0`` and
    ``num_computed_tokens == num_tokens - 1`` for a decoding request (the last
    sampled token is not computed yet).  Pipelined: while step N+1 is being
    scheduled, step N's sampled token is a placeholder:
    ``num_output_placeholders == 1``, ``num_in_flight_tokens == 1`` and
    ``num_computed_tokens`` already counts it, i.e. ``num_computed_tokens ==
    num_tokens + num_output_placeholders - 1``.  Remaining output budget is
    ``max_tokens - num_output_tokens - num_output_placeholders`` in both.
    ``current_step`` is incremented at the start of ``schedule()``, so
    ``update_from_output`` of step N runs with ``current_step == N`` (sync)
    or ``N + 1`` (pipelined)."""
    seen: dict[str, list] = {}

    class Probe(AsyncScheduler):
        def update_from_output(self, scheduler_output, model_runner_output):
            seen.setdefault(self.mode, []).append(self.current_step)
            return super().update_from_output(scheduler_output, model_runner_output)

    for pipelined in (False, True):
        s = make_scheduler(num_blocks=100, scheduler_cls=Probe)
        s.mode = "pipelined" if pipelined else "sync"
        a = make_request("a", 20, 8)
        s.add_request(a)
        for _ in range(4):
            step_full(s, pipelined=pipelined)
        assert s.current_step == 4
        if pipelined:
            assert a.num_output_placeholders == 1 and a.num_in_flight_tokens == 1
            assert a.num_output_tokens == 3
        else:
            assert a.num_output_placeholders == 0 and a.num_in_flight_tokens == 0
            assert a.num_output_tokens == 4
        assert a.num_computed_tokens == a.num_tokens + a.num_output_placeholders - 1
        assert a.max_tokens - a.num_output_tokens - a.num_output_placeholders == 4
        _assert_exact(run_to_completion(s, [], pipelined=pipelined), [a], whole_life=False)
    assert seen["sync"][:4] == [1, 2, 3, 4]
    assert seen["pipelined"][:3] == [2, 3, 4]
