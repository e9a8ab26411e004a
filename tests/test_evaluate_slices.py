"""Offline metrics per slice: pairwise ranking accuracy, the first-turn / later-turn masks, and the recommendation."""

import numpy as np
import pytest

from predictor.buckets import BucketScheme
from training.data import Example, Turn
from training.evaluate import (
    Predictions,
    accuracy_at_widths,
    compute_metrics,
    paired_gap,
    pairwise_accuracy,
    recommend,
    slice_masks,
    sliced_metrics,
)

pytestmark = pytest.mark.unit
SCHEME = BucketScheme.equal_width(100, 1000)


def _first(text: str = "q") -> Example:
    return Example("g", (Turn("system", "be brief"), Turn("user", text)), response_tokens=10)


def _later() -> Example:
    return Example("g", (Turn("user", "q"), Turn("assistant", "a"), Turn("user", "more")), response_tokens=10)


def test_pairwise_accuracy_counts_ordered_pairs_and_ties_half():
    lengths = np.array([10, 20, 30, 30])
    assert pairwise_accuracy(np.array([1, 2, 3, 4]), lengths) == 1.0  # the (30, 30) pair is left out
    assert pairwise_accuracy(np.array([4, 3, 2, 1]), lengths) == 0.0
    assert pairwise_accuracy(np.full(4, 7.0), lengths) == 0.5
    # pairs (10,20) right, (10,30) right twice, (20,30) wrong once and tied once: (3 + 0.5) / 5
    assert pairwise_accuracy(np.array([1, 5, 3, 5]), lengths) == pytest.approx(3.5 / 5)
    assert np.isnan(pairwise_accuracy(np.array([1, 2]), np.array([5, 5])))


def test_pairwise_accuracy_samples_pairs_deterministically_when_there_are_many():
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 1000, 3000).astype(float)
    point = lengths + rng.normal(0, 300, 3000)
    exact = pairwise_accuracy(point, lengths, max_pairs=10**8)
    sampled = pairwise_accuracy(point, lengths, max_pairs=50_000)
    assert sampled == pairwise_accuracy(point, lengths, max_pairs=50_000)  # the same pairs every time
    assert sampled != exact and abs(sampled - exact) < 0.01


def test_slices_split_first_turns_from_later_ones_and_leave_out_an_empty_slice():
    examples = [_first(), _later(), _first(), _later(), _later()]
    masks = slice_masks(examples)
    assert masks["first_turn"].tolist() == [True, False, True, False, False]
    assert masks["later_turns"].tolist() == [False, True, False, True, True]
    assert masks["all"].all()
    assert set(slice_masks([_first(), _first()])) == {"first_turn", "all"}


def test_sliced_metrics_score_each_slice_on_its_own_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 1000, 200).astype(float)
    first = np.arange(200) < 80
    point = np.where(first, lengths, lengths[::-1])  # right on first turns, scrambled on later ones
    pred = Predictions(np.eye(SCHEME.n)[SCHEME.assign(point)], point)
    masks = {"first_turn": first, "later_turns": ~first, "all": np.ones(200, dtype=bool)}
    got = sliced_metrics(pred, lengths, SCHEME, masks)
    assert got["all"] == compute_metrics(pred, lengths, SCHEME)
    assert got["first_turn"]["n"] == 80 and got["first_turn"]["pairwise_accuracy"] == 1.0
    assert got["first_turn"]["mae_tokens"] == 0.0 and got["later_turns"]["mae_tokens"] > 100
    assert got["later_turns"]["pairwise_accuracy"] < 0.7


def test_recommend_takes_the_best_ranking_and_counts_nan_as_worst():
    block = {"lengthwise": {"pairwise_accuracy": 0.61}, "global-median": {"pairwise_accuracy": float("nan")},
             "tfidf-logreg": {"pairwise_accuracy": 0.64}}
    assert recommend(block) == "tfidf-logreg"
    assert recommend(block, by="missing") == "lengthwise"  # nothing to compare: the model, named first
    block["lengthwise"]["pairwise_accuracy"] = 0.64
    assert recommend(block) == "lengthwise"  # a tie keeps what is served


def test_accuracy_at_widths_leaves_out_a_width_at_or_above_the_cap():
    scheme = BucketScheme.equal_width(64, 256)
    lengths = np.array([10.0, 100.0, 250.0])
    pred = Predictions(np.eye(scheme.n)[scheme.assign(lengths)], lengths)
    assert set(accuracy_at_widths(pred, scheme, lengths)) == {"100", "200"}


def _sampled(rng: np.random.Generator, means: np.ndarray, noise: float) -> list[Example]:
    """Two samples per prompt: the prompt's mean length plus independent Gaussian noise of sd ``noise``."""
    out = []
    for i, m in enumerate(means):
        turns = (Turn("user", f"prompt {i}"),)
        out += [Example(f"g{i}", turns, response_tokens=int(max(1, m + noise * rng.standard_normal()))) for _ in range(2)]
    return out


def test_between_samples_measures_the_served_models_own_noise():
    from training.evaluate import between_samples

    rng = np.random.default_rng(0)
    means = rng.uniform(50, 950, 400)
    exact = between_samples(_sampled(rng, means, 0.0))
    assert exact["prompts"] == 400 and exact["kendall_tau"] == pytest.approx(1.0) and exact["ideal_tau_estimate"] == 1.0
    noisy = between_samples(_sampled(rng, means, 300.0))  # rho = var(mean) / (var(mean) + 300^2) = 67500 / 157500
    assert 0.2 < noisy["kendall_tau"] < 0.4 and 0.55 < noisy["pairwise_accuracy"] < 0.75
    # a predictor of the mean itself, scored against sample 1, lands near the estimate (the model holds by construction)
    sample1 = np.array([e.response_tokens for e in _sampled(rng, means, 300.0)][1::2], dtype=float)
    from scipy.stats import kendalltau

    assert noisy["ideal_tau_estimate"] == pytest.approx(kendalltau(means, sample1).statistic, abs=0.06)
    assert noisy["kendall_tau"] < noisy["ideal_tau_estimate"]
    assert between_samples(_sampled(rng, means[:5], 10.0)) is None  # too few prompts to say
    assert between_samples([e for e in _sampled(rng, means, 10.0)][::2]) is None  # one sample per prompt


def _noisy_ranker(rng: np.random.Generator, lengths: np.ndarray, noise: float) -> tuple[np.ndarray, np.ndarray]:
    point = np.clip(lengths + rng.normal(0, noise, len(lengths)), 0, 999)
    return point, SCHEME.assign(point)


def test_paired_gap_is_zero_for_one_predictor_and_its_interval_narrows_with_more_rows():
    rng = np.random.default_rng(1)
    widths = []
    for n in (200, 3200):
        lengths = rng.uniform(0, 1000, n)
        good, bad = _noisy_ranker(rng, lengths, 120), _noisy_ranker(rng, lengths, 400)
        same = paired_gap(*good, *good, lengths, SCHEME, resamples=300)
        assert same["top1"] == [0.0, 0.0, 0.0] and same["tau"] == [0.0, 0.0, 0.0]
        gap = paired_gap(*bad, *good, lengths, SCHEME, resamples=300)
        for key in ("top1", "tau"):
            g, lo, hi = gap[key]
            assert lo <= g <= hi < 0, (n, key, gap)  # the noisier ranker is worse, and the rows can tell
        widths.append(gap["tau"][2] - gap["tau"][1])
    # sixteen times the rows, about a quarter of the width (1/sqrt(n))
    assert widths[1] < 0.4 * widths[0], widths
