"""Offline quality metrics of a length predictor, the same set for our model and every baseline.

Bucket accuracy alone can hide a useless ranking (vllm-ltr reports 97% accuracy with Kendall tau 0.21),
so we report what a scheduler actually consumes: the ranking (Kendall tau), the point error (MAE),
its sign (bias: Aladdin warns fine-tuned predictors are biased), how often the padded reservation is
overrun (under-prediction rate), and whether probabilities mean what they say (ECE). The pairwise ranking accuracy
is the share of request pairs an SJF-like queue would order right by the expected length: what ordering by the
predictor is worth, in the unit a scheduler feels.

First turns and later turns are reported apart (:data:`SLICES`): a later turn has the previous answer to go by, a
first turn has nothing but the request, and one average over both hides which of the two a predictor is good at.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import kendalltau

from predictor.buckets import BucketScheme
from training.data.example import Example
from training.data.served import group_samples

# The slices every offline report is broken into, in report order.
SLICES = ("first_turn", "later_turns", "all")


@dataclass
class Predictions:
    """What any predictor produces for a set of prompts."""

    probs: np.ndarray  # [n, n_buckets]
    point: np.ndarray  # [n] point estimate of the response length in tokens
    bucket: np.ndarray | None = None  # [n] predicted bucket; argmax of probs when None


def expected_calibration_error(probs: np.ndarray, truth: np.ndarray, bins: int = 15) -> float:
    """Top-1 ECE: |accuracy - confidence| averaged over confidence bins, weighted by bin size."""
    conf = probs.max(1)
    correct = (probs.argmax(1) == truth).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1]), 0, bins - 1)
    ece = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            ece += sel.mean() * abs(correct[sel].mean() - conf[sel].mean())
    return float(ece)


def reliability(probs: np.ndarray, truth: np.ndarray, bins: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean confidence, accuracy, count) per confidence bin, for the reliability diagram."""
    conf = probs.max(1)
    correct = (probs.argmax(1) == truth).astype(np.float64)
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1]), 0, bins - 1)
    mc, acc, cnt = np.zeros(bins), np.zeros(bins), np.zeros(bins, dtype=np.int64)
    for b in range(bins):
        sel = which == b
        cnt[b] = sel.sum()
        if cnt[b]:
            mc[b], acc[b] = conf[sel].mean(), correct[sel].mean()
    return mc, acc, cnt


def merge_probs(probs: np.ndarray, fine: BucketScheme, coarse: BucketScheme) -> np.ndarray | None:
    """Sum fine-bucket probabilities into coarse buckets when every coarse edge is a fine edge."""
    if not set(coarse.edges) <= set(fine.edges):
        return None
    target = coarse.assign(np.array(fine.edges))
    out = np.zeros((probs.shape[0], coarse.n))
    np.add.at(out.T, target, probs.T)
    return out


def slice_masks(examples: Sequence[Example]) -> dict[str, np.ndarray]:
    """Boolean row masks of :data:`SLICES` over ``examples``; a slice with no rows is left out."""
    first = np.array([e.first_turn for e in examples], dtype=bool)
    masks = {"first_turn": first, "later_turns": ~first, "all": np.ones(len(first), dtype=bool)}
    return {k: m for k, m in masks.items() if m.any()}


def pairwise_accuracy(point: np.ndarray, lengths: np.ndarray, max_pairs: int = 200_000, seed: int = 0) -> float:
    """Share of pairs with different true lengths that ``point`` orders the same way; a tie in ``point`` counts half
    (a queue that cannot tell two requests apart orders them by a coin toss). All pairs when there are at most
    ``max_pairs``, else that many pairs drawn with ``seed`` (the same pairs for every predictor on the same rows).
    NaN when no pair differs in length."""
    point, lengths = np.asarray(point, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
    n = len(lengths)
    if n * (n - 1) // 2 <= max_pairs:
        i, j = np.triu_indices(n, k=1)
    else:
        rng = np.random.default_rng(seed)
        i, j = rng.integers(0, n, max_pairs), rng.integers(0, n, max_pairs)
    keep = lengths[i] != lengths[j]
    if not keep.any():
        return float("nan")
    agree = np.sign(point[i[keep]] - point[j[keep]]) * np.sign(lengths[i[keep]] - lengths[j[keep]])
    return float(((agree > 0) + 0.5 * (agree == 0)).mean())


def between_samples(examples: Sequence[Example], min_prompts: int = 10) -> dict | None:
    """How well one sampled answer's length ranks another's of the same prompt: the served model's own noise, and so a
    bound on the ranking any predictor can score against single samples.

    With K >= 2 samples per prompt (``lengthwise relabel --samples K``) the first two samples of each prompt give
    ``kendall_tau`` and ``pairwise_accuracy`` of sample 0 as a predictor of sample 1. A predictor of each prompt's true
    mean does better than another sample, but not without bound: if lengths are the prompt's mean plus independent
    noise, two samples correlate by the mean's share of the variance (rho) and the mean correlates with a sample by
    sqrt(rho); ``ideal_tau_estimate`` converts through the Gaussian relation r = sin(pi tau / 2) (Greiner). It is an
    estimate under that model, not a measurement. None with fewer than ``min_prompts`` prompts of two samples or more.
    """
    pairs = [(s[0][0], s[1][0]) for _, s in group_samples(examples) if len(s) >= 2]
    if len(pairs) < min_prompts:
        return None
    a, b = (np.array(x, dtype=np.float64) for x in zip(*pairs))
    tau = kendall_tau(a, b)
    rho = max(math.sin(math.pi * tau / 2), 0.0)
    return {"prompts": len(pairs), "kendall_tau": tau, "pairwise_accuracy": pairwise_accuracy(a, b),
            "ideal_tau_estimate": 2 / math.pi * math.asin(math.sqrt(rho))}


def censored_tau(expected: np.ndarray, actual: np.ndarray, censored: np.ndarray) -> tuple[float | None, int]:
    """Kendall's tau over the pairs whose order of true lengths is known: both finished with different lengths, or
    one capped at a count above where the other finished (its true length is at least that). A pair is concordant
    when the expected lengths order it the same way, discordant when the other way, neither on a tie in the
    prediction; tau = (concordant - discordant) / known pairs (Harrell's C as a tau). Returns (tau, known pairs)."""
    e, a, c = (np.asarray(x) for x in (expected, actual, censored.astype(bool)))
    i, j = np.triu_indices(len(a), k=1)
    longer_i = (a[i] > a[j]) & ~c[j]  # i's true length is known to exceed j's
    longer_j = (a[j] > a[i]) & ~c[i]
    known = longer_i | longer_j
    if not known.any():
        return None, 0
    sign = np.sign(e[i] - e[j]) * np.where(longer_i, 1, -1)
    return float(sign[known].sum() / known.sum()), int(known.sum())


def kendall_tau(point: np.ndarray, lengths: np.ndarray) -> float:
    """Kendall tau of predicted against true lengths; 0 where it is undefined (a constant prediction ranks nothing)."""
    tau = kendalltau(point, lengths).statistic if np.ptp(point) > 0 else 0.0
    return float(0.0 if np.isnan(tau) else tau)


def compute_metrics(pred: Predictions, lengths: np.ndarray, scheme: BucketScheme, padding: float = 0.15) -> dict:
    """All offline metrics of one predictor on one labelled set."""
    lengths = np.asarray(lengths, dtype=np.float64)
    truth = scheme.assign(lengths)
    bucket = pred.bucket if pred.bucket is not None else pred.probs.argmax(1)
    err = pred.point - lengths
    return {
        "n": len(lengths),
        "accuracy": float((bucket == truth).mean()),
        "accuracy_within_1": float((np.abs(bucket - truth) <= 1).mean()),
        "mae_tokens": float(np.abs(err).mean()),
        "bias_tokens": float(err.mean()),
        "kendall_tau": kendall_tau(pred.point, lengths),
        "pairwise_accuracy": pairwise_accuracy(pred.point, lengths),
        "under_prediction_rate": float((lengths > pred.point * (1.0 + padding)).mean()),
        "padding": padding,
        "ece": expected_calibration_error(pred.probs, truth),
    }


def paired_gap(point_a: np.ndarray, bucket_a: np.ndarray, point_b: np.ndarray, bucket_b: np.ndarray,
               lengths: np.ndarray, scheme: BucketScheme, resamples: int = 1000, seed: int = 0) -> dict:
    """Top-1 and Kendall tau of predictor a minus predictor b on the same rows, each ``[gap, low, high]`` with the 95%
    interval of a paired bootstrap (rows resampled with replacement, both predictors on the same draw).

    Why: a variant is kept when it is within an agreed loss of the full model (say 1 point of top-1, 0.02 of tau); on
    a test split of a few hundred rows the gap itself moves by more than that from one draw of rows to the next, and
    the interval says whether the rows can tell the two apart at all."""
    lengths = np.asarray(lengths, dtype=np.float64)
    truth = scheme.assign(lengths)
    hit_a, hit_b = np.asarray(bucket_a) == truth, np.asarray(bucket_b) == truth
    point_a, point_b = np.asarray(point_a, dtype=np.float64), np.asarray(point_b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(lengths), (resamples, len(lengths)))
    top1 = hit_a[draws].mean(1) - hit_b[draws].mean(1)
    taus = [kendall_tau(point_a[d], lengths[d]) - kendall_tau(point_b[d], lengths[d]) for d in draws]
    return {"top1": [float(hit_a.mean() - hit_b.mean()), *map(float, np.percentile(top1, [2.5, 97.5]))],
            "tau": [kendall_tau(point_a, lengths) - kendall_tau(point_b, lengths), *map(float, np.percentile(taus, [2.5, 97.5]))],
            "resamples": resamples}


def take(pred: Predictions, mask: np.ndarray) -> Predictions:
    """The rows of ``pred`` where ``mask`` holds."""
    return Predictions(pred.probs[mask], pred.point[mask], None if pred.bucket is None else pred.bucket[mask])


def sliced_metrics(pred: Predictions, lengths: np.ndarray, scheme: BucketScheme, masks: dict[str, np.ndarray],
                   padding: float = 0.15) -> dict[str, dict]:
    """:func:`compute_metrics` on each slice of ``masks`` (:func:`slice_masks`)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return {name: compute_metrics(take(pred, m), lengths[m], scheme, padding) for name, m in masks.items()}


def accuracy_at_widths(pred: Predictions, scheme: BucketScheme, lengths: np.ndarray, widths=(100, 200, 400)) -> dict:
    """Top-1 at equal-width buckets (TetriInfer's 100/200/400), from merged probabilities when the
    model's edges nest, else from the bucket of the point estimate (the method is reported). A width that leaves
    fewer than two buckets under the cap is left out."""
    out = {}
    for w in (w for w in widths if w < scheme.max_tokens):
        coarse = BucketScheme.equal_width(w, scheme.max_tokens)
        # a predictor that names its bucket from a point estimate is judged by that estimate at every width
        merged = merge_probs(pred.probs, scheme, coarse) if pred.bucket is None else None
        truth = coarse.assign(lengths)
        if merged is not None:
            out[str(w)] = {"accuracy": float((merged.argmax(1) == truth).mean()), "method": "merged-probs"}
        else:
            out[str(w)] = {"accuracy": float((coarse.assign(pred.point) == truth).mean()), "method": "point-estimate"}
        out[str(w)]["majority"] = float(np.bincount(truth, minlength=coarse.n).max() / len(truth))
    return out


# What the per-slice recommendation compares: the scheduler orders requests by the expected length.
RECOMMEND_BY = "pairwise_accuracy"


def recommend(block: dict[str, dict], by: str = RECOMMEND_BY) -> str:
    """The predictor of ``block`` (``{name: metrics}``, one slice) with the highest ``by``; a NaN counts as the worst,
    a tie goes to the first named (the model comes first)."""
    def score(name: str) -> float:
        v = float(block[name].get(by, float("nan")))
        return -np.inf if np.isnan(v) else v

    return max(block, key=score)
