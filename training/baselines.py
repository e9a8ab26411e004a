"""Cheap reference predictors every report is measured against, each as strong as it can cheaply be on each slice.

- ``global-median``: always the training median (what a length-blind scheduler assumes).
- ``prompt-length-bin``: mean training length conditioned on prompt-length bins (Aladdin's predictor).
- ``tfidf-logreg``: TF-IDF 1–2-grams + logistic regression (a strong classical text baseline), with the length hints
  the LoRA model reads (the latest request's and the previous answer's length in words) as extra features, and its
  regularisation C chosen on the validation split.

:func:`fit_sliced` fits a baseline once per slice (first turns on first turns only, later turns on later turns only)
and routes each test row to its slice's model, so a baseline is never judged on a mixture it was not fitted to.
Each returns :class:`~training.evaluate.Predictions` so the metrics code treats them like our model.

What a baseline reads of a prompt (its text, its length hints) is computed by predictor.features, and a fitted
``tfidf-logreg`` or ``global-median`` predicts through its :mod:`predictor.slices` model (:meth:`TfidfLogReg.servable`):
the object a model package ships for a slice this baseline wins, so what serves is what the report measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from predictor.buckets import BucketScheme
from predictor.features import baseline_text, length_hints, tfidf_matrix
from predictor.slices import ConstantBuckets, TfidfBuckets
from training.data.example import Example
from training.data.labels import censored_of, labels_of
from training.evaluate import Predictions, pairwise_accuracy

# Regularisation strengths tried for tfidf-logreg, on the validation split (a small grid: each fit costs seconds).
C_GRID = (0.1, 0.5, 2.0, 8.0)


@dataclass
class Rows:
    """What the baselines see of a set of examples: text, prompt length, length hints, slice, and the labels."""

    texts: list[str]         # the last three turns, each cut to its last 4,000 characters
    prompt_len: np.ndarray   # [n] the whole prompt in target-model tokens (what Aladdin conditions on)
    hints: np.ndarray        # [n, 2] words in the latest request and in the previous answer (0: none)
    first: np.ndarray        # [n] True for a conversation's first turn
    lengths: np.ndarray      # [n] response tokens (the labels)

    def __len__(self) -> int:
        return len(self.lengths)

    def take(self, mask: np.ndarray) -> Rows:
        return Rows([t for t, m in zip(self.texts, mask) if m], self.prompt_len[mask], self.hints[mask], self.first[mask],
                    self.lengths[mask])


def rows_of(examples: Sequence[Example], prompt_len: np.ndarray) -> Rows:
    """The :class:`Rows` of ``examples``; ``prompt_len`` counted by the caller with the target model's tokenizer."""
    turns = [[(t.role, t.text) for t in e.turns] for e in examples]
    texts = [baseline_text(t) for t in turns]
    hints = np.array([length_hints(t) for t in turns], dtype=np.float64)
    return Rows(texts, np.asarray(prompt_len, dtype=np.float64), hints.reshape(len(examples), 2),
                np.array([e.first_turn for e in examples], dtype=bool),
                np.array([e.response_tokens for e in examples], dtype=np.float64))


class Baseline(Protocol):
    name: str

    def fit(self, train: Rows, val: Rows, scheme: BucketScheme) -> Baseline: ...

    def predict(self, rows: Rows) -> Predictions: ...


class Servable(Protocol):
    """A baseline a model package can ship for a slice it wins (predictor.slices says which and why)."""

    name: str

    def servable(self) -> TfidfBuckets | ConstantBuckets: ...


def _repeat_distribution(n_rows: int, dist: np.ndarray) -> np.ndarray:
    return np.tile(dist / dist.sum(), (n_rows, 1))


class GlobalMedian:
    name = "global-median"

    def fit(self, train: Rows, val: Rows, scheme: BucketScheme) -> GlobalMedian:
        self.scheme = scheme
        self.median = float(np.median(train.lengths))
        self.dist = np.bincount(scheme.assign(train.lengths), minlength=scheme.n).astype(np.float64) + 1e-3
        self.info: dict[str, Any] = {}
        return self

    def predict(self, rows: Rows) -> Predictions:
        probs = _repeat_distribution(len(rows), self.dist)
        point = np.full(len(rows), self.median)
        return Predictions(probs, point, self.scheme.assign(point))

    def servable(self) -> ConstantBuckets:
        """The distribution as a routed predictor; served, its expected length comes from the bucket centers like every
        served prediction's (a constant either way, so its ranking is the one the report measured)."""
        return ConstantBuckets(self.dist.copy())


class PromptLengthBin:
    """Mean response length given the prompt length's quantile bin (Aladdin §4.1).

    Not servable from a model package: it conditions on the prompt's length in the target model's tokens, and a package
    carries the predictor backbone's tokenizer, not the target's (predictor.slices)."""

    name = "prompt-length-bin"

    def __init__(self, bins: int = 20):
        self.bins = bins

    def fit(self, train: Rows, val: Rows, scheme: BucketScheme) -> PromptLengthBin:
        self.scheme = scheme
        y, prompt_len = train.lengths, train.prompt_len
        self.edges = np.unique(np.quantile(prompt_len, np.linspace(0, 1, self.bins + 1))[1:-1])
        which = np.searchsorted(self.edges, prompt_len, side="right")
        k = len(self.edges) + 1
        self.mean = np.array([y[which == b].mean() if np.any(which == b) else y.mean() for b in range(k)])
        self.dist = np.stack([np.bincount(scheme.assign(y[which == b]), minlength=scheme.n) + 1e-3 for b in range(k)])
        self.info: dict[str, Any] = {}
        return self

    def predict(self, rows: Rows) -> Predictions:
        which = np.searchsorted(self.edges, rows.prompt_len, side="right")
        probs = self.dist[which] / self.dist[which].sum(1, keepdims=True)
        point = self.mean[which]
        return Predictions(probs, point, self.scheme.assign(point))


class TfidfLogReg:
    """TF-IDF of the last turns plus the length hints, multinomial logistic regression over the buckets.

    C is chosen on the validation rows by pairwise ranking accuracy of the expected length (the quantity the
    report's recommendation compares), from :data:`C_GRID`; the chosen C is in ``info``.
    """

    name = "tfidf-logreg"

    def __init__(self, c_grid: Sequence[float] = C_GRID):
        self.c_grid = tuple(c_grid)

    def fit(self, train: Rows, val: Rows, scheme: BucketScheme) -> TfidfLogReg:
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        self.scheme = scheme
        vec = TfidfVectorizer(ngram_range=(1, 2), max_features=50_000, sublinear_tf=True, min_df=2 if len(train) >= 50 else 1)
        x = tfidf_matrix(vec, train.texts, train.hints, fit=True)
        y = scheme.assign(train.lengths)
        classes = np.unique(y)
        self.model = TfidfBuckets(vec, None, classes, scheme.n)
        self.info = {"C": None, "val_pairwise_accuracy": None}
        if len(classes) < 2:  # one bucket in training: nothing to learn beyond it
            return self
        best = -1.0
        for c in self.c_grid if len(val) else (self.c_grid[len(self.c_grid) // 2],):
            candidate = TfidfBuckets(vec, LogisticRegression(max_iter=300, C=c).fit(x, y), classes, scheme.n)
            score = pairwise_accuracy(scheme.expected(candidate.probs_of(val.texts, val.hints)), val.lengths) \
                if len(val) else 0.0
            score = -1.0 if np.isnan(score) else score
            if score > best:
                best, self.model = score, candidate
                self.info = {"C": c, "val_pairwise_accuracy": score if len(val) else None}
        return self

    def predict(self, rows: Rows) -> Predictions:
        probs = self.model.probs_of(rows.texts, rows.hints)
        return Predictions(probs, self.scheme.expected(probs))

    def servable(self) -> TfidfBuckets:
        """The fitted vectorizer and classifier as a routed predictor (what :meth:`predict` itself runs)."""
        return self.model


def exact_labelled(examples: Sequence[Example], scheme: BucketScheme) -> list[Example]:
    """The examples whose bucket their label decides: what the baselines learn from, since they have no censored
    likelihood (a capped answer's bucket is known only when the cap is past the last edge)."""
    known = scheme.decided(labels_of(examples), censored_of(examples))
    return [e for e, k in zip(examples, known) if k]


BASELINES: tuple[Callable[[], Baseline], ...] = (GlobalMedian, PromptLengthBin, TfidfLogReg)


def fit_sliced(make: Callable[[], Baseline], scheme: BucketScheme, train: Rows, val: Rows, test: Rows,
               min_rows: int = 20, fitted: dict[str, Baseline] | None = None) -> tuple[Predictions, dict[str, dict]]:
    """A baseline fitted once per slice (first turns, later turns) on that slice's training and validation rows, each
    test row predicted by its own slice's model: ``(predictions over all test rows, {slice: the model's info})``.
    A slice with fewer than ``min_rows`` training rows is fitted on all of them (too few to fit alone). ``fitted``,
    when given, receives each slice's fitted baseline (what a model package ships for a slice the baseline wins)."""
    probs, point = np.zeros((len(test), scheme.n)), np.zeros(len(test))
    bucket = np.zeros(len(test), dtype=np.int64)
    has_bucket = True
    info: dict[str, dict] = {}
    for name, first in (("first_turn", True), ("later_turns", False)):
        rows = test.first == first
        if not rows.any():
            continue
        tr, va = train.first == first, val.first == first
        alone = tr.sum() >= min_rows
        b = make().fit(train.take(tr) if alone else train, val.take(va) if alone else val, scheme)
        if fitted is not None:
            fitted[name] = b
        p = b.predict(test.take(rows))
        probs[rows], point[rows] = p.probs, p.point
        if p.bucket is None:
            has_bucket = False
        else:
            bucket[rows] = p.bucket
        info[name] = {"fitted_on": "slice" if alone else "all", "n_train": int(tr.sum() if alone else len(train)),
                      **getattr(b, "info", {})}
    return Predictions(probs, point, bucket if has_bucket else None), info
