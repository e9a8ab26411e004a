"""Offline quality metrics of a length predictor, the same set for our model and every baseline.

Bucket accuracy alone can hide a useless ranking (vllm-ltr reports 97% accuracy with Kendall tau 0.21),
so we report what a scheduler actually consumes: the ranking (Kendall tau), the point error (MAE),
its sign (bias: Aladdin warns fine-tuned predictors are biased), how often the padded reservation is
overrun (under-prediction rate), and whether probabilities mean what they say (ECE).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.stats import kendalltau

from predictor.buckets import BucketScheme


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


def compute_metrics(pred: Predictions, lengths: np.ndarray, scheme: BucketScheme, padding: float = 0.15) -> dict:
    """All offline metrics of one predictor on one labelled set."""
    lengths = np.asarray(lengths, dtype=np.float64)
    truth = scheme.assign(lengths)
    bucket = pred.bucket if pred.bucket is not None else pred.probs.argmax(1)
    err = pred.point - lengths
    tau = kendalltau(pred.point, lengths).statistic if np.ptp(pred.point) > 0 else 0.0
    return {
        "n": len(lengths),
        "accuracy": float((bucket == truth).mean()),
        "accuracy_within_1": float((np.abs(bucket - truth) <= 1).mean()),
        "mae_tokens": float(np.abs(err).mean()),
        "bias_tokens": float(err.mean()),
        "kendall_tau": float(0.0 if np.isnan(tau) else tau),
        "under_prediction_rate": float((lengths > pred.point * (1.0 + padding)).mean()),
        "padding": padding,
        "ece": expected_calibration_error(pred.probs, truth),
    }


def accuracy_at_widths(pred: Predictions, scheme: BucketScheme, lengths: np.ndarray, widths=(100, 200, 400)) -> dict:
    """Top-1 at equal-width buckets (TetriInfer's 100/200/400), from merged probabilities when the
    model's edges nest, else from the bucket of the point estimate (the method is reported)."""
    out = {}
    for w in widths:
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
