"""Arrival specs (serving/sim/arrivals.py): Poisson, Gamma bursts and a real trace's gaps, each at the rate asked for."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from serving.sim.arrivals import ArrivalSpecError, arrival_times, parse_arrivals
from tests.datafiles import need_data


def _rate(t: np.ndarray) -> float:
    return (len(t) - 1) / t[-1]


def _cv(t: np.ndarray) -> float:
    g = np.diff(t)
    return float(g.std() / g.mean())


def _mooncake(path: Path, ms: list[int]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 10, "output_length": 5, "hash_ids": []}) + "\n"
                            for t in ms))
    return path


@pytest.mark.unit
def test_gamma_keeps_the_mean_rate_and_spreads_its_gaps_by_the_cv():
    t = arrival_times("gamma:3", 200_000, 5.0, seed=1)
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert _rate(t) == pytest.approx(5.0, rel=0.03)
    assert _cv(t) == pytest.approx(3.0, rel=0.05)
    p = arrival_times("poisson", 200_000, 5.0, seed=1)
    assert _rate(p) == pytest.approx(5.0, rel=0.02) and _cv(p) == pytest.approx(1.0, rel=0.03)


@pytest.mark.unit
def test_the_seed_draws_the_gamma_gaps_and_gamma_1_is_poisson():
    a, b = arrival_times("gamma:3", 100, 2.0, seed=0), arrival_times("gamma:3", 100, 2.0, seed=1)
    assert not np.allclose(a, b) and np.array_equal(a, arrival_times("gamma:3", 100, 2.0, seed=0))
    assert np.array_equal(arrival_times("gamma:1", 100, 2.0, seed=4), arrival_times("poisson", 100, 2.0, seed=4))


@pytest.mark.unit
def test_trace_times_keep_the_traces_pattern_at_the_rate_and_wrap_around(tmp_path):
    trace = _mooncake(tmp_path / "trace.jsonl", [0, 1000, 3000, 6000, 12000])  # gaps 1, 2, 3, 6 s
    spec = f"trace-times:{trace}"
    short = arrival_times(spec, 3, 4.0)
    assert np.diff(short) / np.diff(short)[0] == pytest.approx([1, 2])  # the trace's first gaps, in order
    assert _rate(short) == pytest.approx(4.0)
    long = arrival_times(spec, 11, 4.0)  # more requests than the trace has arrivals: its gaps again from the first
    g = np.diff(long)
    assert g / g[0] == pytest.approx([1, 2, 3, 6, 1, 2, 3, 6, 1, 2])
    assert _rate(long) == pytest.approx(4.0) and long[0] == 0.0
    assert np.array_equal(long, arrival_times(spec, 11, 4.0, seed=9))  # the trace's pattern, whatever the seed
    assert len(arrival_times(spec, 1, 4.0)) == 1


def test_trace_times_by_name_replay_the_azure_code_traces_bursts(data):
    t = arrival_times("trace-times:azure-code", 20_000, 2.0)  # 8,819 arrivals in the trace: it wraps twice
    assert _rate(t) == pytest.approx(2.0) and _cv(t) > 5  # the code trace is far burstier than Poisson
    assert parse_arrivals("trace-times:mooncake-conversation").trace == need_data("traces/mooncake_conversation_trace.jsonl")


@pytest.mark.unit
@pytest.mark.parametrize("spec,needle", [
    ("", "unknown arrivals"), ("exponential", "unknown arrivals"), ("poisson:2", "unknown arrivals"),
    ("gamma", "gamma:CV"), ("gamma:0", "gamma:CV"), ("gamma:-2", "gamma:CV"), ("gamma:lots", "gamma:CV"),
    ("gamma:inf", "gamma:CV"), ("trace-times:", "needs a trace"), ("trace-times:/no/such/trace.csv", "no trace file"),
])
def test_a_bad_spec_is_refused_in_one_line(spec, needle):
    with pytest.raises(ArrivalSpecError, match=needle) as e:
        parse_arrivals(spec)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


@pytest.mark.unit
def test_a_trace_without_timestamps_is_refused(tmp_path):
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("num_prefill_tokens,num_decode_tokens\n10,5\n20,6\n")
    with pytest.raises(ArrivalSpecError, match="no timestamps"):
        parse_arrivals(f"trace-times:{lengths}")
    with pytest.raises(ArrivalSpecError, match="two distinct timestamps"):
        parse_arrivals(f"trace-times:{_mooncake(tmp_path / 'one.jsonl', [5, 5])}")
    with pytest.raises(ValueError, match="rate"):
        arrival_times("gamma:2", 5, 0.0)


def test_a_setups_rates_use_its_arrivals_and_its_seed(data):
    from serving.sim.scenarios import SCENARIOS, build_setup

    wl = str(need_data("traces/length_only/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"))
    s0, s1 = (build_setup(SCENARIOS["ecoserve-paper"], workload=wl, max_requests=300, seed=s, arrivals="gamma:3")
              for s in (0, 1))
    assert s0.arrivals == "gamma:3"
    a0, a1 = (np.array([r.arrival for r in s.at_rate(2.0)]) for s in (s0, s1))
    assert np.array_equal(a0, arrival_times("gamma:3", 300, 2.0, seed=0)) and not np.allclose(a0, a1)
    assert [r.rid for r in s0.at_rate(2.0)] == [r.rid for r in s0.requests]  # the workload's own requests, retimed
    poisson = build_setup(SCENARIOS["ecoserve-paper"], workload=wl, max_requests=300)
    assert poisson.arrivals == "poisson"
    assert np.array_equal([r.arrival for r in poisson.at_rate(2.0)], arrival_times("poisson", 300, 2.0))
    with pytest.raises(ArrivalSpecError):
        build_setup(SCENARIOS["ecoserve-paper"], workload=wl, max_requests=10, arrivals="gamma:-1")


def test_arrivals_other_than_poisson_replace_a_trace_scenarios_own_timestamps(data):
    need_data("traces/mooncake_conversation_trace.jsonl")  # the long-context scenario's trace
    from serving.sim.scenarios import SCENARIOS, build_setup

    own = build_setup(SCENARIOS["long-context"], max_requests=200)
    bursty = build_setup(SCENARIOS["long-context"], max_requests=200, arrivals="gamma:2")
    k = own.native_rate() / 0.5
    assert [r.arrival for r in own.at_rate(0.5)] == pytest.approx([r.arrival * k for r in own.requests])
    assert np.array_equal([r.arrival for r in bursty.at_rate(0.5)], arrival_times("gamma:2", 200, 0.5))
