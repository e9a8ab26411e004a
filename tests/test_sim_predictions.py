"""The ``tfidf`` predictor: a trained TF-IDF bucket classifier cross-fitted on the workload's own requests."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from serving.sim.predictions import (
    TFIDF_SCHEME,
    CrossFitTfidf,
    PointOnly,
    PredictorSpecError,
    check_spec,
    make_predictor,
    names_a_model,
)
from serving.sim.workload import TraceRequest, WorkloadError, load_workload
from tests.datafiles import need_data
from training.evaluate import kendall_tau

SHAREGPT = "prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"
ALPACA = "prompts/alpaca_eval_model_outputs.62models.jsonl.xz"
SERVICES = ("alpaca-7b_concise", "Meta-Llama-3-8B-Instruct")  # mean answers about 80 and 440 GPT-2 tokens


@pytest.fixture(scope="module")
def sharegpt(data):
    """600 ShareGPT requests, about a third of them later turns (fewer rank too noisily to test on)."""
    return load_workload(need_data(SHAREGPT), rate=2.0, max_requests=600, max_prompt_tokens=2048, seed=1).requests


@pytest.fixture(scope="module")
def services(data):
    """Two AlpacaEval generators answering the same instructions, shuffled together (one service each)."""
    return load_workload(need_data(ALPACA), rate=1.0, max_requests=400, generator=",".join(SERVICES)).requests


@pytest.fixture(scope="module")
def fitted(sharegpt):
    """``tfidf`` and its predictions of :func:`sharegpt`."""
    p = make_predictor("tfidf")
    return p, p.predict(sharegpt)


def _truth(requests: list[TraceRequest]) -> np.ndarray:
    return np.array([r.output_tokens for r in requests], dtype=np.float64)


def _same(a, b) -> bool:
    return a.length == pytest.approx(b.length, abs=1e-9) and np.allclose(a.probs, b.probs, atol=1e-12)


def test_predictions_are_bucket_distributions(sharegpt, fitted):
    p, preds = fitted
    assert len(preds) == len(sharegpt)
    upper = TFIDF_SCHEME.upper()
    for pred in preds:
        assert pred.edges == TFIDF_SCHEME.edges[1:]
        assert len(pred.probs) == TFIDF_SCHEME.n and sum(pred.probs) == pytest.approx(1.0)
        assert min(pred.probs) >= 0.0 and pred.length >= 1.0
        assert pred.bucket == int(np.argmax(pred.probs)) and pred.hi == upper[pred.bucket]
    assert 0.0 < p.achieved <= 1.0
    assert set(p.quality) == {"all"}


def test_a_request_is_never_predicted_by_a_model_that_saw_its_length(sharegpt, fitted):
    base = fitted[1]
    for i in (0, 1):  # whichever folds they fall in
        changed = [replace(r, output_tokens=60_000) if k == i else r for k, r in enumerate(sharegpt)]
        again = make_predictor("tfidf").predict(changed)
        assert _same(again[i], base[i]), f"request {i}'s prediction moved with its own length"
        # the absurd length does reach the other fold's models, so the check above can fail
        assert not all(_same(a, b) for a, b in zip(again, base))


def test_held_out_predictions_rank(sharegpt, fitted):
    p, preds = fitted
    lengths = np.array([x.length for x in preds])
    tau = kendall_tau(lengths, _truth(sharegpt))
    assert tau > 0.1
    assert p.quality["all"] == pytest.approx(tau)


def test_each_service_is_fitted_on_its_own_rows(services):
    names = np.array([r.service for r in services])
    assert set(names) == set(SERVICES)
    p = make_predictor("tfidf")
    base = p.predict(services)
    assert set(p.quality) == set(SERVICES) and all(tau > 0 for tau in p.quality.values())
    assert not any(f["pooled"] for f in p.fits)
    # every answer of the second service made absurd: the first service's predictions do not move
    other = [replace(r, output_tokens=5_000) if r.service == SERVICES[1] else r for r in services]
    again = make_predictor("tfidf").predict(other)
    for k in np.flatnonzero(names == SERVICES[0]):
        assert _same(again[k], base[k])
    assert not all(_same(again[k], base[k]) for k in np.flatnonzero(names == SERVICES[1]))
    # and a service's expected lengths follow its own lengths: the long-answer service is predicted longer
    lengths = np.array([x.length for x in base])
    assert lengths[names == SERVICES[1]].mean() > 2 * lengths[names == SERVICES[0]].mean()


def test_more_folds_and_quantile(sharegpt):
    p = make_predictor("tfidf:3", quantile=0.9)
    assert isinstance(p, CrossFitTfidf) and p.folds == 3 and p.spec == "tfidf:3"
    padded = np.array([x.length for x in p.predict(sharegpt[:120])])
    mean = np.array([x.length for x in make_predictor("tfidf:3").predict(sharegpt[:120])])
    assert np.mean(padded >= mean) > 0.9


def test_repredicts_from_its_distribution(sharegpt, fitted):
    p, preds = fitted
    for r, pred in zip(sharegpt[:5], preds):
        assert p.repredict(r, 700, pred) == pred.remaining_after(700)


def test_needs_text_and_other_requests():
    bare = [TraceRequest(rid=i, arrival=0.0, prompt_tokens=10, output_tokens=5 + i) for i in range(10)]
    with pytest.raises(WorkloadError, match="needs prompt text"):
        make_predictor("tfidf").predict(bare)
    alone = [TraceRequest(rid=0, arrival=0.0, prompt_tokens=3, output_tokens=5, turns=(("user", "hi there"),))]
    with pytest.raises(WorkloadError, match="learns each request's length from the others'"):
        make_predictor("tfidf").predict(alone)
    assert make_predictor("tfidf").predict([]) == []


def test_specs():
    assert make_predictor("tfidf").spec == "tfidf" and make_predictor("TFIDF:2").spec == "tfidf"
    assert isinstance(make_predictor("point:tfidf:4"), PointOnly)
    assert not names_a_model("tfidf") and not names_a_model("point:tfidf")
    check_spec("tfidf:5")
    for bad in ("tfidf:1", "tfidf:2.5", "tfidf:x", "tfidf:inf"):
        with pytest.raises(PredictorSpecError):
            check_spec(bad)
    with pytest.raises(PredictorSpecError, match="quantile"):
        make_predictor("noise:0.5", quantile=0.9)
