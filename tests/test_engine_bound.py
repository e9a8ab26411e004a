"""The learnt engine bound (serving/gateway/concurrency.py): what counts as a miss, when the bound moves, where it
settles on an engine whose answers miss past a known concurrency, and that it never leaves [floor, ceiling]."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.concurrency import BETA, EngineLimit, InFlightClock, Served, met_slo

pytestmark = pytest.mark.unit

TTFT, ATGT = 0.2, 0.02


def _answer(lived: float, met: bool, tokens: int = 11) -> Served:
    """A streamed answer that lived at ``lived`` requests in flight: 0.1 s to its first token, then 10 later tokens at
    15 ms (met) or 30 ms (missed) each."""
    return Served(0.0, 0.1, 0.1 + (tokens - 1) * (0.015 if met else 0.03), tokens, lived)


def test_a_miss_is_judged_from_the_send_to_the_engine_by_ttft_and_mean_later_tokens():
    assert met_slo(Served(10.0, 10.19, 10.38, 11, 1), TTFT, ATGT)  # 190 ms first token, 19 ms each after
    assert not met_slo(Served(10.0, 10.21, 10.3, 11, 1), TTFT, ATGT)  # first token late
    assert not met_slo(Served(10.0, 10.1, 10.4, 11, 1), TTFT, ATGT)  # 30 ms a later token
    assert met_slo(Served(10.0, 10.15, 10.15, 1, 1), TTFT, ATGT)  # one token: TTFT alone
    # non-streamed: the whole answer against TTFT + ATGT x later tokens
    assert met_slo(Served(10.0, None, 10.39, 11, 1), TTFT, ATGT)
    assert not met_slo(Served(10.0, None, 10.41, 11, 1), TTFT, ATGT)


def test_misses_near_the_bound_cut_it_once_per_bounds_worth_of_answers_and_misses_far_below_do_not():
    lim = EngineLimit(16, TTFT, ATGT)
    for _ in range(30):
        assert not lim.observe(_answer(4, met=False))  # a quarter of the bound: noise no bound cures
    assert (lim.bound, lim.cuts, lim.missed) == (16, 0, 30)
    lim.observe(_answer(16, met=False))  # miss rate 5%: at the target, no cut yet
    assert lim.cuts == 0
    lim.observe(_answer(15, met=False))  # past it: cut to BETA x the concurrency the answer lived under
    assert lim.cuts == 1 and lim.limit == pytest.approx(BETA * 15) and lim.bound == 12
    for _ in range(lim.bound - 1):  # the answers admitted under the old bound: no second cut for the same congestion
        lim.observe(_answer(12, met=False))
    assert lim.cuts == 1
    lim.observe(_answer(12, met=False))
    assert lim.cuts == 2 and lim.bound == int(BETA * BETA * 15)


def test_answers_that_meet_the_slo_near_the_bound_raise_it_to_the_ceiling_and_idle_ones_do_not():
    lim = EngineLimit(8, TTFT, ATGT, floor=2)
    lim.limit = 2.0
    for _ in range(50):
        lim.observe(_answer(1, met=True))  # half of the bound: the engine was not near it, no evidence it can hold more
    assert lim.bound == 2 and lim.raises == 0
    n = 0
    while lim.bound < 8:
        lim.observe(_answer(lim.limit, met=True))
        n += 1
    assert lim.raises == n and 2 * 6 <= n <= 8 * 6  # about one place per bound's worth of answers
    lim.observe(_answer(8, met=True))
    assert lim.limit == 8.0  # never past the ceiling


@pytest.mark.parametrize("capacity", [2, 5, 11])
def test_on_an_engine_that_misses_past_a_concurrency_the_bound_settles_at_or_just_below_it(capacity):
    """Closed loop, saturated: every answer lives at the bound; it misses when the bound is past ``capacity``."""
    lim = EngineLimit(16, TTFT, ATGT)
    seen = []
    for i in range(3000):
        lim.observe(_answer(lim.bound, met=lim.bound <= capacity))
        if i >= 1000:
            seen.append(lim.bound)
    over = sum(b > capacity for b in seen) / len(seen)
    assert over <= 0.06, f"past capacity {over:.1%} of the time"
    assert min(seen) >= max(1, int(BETA * (capacity + 1)) - 1)
    assert sum(seen) / len(seen) >= 0.85 * capacity


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
