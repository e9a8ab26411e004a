"""The benches of refinements: the served model's own p(EOS) as a ranking of the remaining length, and the cost bench's
arithmetic and its refusals (its run, engines and all, is in tests/test_gateway_refine.py, in make test-slow)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving.bench.predictor.eos_signal import eos_log_probs, score
from serving.bench.refine_cost import _delay_quantiles, main, summarize
from training.remaining import Answer


def _answers(lengths: list[int]) -> list[Answer]:
    return [Answer(f"g{i}", (("user", "hi"),), tuple(range(3, 3 + n)), False, "m") for i, n in enumerate(lengths)]


def test_a_signal_that_rises_towards_each_end_ranks_the_remaining_length():
    lengths = [40 + 13 * i for i in range(30)]
    answers = _answers(lengths)
    # log p(EOS) climbs as the end nears: the last positions before k say how far it is
    logp = [np.array([-0.1 * (n - t) for t in range(n)]) for n in lengths]
    rows = {r["k"]: r for r in score(answers, logp, ks=(16, 64), resamples=200)}
    assert rows[16]["running"] == 30 and rows[16]["tau_eos"] == pytest.approx(1.0)
    assert rows[64]["running"] == len([n for n in lengths if n > 64]) and rows[64]["ci"][0] > 0.9
    flat = [np.full(n, -5.0) for n in lengths]  # a model that never says: no ranking (all tied)
    assert np.isnan(score(answers, flat, ks=(16,), resamples=50)[0]["tau_eos"])


def test_the_served_model_reads_each_answers_end_probability_at_each_position(smollm2):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    ids = tuple(tok.encode("Paris is the capital of France.", add_special_tokens=False).ids) + (2,)  # <|im_end|>
    answers = [Answer("g", (("user", "What is the capital of France?"),), ids, False, "SmolLM2-135M-Instruct")]
    (logp,) = eos_log_probs(smollm2, answers, progress=False)
    assert logp.shape == (len(ids),) and np.all(logp <= 0)
    assert logp[-1] > logp[:3].max()  # after the sentence the model expects its end far more than at its start


def test_the_cost_summary_and_the_delay_quantiles():
    arms = [{"arm": arm, "requests": 10, "gateway_cpu_ms_per_request": g, "sidecar_cpu_ms_per_request": s,
             "refinements": {"delivered": d} if d else {}, "lost_or_wrong": 0}
            for arm, g, s, d in (("off", 10.0, 5.0, 0), ("on", 11.0, 8.0, 20), ("on", 11.0, 8.0, 20), ("off", 10.0, 5.0, 0))]
    s = summarize(arms)
    assert s["gateway_cpu_ms_per_request"]["ratio"] == pytest.approx(1.1)
    assert s["sidecar_cpu_ms_per_request"]["extra"] == pytest.approx(3.0)
    assert s["sidecar_cpu_ms_per_refinement"] == pytest.approx(1.5)  # 3 ms x 10 requests over 20 refinements
    from prometheus_client.parser import text_string_to_metric_families

    text = ('# TYPE d histogram\nd_bucket{le="0.1"} 50\nd_bucket{le="0.2"} 100\nd_bucket{le="+Inf"} 100\n'
            "d_count 100\nd_sum 10\n")
    fams = {"lengthwise_gateway_refinement_delay_seconds": next(iter(text_string_to_metric_families(text))).samples}
    q = _delay_quantiles(fams)
    assert q["p50"] == pytest.approx(0.1) and q["p95"] == pytest.approx(0.19)


def test_the_cost_bench_refuses_what_it_cannot_run_in_one_line(tmp_path, capsys):
    assert main(["--package", str(tmp_path), "--json", str(tmp_path / "o.json")]) == 2
    assert "no meta.json there" in capsys.readouterr().err
    (tmp_path / "meta.json").write_text(json.dumps({}))
    assert main(["--package", str(tmp_path), "--rate", "-1"]) == 2
    assert "--rate" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()
