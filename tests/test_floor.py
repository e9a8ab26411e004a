"""The fluid floor of a decode pool (serving/placement/floor.py): its curve, its mean, its limits."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.perf.latency import DecodePoolLatency, LinearLatency
from serving.placement.floor import DecodeCost, fluid_floor, need_curve

pytestmark = pytest.mark.unit

# BLIS's Llama-3.1-8B/H100 shape: 5.75 ms a step, 6 µs a decode, 0.049 µs a context token read
LAT = DecodePoolLatency(LinearLatency(5752.7, 17.3, 6.0, 0.0489))
TPOT = 0.0125


def test_decode_cost_reads_a_linear_step_model_exactly():
    c = DecodeCost.of(LAT)
    assert c.fixed_s == pytest.approx(5752.7e-6)
    assert c.per_decode_s == pytest.approx(6.0e-6)
    assert c.per_context_token_s == pytest.approx(0.0489e-6)


def test_one_request_costs_its_decode_and_its_growing_kv_read():
    c = DecodeCost.of(LAT)
    dt = 0.05
    curve = need_curve([0.0], [10_000], [400], c, TPOT, dt)
    stay = math.ceil(400 * TPOT / dt)  # 5 s of decoding: 100 cells
    assert curve[0] == pytest.approx(c.per_decode_s + c.per_context_token_s * 10_000)
    # a cell later the context has grown by dt / TPOT tokens
    assert curve[10] - curve[0] == pytest.approx(c.per_context_token_s * 10 * dt / TPOT)
    assert curve[stay - 1] > curve[0] and np.allclose(curve[stay:], 0.0, atol=1e-12)
    f = fluid_floor([0.0], [10_000], [400], LAT, TPOT, dt)
    assert f.room_s == pytest.approx(TPOT - c.fixed_s)
    assert f.mean == pytest.approx(curve[0] / f.room_s)  # one arrival: the mean is the first cell's need


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20), st.integers(0, 50_000), st.integers(0, 600)), min_size=1, max_size=25))
def test_the_curve_is_the_sum_of_every_stay(reqs):
    """The difference arrays give what adding each request's stay cell by cell gives."""
    c, dt = DecodeCost.of(LAT), 0.05
    arrivals, prompts, outputs = zip(*reqs)
    curve = need_curve(arrivals, prompts, outputs, c, TPOT, dt)
    t0 = min(arrivals)
    brute = np.zeros_like(curve)
    for a, p, o in reqs:
        if o == 0:
            continue
        i0 = int((a - t0) / dt)
        i1 = max(i0 + 1, math.ceil((a - t0 + o * TPOT) / dt))
        for j in range(i0, i1):
            brute[j] += c.per_decode_s + c.per_context_token_s * (p + (j - i0) * dt / TPOT)
    assert np.allclose(curve, brute, rtol=1e-9, atol=1e-12)


def test_mean_is_littles_law_and_peak_sits_above_it():
    """Poisson arrivals: the time-averaged need is the rate times one stay's summed step cost, over the room."""
    rng = random.Random(0)
    rate, n = 20.0, 4000
    t, arrivals, prompts, outputs = 0.0, [], [], []
    for _ in range(n):
        t += rng.expovariate(rate)
        arrivals.append(t)
        prompts.append(rng.randint(1000, 20_000))
        outputs.append(rng.randint(50, 600))
    c = DecodeCost.of(LAT)
    f = fluid_floor(arrivals, prompts, outputs, LAT, TPOT)
    per_stay = np.mean([o * (c.per_decode_s + c.per_context_token_s * (p + o / 2)) for p, o in zip(prompts, outputs)])
    expected = rate * per_stay * TPOT / f.room_s
    assert f.mean == pytest.approx(expected, rel=0.05)
    assert f.peak > f.mean
    assert f.window_s == pytest.approx(np.median(outputs) * TPOT)
    # twice the rate, the same requests: twice the need
    f2 = fluid_floor([a / 2 for a in arrivals], prompts, outputs, LAT, TPOT)
    assert f2.mean == pytest.approx(2 * f.mean, rel=0.05)


def test_a_target_under_the_fixed_step_cost_is_refused():
    with pytest.raises(ValueError, match="no fleet size keeps it"):
        fluid_floor([0.0], [100], [10], LAT, 0.005)
    with pytest.raises(ValueError, match="one arrival, prompt and output"):
        fluid_floor([0.0, 1.0], [100], [10, 10], LAT, TPOT)
