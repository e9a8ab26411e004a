"""The learnt engine bound (serving/gateway/concurrency.py): what counts as a miss, when the bound moves, where it
settles on an engine whose answers miss past a known concurrency, and that it never leaves [floor, ceiling]."""

from __future__ import annotations

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


@pytest.mark.parametrize("capacity", [2, 5, 11])
def test_on_an_engine_that_misses_past_a_concurrency_the_bound_settles_at_or_just_below_it(capacity):
    """Closed loop, saturated: one answer every 10 ms, each sent eight answers before it ends and living at the bound it
    was admitted under; it misses (two tokens 70 ms apart) when that bound was past ``capacity``, else meets (eleven
    tokens 7 ms apart). The answers in flight when the bound passes capacity all miss before a cut reaches them, so the
    bound spends more answers past capacity than the 10% miss target (13-17% for capacities 5 and 11)."""
    lim = EngineLimit(16, TTFT, ATGT)
    admitted = [lim.bound] * 8
    seen = []
    for i in range(3000):
        b = admitted.pop(0)
        sent, end = (i - 8) * 0.01, i * 0.01
        lim.observe(Served(sent, sent + 0.01, end, 11 if b <= capacity else 2, b))
        admitted.append(lim.bound)
        if i >= 1000:
            seen.append(lim.bound)
    over = sum(b > capacity for b in seen) / len(seen)
    assert over <= 0.2, f"past capacity {over:.1%} of the time"
    assert min(seen) >= max(1, int(BETA * (capacity + 1)) - 1)
    assert sum(seen) / len(seen) >= 0.8 * capacity


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
