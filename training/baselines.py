"""Cheap reference predictors every report is measured against.

- ``global-median``: always the training median (what a length-blind scheduler assumes).
- ``prompt-length-bin``: mean training length conditioned on prompt-length bins (Aladdin's predictor).
- ``tfidf-logreg``: TF-IDF 1–2-grams + logistic regression (a strong classical text baseline).
Each returns :class:`~training.evaluate.Predictions` so the metrics code treats them like our model.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from predictor.buckets import BucketScheme
from training.evaluate import Predictions


def _repeat_distribution(n_rows: int, dist: np.ndarray) -> np.ndarray:
    return np.tile(dist / dist.sum(), (n_rows, 1))


class GlobalMedian:
    name = "global-median"

    def fit(self, train_len: np.ndarray, scheme: BucketScheme, **_) -> GlobalMedian:
        self.scheme = scheme
        self.median = float(np.median(train_len))
        self.dist = np.bincount(scheme.assign(train_len), minlength=scheme.n).astype(np.float64) + 1e-3
        return self

    def predict(self, n: int, **_) -> Predictions:
        probs = _repeat_distribution(n, self.dist)
        point = np.full(n, self.median)
        return Predictions(probs, point, self.scheme.assign(point))


class PromptLengthBin:
    """Mean response length given the prompt length's quantile bin (Aladdin §4.1)."""

    name = "prompt-length-bin"

    def __init__(self, bins: int = 20):
        self.bins = bins

    def fit(self, train_len: np.ndarray, scheme: BucketScheme, prompt_len: np.ndarray, **_) -> PromptLengthBin:
        self.scheme = scheme
        self.edges = np.unique(np.quantile(prompt_len, np.linspace(0, 1, self.bins + 1))[1:-1])
        which = np.searchsorted(self.edges, prompt_len, side="right")
        k = len(self.edges) + 1
        self.mean = np.array([train_len[which == b].mean() if np.any(which == b) else train_len.mean() for b in range(k)])
        self.dist = np.stack([np.bincount(scheme.assign(train_len[which == b]), minlength=scheme.n) + 1e-3 for b in range(k)])
        return self

    def predict(self, n: int, prompt_len: np.ndarray, **_) -> Predictions:
        which = np.searchsorted(self.edges, prompt_len, side="right")
        probs = self.dist[which] / self.dist[which].sum(1, keepdims=True)
        point = self.mean[which]
        return Predictions(probs, point, self.scheme.assign(point))


class TfidfLogReg:
    name = "tfidf-logreg"

    def fit(self, train_len: np.ndarray, scheme: BucketScheme, texts: Sequence[str], **_) -> TfidfLogReg:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        self.scheme = scheme
        self.vec = TfidfVectorizer(ngram_range=(1, 2), max_features=50_000, sublinear_tf=True, min_df=2)
        x = self.vec.fit_transform(texts)
        y = scheme.assign(train_len)
        self.clf = LogisticRegression(max_iter=300, C=2.0)
        self.clf.fit(x, y)
        return self

    def predict(self, n: int, texts: Sequence[str], **_) -> Predictions:
        p = self.clf.predict_proba(self.vec.transform(texts))
        probs = np.zeros((n, self.scheme.n))
        probs[:, self.clf.classes_] = p
        return Predictions(probs, self.scheme.expected(probs))


BASELINES = (GlobalMedian, PromptLengthBin, TfidfLogReg)
