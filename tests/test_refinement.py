"""Refined predictions: the policy takes a sharper prediction for a running request, and the simulator hands one over
at each point with the quality measured for it."""

from __future__ import annotations

import json

import pytest

from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy
from serving.policy.request import Prediction, Request
from serving.sim.refinement import RefinedNoise, RefinementQuality
from serving.sim.workload import TraceRequest

pytestmark = pytest.mark.unit


def _trace(n: int = 300) -> list[TraceRequest]:
    return [TraceRequest(i, 0.05 * i, 50 + (37 * i) % 200, 20 + (173 * i) % 600) for i in range(n)]


def test_the_noise_of_each_point_ranks_what_is_left_at_the_measured_tau():
    reqs = _trace()
    quality = RefinementQuality({16: 0.5, 128: 0.8})
    ref = RefinedNoise(quality, reqs, seed=3)
    assert ref.achieved[16] == pytest.approx(0.5, abs=0.01) and ref.achieved[128] == pytest.approx(0.8, abs=0.01)
    long, short = reqs[1], next(r for r in reqs if r.output_tokens <= 128)
    p = ref.at(long, 128)
    assert p is not None and p.length > 128 and ref.at(short, 128) is None and ref.at(long, 64) is None
    assert ref.at(long, 128) == p  # drawn from a hash of the seed and the request: the same every time


def test_a_quality_table_is_read_from_the_remaining_length_report(tmp_path):
    path = tmp_path / "remaining.json"
    path.write_text(json.dumps({"rows": [{"k": 16, "tau_refined": 0.41}, {"k": 128, "tau_refined": 0.56}]}))
    q = RefinementQuality.from_file(path)
    assert q.taus == {16: 0.41, 128: 0.56} and q.points == (16, 128)


@pytest.mark.parametrize("name", ["lengthwise", "lengthwise-posterior", "sarathi"])
def test_a_refined_prediction_replaces_the_first_and_a_late_one_is_dropped(name):
    policy = make_policy(name, PolicyConfig(), 64)
    req = Request(1, 0.0, 40, Prediction(100.0))
    policy.add(req, 0.0)
    req.generated = 64
    assert policy.refine(1, Prediction(400.0))
    assert req.pred.length == 400.0 and req.planned_rl == 400 and policy.stats["refinements"] == 1
    if name == "lengthwise-posterior":
        assert policy.belief_of(req).remaining(64) > 300  # the belief starts again from the refined prediction
    assert not policy.refine(2, Prediction(10.0))


def test_the_simulator_hands_each_due_refinement_to_the_policy_once():
    from serving.perf.latency import make_latency_model
    from serving.perf.slo import derive_slo
    from serving.sim.engine import simulate

    reqs = _trace(120)
    lat = make_latency_model("roofline", model="llama-3.1-8b", gpu="h200")
    slo = derive_slo(lat, [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs], 2.0)
    preds = [Prediction(200.0) for _ in reqs]
    ref = RefinedNoise(RefinementQuality({16: 0.9, 64: 0.9}), reqs)
    records: dict = {}
    m = simulate(reqs, preds, "lengthwise", PolicyConfig(), 200, lat, slo, refinements=ref, records=records)
    assert m.requests_completed == len(reqs)
    due = sum(r.output_tokens > 16 for r in reqs) + sum(r.output_tokens > 64 for r in reqs)
    plain = simulate(reqs, preds, "lengthwise", PolicyConfig(), 200, lat, slo)
    assert m.extra["refinements"] == due and "refinements" not in plain.extra
    assert (m.jct_mean_s, m.preemptions) != (plain.jct_mean_s, plain.preemptions) or m.jct_p99_s != plain.jct_p99_s


def test_bench_sim_runs_a_policy_beside_itself_refined_and_refuses_refinement_without_a_measured_table(tmp_path, capsys):
    from serving.cli import main
    from tests.datafiles import need_data

    need_data("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz")
    quality = tmp_path / "remaining.json"
    quality.write_text(json.dumps({"rows": [{"k": 16, "tau_refined": 0.5}, {"k": 128, "tau_refined": 0.7}]}))
    out = tmp_path / "sim.json"
    assert main(["bench", "sim", "--scenario", "ecoserve-paper", "--max-requests", "60", "--policies",
                 "lengthwise,lengthwise+refined", "--refine", str(quality), "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert {"lengthwise", "lengthwise+refined"} <= set(d)
    refined = [c for c in d["lengthwise+refined"]["curve"]]
    assert refined and all(c["requests_total"] == 60 for c in refined)
    assert main(["bench", "sim", "--policies", "lengthwise+refined", "--json", str(tmp_path / "x.json")]) == 2
    assert "--refine" in capsys.readouterr().err
