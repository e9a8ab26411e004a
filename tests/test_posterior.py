"""The posterior policy's parts: a length belief conditioned on what a request has written, its ranks, the service
priors no client can shape, and the policy's order in the cases whose answer is known (SRPT with exact lengths,
SeaLLM's per-service order with no per-request prediction, TTFT misses behind requests still on time)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.policy.belief import LengthBelief
from serving.policy.config import PolicyConfig
from serving.policy.priors import ServicePriors
from serving.policy.registry import make_policy
from serving.policy.request import Prediction, Request

pytestmark = pytest.mark.unit


def _fresh(b: LengthBelief) -> LengthBelief:
    return LengthBelief(b.xs, b.ps, b.cap)


beliefs = st.lists(st.tuples(st.integers(1, 3000), st.floats(0.01, 1.0)), min_size=1, max_size=30).map(
    lambda pts: LengthBelief([x for x, _ in pts], [p for _, p in pts]))


@settings(max_examples=150, deadline=None)
@given(b=beliefs, ages=st.lists(st.integers(0, 4000), min_size=1, max_size=12))
def test_cached_segments_answer_as_a_fresh_belief_does(b, ages):
    """The per-segment cache is an optimisation only: any sequence of ages reads what a fresh object reads."""
    for a in ages:
        f = _fresh(b)
        assert b.mean_total(a) == pytest.approx(f.mean_total(a))
        assert b.quantile_total(a, 0.7) == f.quantile_total(a, 0.7)
        assert b.gittins_rank(a, True) == pytest.approx(f.gittins_rank(a, True))
        assert b.gittins_rank(a, False) == pytest.approx(f.gittins_rank(a, False))
        assert b.mean_total(a) > a and b.remaining(a) >= 1


@given(b=beliefs, a=st.integers(0, 3000))
def test_conditioning_rules_out_what_was_written(b, a):
    """``E[L | L > a]`` is at least the unconditional mean, and every quantile is past the age."""
    assert b.mean_total(a) >= min(b.mean_total(0), b.xs[-1]) - 1e-9 or b.outlived(a)
    for q in (0.1, 0.5, 0.9):
        assert b.quantile_total(a, q) > a


def test_exact_length_ranks_as_srpt():
    b = LengthBelief.point(300)
    assert b.gittins_rank(0, weighted=False) == 300
    assert b.gittins_rank(120, weighted=False) == 180
    assert b.gittins_rank(120, weighted=True) == 180 * 300  # c-mu with c = 1/L: remaining x length
    assert b.remaining(120) == 180


def test_a_request_that_outlives_its_likely_length_sinks():
    """Mostly short, sometimes very long: fresh it ranks near the short length; once past it, the tail is all that is
    left and it ranks behind a fresh request of the same belief (what SeaLLM's doubling budget does by rule)."""
    b = LengthBelief([50, 2000], [0.9, 0.1])
    fresh, aged = b.gittins_rank(0, False), b.gittins_rank(60, False)
    assert fresh < 100
    assert aged == pytest.approx(1940)
    assert b.remaining(60) == pytest.approx(1940)


def test_buckets_spread_inside_each_bucket_and_the_open_one_stops_at_the_cap():
    b = LengthBelief.from_buckets((100, 200), (0.5, 0.25, 0.25), cap=300)
    assert b.xs[0] > 0 and b.xs[-1] <= 300
    assert math.fsum(b.ps) == pytest.approx(1.0)
    assert b.quantile_total(0, 0.5) <= 100 < b.quantile_total(0, 0.6)
    assert b.outlived(300)
    assert b.remaining(300) >= 1  # past every point: the cap is all that is left, never less than a token


def _req(rid: int, pred: float, service: str = "", generated: int = 0, max_tokens: int | None = None,
         client: str = "", learnable: bool = True, arrival: float = 0.0) -> Request:
    r = Request(rid, arrival, 10, Prediction(pred), max_tokens=max_tokens, service=service, client=client,
                learnable=learnable)
    r.generated = generated
    return r


def test_prior_ignores_lengths_a_client_shaped():
    """The attack, replayed: 150 answers cut at ``max_tokens: 1`` by one key move nothing; honest answers do."""
    pri = ServicePriors(window=512, client_share=0.25)
    for i in range(64):
        pri.learn(_req(i, 20, "terse", generated=15 + i % 10, client="key-honest"))
    before = pri.profile("terse").prior.mean_total(0)
    for i in range(150):
        pri.learn(_req(1000 + i, 20, "terse", generated=1, max_tokens=1, client="key-evil"))
        pri.learn(_req(2000 + i, 20, "terse", generated=1, client="key-evil", learnable=False))  # stop sequence etc.
    assert pri.profile("terse").prior.mean_total(0) == before
    assert pri.refused == 300


def test_one_key_holds_at_most_its_share_of_a_window():
    pri = ServicePriors(window=64, client_share=0.25)
    for i in range(200):
        pri.learn(_req(i, 20, "s", generated=30, client="key-a"))
    for i in range(40):
        pri.learn(_req(500 + i, 20, "s", generated=300, client=f"key-{i % 5}"))
    w = pri.windows["s"]
    assert w.per_client["key-a"] <= 16
    assert sum(1 for s in w.samples if s[0] == "key-a") == w.per_client["key-a"]
    assert len(w.samples) <= 64


def test_skill_decides_between_prediction_and_service_prior():
    """A predictor that ranks this service's requests perfectly keeps its own prediction; one whose predictions say
    nothing of the lengths leaves the service prior."""
    cfg = PolicyConfig(max_model_len=4096)
    good, blind = make_policy("lengthwise-posterior", cfg, 4000), make_policy("lengthwise-posterior", cfg, 4000)
    for i in range(300):
        n = 20 + (i * 37) % 400
        good._completed(_req(i, n, "s", generated=n))  # the host's report of a finished request
        blind._completed(_req(i, 20 + (i * 101) % 397, "s", generated=n))
    assert good.priors.profile("s").skill > 0.95 and good.priors.profile("s").tau == pytest.approx(1.0)
    assert blind.priors.profile("s").skill < 0.1 and abs(blind.priors.profile("s").tau) < 0.1
    probe_short, probe_long = _req(9001, 30, "s"), _req(9002, 400, "s")
    assert good.belief_of(probe_short).mean_total(0) < 60
    assert good.belief_of(probe_long).mean_total(0) > 300
    prior_mean = blind.priors.profile("s").prior.mean_total(0)
    for probe in (_req(9003, 30, "s"), _req(9004, 400, "s")):
        assert blind.belief_of(probe).mean_total(0) == pytest.approx(prior_mean, rel=0.15)


def _queue(policy) -> list[int]:
    return [r.rid for r in policy.waiting]


def test_exact_predictions_order_as_srpt_and_no_prediction_as_the_service_order():
    cfg = PolicyConfig(max_model_len=4096, max_num_seqs=1)
    pol = make_policy("lengthwise-own", cfg, 4000)
    for rid, n in enumerate((400, 30, 200, 90)):
        pol.add(_req(rid, n), 0.0)
    assert _queue(pol) == [1, 3, 2, 0]
    prior = make_policy("lengthwise-prior", cfg, 4000)
    for i in range(64):  # the terse service answers in about 20 tokens, the wordy one in about 400
        prior.priors.learn(_req(i, 1, "terse", generated=15 + i % 10))
        prior.priors.learn(_req(100 + i, 1, "wordy", generated=380 + i % 40))
    for rid, (svc, pred) in enumerate((("wordy", 5), ("terse", 900), ("wordy", 1), ("terse", 700))):
        prior.add(_req(rid, pred, svc), 0.0)
    assert _queue(prior) == [1, 3, 0, 2]  # by service, first come first served within one: predictions unread


def test_a_request_past_its_ttft_target_waits_behind_those_still_on_time():
    cfg = PolicyConfig(max_model_len=4096, max_num_seqs=1, slo_kind="ttft+tpot", ttft_s=1.0, tfs=64)
    pol = make_policy("lengthwise-posterior", cfg, 4000)
    pol.add(_req(0, 500, arrival=0.0), 0.0)   # runs first, holds the one slot
    pol.schedule(0.0)
    pol.add(_req(1, 10, arrival=0.0), 0.0)    # short, but will have missed its TTFT at t = 1
    pol.add(_req(2, 50, arrival=1.5), 1.5)
    pol.schedule(1.6)
    assert _queue(pol) == [2, 1]
    assert 1 in pol.missed and pol.stats["missed_ttft"] == 1


def test_every_slo_kind_runs_a_workload_through_with_the_ledger_checked():
    from tests.test_policy import drive

    for kind in ("jct", "ttft+tpot", "normalised"):
        cfg = PolicyConfig(max_model_len=512, max_num_seqs=8, tfs=64, block_size=16, slo_kind=kind, ttft_s=5.0)
        pol = make_policy("lengthwise-posterior", cfg, 40)
        reqs = [(_req(i, 10 + (i * 53) % 200, service=f"s{i % 3}", arrival=float(i // 3)), 5 + (i * 31) % 180)
                for i in range(60)]
        for r, _ in reqs:
            r.deadline = r.arrival + 400
        run = drive(pol, reqs)
        assert len(run.done) == 60


def test_hotpath_bench_measures_every_policy_in_steady_state(tmp_path):
    """The fast counterpart of ``lengthwise bench hotpath``: it runs, each policy with 256 running and a queue of at
    least 1,000 behind them, and writes a positive cost per step for each."""
    import json

    from serving.bench.hotpath import measure
    from serving.cli import main

    m = measure("lengthwise-posterior", steps=10)
    assert m["running"] == 256 and m["waiting_at_start"] == 1000 and m["us_mean"] > 0
    out = tmp_path / "hot.json"
    assert main(["bench", "hotpath", "--policies", "sarathi,lengthwise-posterior", "--steps", "10", "--rounds", "1",
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"sarathi", "lengthwise-posterior"} and all(v["us_per_step_mean"] > 0 for v in data.values())


def test_the_mixture_weight_is_the_one_under_which_the_lengths_were_likeliest():
    from serving.policy.priors import mixture_weight

    assert mixture_weight([(0.9, 0.1)] * 50) > 0.99        # the request's own belief always had the length
    assert mixture_weight([(0.0, 0.2)] * 50) < 0.01        # it never had it: the prior alone
    half = mixture_weight([(0.9, 0.1)] * 25 + [(0.0, 0.3)] * 25)
    assert 0.3 < half < 0.7


@pytest.mark.parametrize("kind", ["jct", "ttft+tpot", "normalised"])
def test_each_posterior_policy_reports_its_own_name(kind):
    cfg = PolicyConfig(slo_kind=kind)
    for name in ("lengthwise-posterior", "lengthwise-own", "lengthwise-prior", "lengthwise-gittins"):
        assert make_policy(name, cfg, 64).name == name
