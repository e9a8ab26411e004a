"""The learnt engine bound (serving/gateway/concurrency.py): what counts as a miss, when the bound moves, where it
settles on an engine whose answers miss past a known concurrency, and that it never leaves [floor, ceiling]."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.concurrency import BETA, EngineLimit, InFlightClock, Served, met_slo

pytestmark = pytest.mark.unit

TTFT, ATGT = 0.2, 0.02


def _answer(lived: float, met: bool, tokens: int = 11, sent: float = 0.0) -> Served:
    """A streamed answer sent at ``sent`` that lived at ``lived`` requests in flight: 0.1 s to its first token, then its
    later tokens at 15 ms (met) or 30 ms (missed) each."""
    return Served(sent, sent + 0.1, sent + 0.1 + (tokens - 1) * (0.015 if met else 0.03), tokens, lived)


def test_a_miss_is_judged_from_the_send_to_the_engine_by_ttft_and_mean_later_tokens():
    assert met_slo(Served(10.0, 10.19, 10.38, 11, 1), TTFT, ATGT)  # 190 ms first token, 19 ms each after
    assert not met_slo(Served(10.0, 10.21, 10.3, 11, 1), TTFT, ATGT)  # first token late
    assert not met_slo(Served(10.0, 10.1, 10.4, 11, 1), TTFT, ATGT)  # 30 ms a later token
    assert met_slo(Served(10.0, 10.15, 10.15, 1, 1), TTFT, ATGT)  # one token: TTFT alone
    # non-streamed: the whole answer against TTFT + ATGT x later tokens
    assert met_slo(Served(10.0, None, 10.39, 11, 1), TTFT, ATGT)
    assert not met_slo(Served(10.0, None, 10.41, 11, 1), TTFT, ATGT)


def test_misses_near_the_bound_cut_it_once_per_cut_and_misses_well_below_it_do_not():
    lim = EngineLimit(16, TTFT, ATGT, start=8)
    assert lim.bound == 8  # starts at the engines' batch, below the ceiling
    for i in range(30):
        assert not lim.observe(_answer(4, met=False, sent=i))  # half of the bound: noise no bound cures
    assert (lim.bound, lim.cuts, lim.missed, lim.miss_rate) == (8, 0, 30, 0.0)
    lim.observe(_answer(8, met=False, sent=30))
    lim.observe(_answer(8, met=False, sent=31))  # miss rate 9.75%: within the 10% target, no cut yet
    assert lim.cuts == 0
    lim.observe(_answer(7, met=False, sent=32))  # past it: cut to BETA x the concurrency the answer lived under
    assert lim.cuts == 1 and lim.limit == pytest.approx(BETA * 7) and lim.bound == 5
    cut_at = _answer(7, met=False, sent=32).end
    for i in range(10):  # answers sent before the cut were admitted under the old bound: no second cut for them
        lim.observe(_answer(6, met=False, sent=cut_at - 1 + i * 0.01))
    assert lim.cuts == 1
    lim.observe(_answer(5, met=False, sent=cut_at))  # the first sent under the new bound
    assert lim.cuts == 2 and lim.limit == pytest.approx(BETA * 5)  # BETA x the smaller of the bound and its concurrency


def test_answers_that_meet_the_slo_at_the_bound_raise_it_to_the_ceiling_and_below_it_do_not():
    lim = EngineLimit(8, TTFT, ATGT, floor=2, start=4)
    for i in range(50):
        lim.observe(_answer(2, met=True, sent=i))  # half of the bound: nothing shows the engine could hold more
    assert lim.bound == 4 and lim.raises == 0
    n = 0
    while lim.bound < 8:
        lim.observe(_answer(lim.limit, met=True, sent=50 + n))
        n += 1
    assert lim.raises == n and 4 * 4 <= n <= 8 * 4  # about one place per bound's worth of answers
    lim.observe(_answer(8, met=True, sent=99))
    assert lim.limit == 8.0  # never past the ceiling


def _closed_loop(capacity: int, miss_seen_after: int) -> list[int]:
    """Closed loop, saturated: one answer admitted every 10 ms at the bound then, living at it, ending eight answers
    later. Admitted past ``capacity`` it misses (its second token 5 ms or more after its first, against a 2 ms target),
    and the bound learns so ``miss_seen_after`` answers after its send: 8 at its end, fewer at a stream's checkpoint;
    within capacity it meets (101 tokens 0.75 ms apart) and is shown at its end. Returns the bound each answer was
    admitted under, after a warm-up."""
    lim = EngineLimit(16, TTFT, 0.002)
    pending: list[tuple[int, int, int]] = []  # (when it is judged, its number, the bound it was admitted under)
    seen = []
    for i in range(3000):
        while pending and pending[0][0] <= i:
            at, j, b = heapq.heappop(pending)
            sent, now = j * 0.01, at * 0.01
            if b <= capacity:
                assert lim.observe(Served(sent, sent + 0.005, now, 101, b))
            elif miss_seen_after < 8:
                assert lim.early(Served(sent, sent + 0.005, now, 2, b))
            else:
                assert not lim.observe(Served(sent, sent + 0.005, now, 2, b))
        b = lim.bound
        heapq.heappush(pending, (i + (8 if b <= capacity else miss_seen_after), i, b))
        if i >= 1000:
            seen.append(b)
    return seen


@pytest.mark.parametrize("capacity", [2, 5, 11])
def test_on_an_engine_that_misses_past_a_concurrency_the_bound_settles_at_or_just_below_it(capacity):
    """Judged at their ends, the answers in flight when the bound passes capacity all miss before a cut reaches them,
    so the bound spends more answers past capacity than the 10% miss target (13-16% for capacities 5 and 11); judged
    at a stream's checkpoint (two answers after its send, not eight), 7-8%, and the bound sits higher on average."""
    at_end, early = _closed_loop(capacity, 8), _closed_loop(capacity, 2)
    for seen, most in ((at_end, 0.2), (early, 0.1)):
        over = sum(b > capacity for b in seen) / len(seen)
        assert over <= most, f"past capacity {over:.1%} of the time"
        assert min(seen) >= max(1, int(BETA * (capacity + 1)) - 1)
        assert sum(seen) / len(seen) >= 0.8 * capacity
    if capacity > 2:  # (at 2 the bound never passes it either way)
        assert sum(b > capacity for b in early) < 0.7 * sum(b > capacity for b in at_end)
        assert sum(early) >= sum(at_end)


def test_a_stream_already_missing_at_its_checkpoint_is_judged_then_and_one_on_track_is_not():
    lim = EngineLimit(8, TTFT, ATGT, start=8)
    # 33 tokens so far, the later ones 15 ms apart: on track, nothing learnt until its end
    assert not lim.early(Served(0.0, 0.1, 0.1 + 32 * 0.015, 33, 8))
    assert (lim.observed, lim.missed, lim.miss_rate) == (0, 0, 0.0)
    # 30 ms apart: a miss now, counted once, as at its end
    assert lim.early(Served(1.0, 1.1, 1.1 + 32 * 0.03, 33, 8))
    assert (lim.observed, lim.missed, lim.miss_rate) == (1, 1, pytest.approx(0.05))
    # a late first token is a miss at the checkpoint whatever the pace after it
    assert lim.early(Served(2.0, 2.3, 2.3 + 32 * 0.01, 33, 8))
    assert lim.miss_rate > 0.09
    # past the miss target: the cut comes at the checkpoint, and the next cut waits for answers sent after it
    assert lim.early(Served(3.0, 3.1, 3.1 + 32 * 0.03, 33, 8))
    assert lim.cuts == 1 and lim.bound == int(BETA * 8)
    assert lim.early(Served(3.5, 3.6, 3.6 + 32 * 0.03, 33, 8)) and lim.cuts == 1


@settings(max_examples=200, deadline=None)
@given(ceiling=st.integers(1, 64), floor=st.integers(1, 64),
       answers=st.lists(st.tuples(st.floats(0, 200), st.booleans(), st.integers(1, 2000)), max_size=300))
def test_the_bound_never_leaves_its_floor_and_ceiling(ceiling, floor, answers):
    if floor > ceiling:
        with pytest.raises(ValueError):
            EngineLimit(ceiling, TTFT, ATGT, floor=floor)
        return
    lim = EngineLimit(ceiling, TTFT, ATGT, floor=floor)
    for lived, met, tokens in answers:
        lim.observe(_answer(lived, met, tokens))
        assert floor <= lim.bound <= ceiling
        assert 0.0 <= lim.miss_rate <= 1.0


def test_the_clock_gives_an_answers_average_concurrency_from_two_readings():
    clock = InFlightClock(0.0)
    clock.set(2, 1.0)
    since = (1.0, clock.area(1.0))
    clock.set(4, 2.0)  # two in flight for 1 s, then four for 2 s
    clock.set(1, 4.0)
    assert clock.average(since, 4.0) == pytest.approx((2 * 1 + 4 * 2) / 3)
    assert clock.average(since, 1.0) == 1.0  # no time passed: the count now
