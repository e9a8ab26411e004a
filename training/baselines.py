"""Cheap reference predictors every report is measured against, each as strong as it can cheaply be on each slice.

- ``global-median``: always the training median (what a length-blind scheduler assumes).
- ``prompt-length-bin``: mean training length conditioned on prompt-length bins (Aladdin's predictor).
- ``tfidf-logreg``: TF-IDF 1–2-grams + logistic regression (a strong classical text baseline), with the length hints
  the LoRA model reads (the latest request's and the previous answer's length in words) as extra features, and its
  regularisation C chosen on the validation split.

:func:`fit_sliced` fits a baseline once per slice (first turns on first turns only, later turns on later turns only)
and routes each test row to its slice's model, so a baseline is never judged on a mixture it was not fitted to.
Each returns :class:`~training.evaluate.Predictions` so the metrics code treats them like our model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from predictor.buckets import BucketScheme
from predictor.prompt import approx_words
from training.data.example import Example
from training.evaluate import Predictions, pairwise_accuracy

# Regularisation strengths tried for tfidf-logreg, on the validation split (a small grid: each fit costs seconds).
C_GRID = (0.1, 0.5, 2.0, 8.0)
# Previous-answer lengths (words) binned so a linear model can bend: no answer, short, ..., very long.
_PREV_BINS = np.array([1, 10, 30, 100, 300, 1000])


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
    texts = [" \n".join(t.text[-4000:] for t in e.turns[-3:]) for e in examples]
    hints = np.array([[approx_words(e.latest), _previous_answer_words(e)] for e in examples], dtype=np.float64)
    return Rows(texts, np.asarray(prompt_len, dtype=np.float64), hints.reshape(len(examples), 2),
                np.array([e.first_turn for e in examples], dtype=bool),
                np.array([e.response_tokens for e in examples], dtype=np.float64))


def _previous_answer_words(e: Example) -> int:
    """Words of the last assistant turn before the request, as the length hint rounds them; 0 on a first turn."""
    return next((approx_words(t.text) for t in reversed(e.turns[:-1]) if t.role == "assistant"), 0)


class Baseline(Protocol):
    name: str

    def fit(self, train: Rows, val: Rows, scheme: BucketScheme) -> Baseline: ...

    def predict(self, rows: Rows) -> Predictions: ...


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


class PromptLengthBin:
    """Mean response length given the prompt length's quantile bin (Aladdin §4.1)."""

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
        self.vec = TfidfVectorizer(ngram_range=(1, 2), max_features=50_000, sublinear_tf=True,
                                   min_df=2 if len(train) >= 50 else 1)
        x = self._features(train, fit=True)
        y = scheme.assign(train.lengths)
        self.classes = np.unique(y)
        self.info = {"C": None, "val_pairwise_accuracy": None}
        if len(self.classes) < 2:  # one bucket in training: nothing to learn beyond it
            self.clf = None
            return self
        xv = self._features(val) if len(val) else None
        best = -1.0
        for c in self.c_grid if xv is not None else (self.c_grid[len(self.c_grid) // 2],):
            clf = LogisticRegression(max_iter=300, C=c).fit(x, y)
            score = pairwise_accuracy(self._expected(clf, xv), val.lengths) if xv is not None else 0.0
            score = -1.0 if np.isnan(score) else score
            if score > best:
                best, self.clf = score, clf
                self.info = {"C": c, "val_pairwise_accuracy": None if xv is None else score}
        return self

    def _features(self, rows: Rows, fit: bool = False):
        from scipy.sparse import csr_matrix, hstack

        text = self.vec.fit_transform(rows.texts) if fit else self.vec.transform(rows.texts)
        logs = np.log1p(rows.hints) / np.log1p(1000.0)  # about 0..1, as TF-IDF weights are
        prev = np.eye(len(_PREV_BINS) + 1)[np.searchsorted(_PREV_BINS, rows.hints[:, 1], side="right")]
        return hstack([text, csr_matrix(np.hstack([logs, prev]))]).tocsr()

    def _probs(self, clf, x) -> np.ndarray:
        probs = np.zeros((x.shape[0], self.scheme.n))
        probs[:, clf.classes_] = clf.predict_proba(x)
        return probs

    def _expected(self, clf, x) -> np.ndarray:
        return self.scheme.expected(self._probs(clf, x))

    def predict(self, rows: Rows) -> Predictions:
        if self.clf is None:
            probs = np.zeros((len(rows), self.scheme.n))
            probs[:, self.classes[0]] = 1.0
        else:
            probs = self._probs(self.clf, self._features(rows))
        return Predictions(probs, self.scheme.expected(probs))


BASELINES: tuple[Callable[[], Baseline], ...] = (GlobalMedian, PromptLengthBin, TfidfLogReg)


def fit_sliced(make: Callable[[], Baseline], scheme: BucketScheme, train: Rows, val: Rows, test: Rows,
               min_rows: int = 20) -> tuple[Predictions, dict[str, dict]]:
    """A baseline fitted once per slice (first turns, later turns) on that slice's training and validation rows, each
    test row predicted by its own slice's model: ``(predictions over all test rows, {slice: the model's info})``.
    A slice with fewer than ``min_rows`` training rows is fitted on all of them (too few to fit alone)."""
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
        p = b.predict(test.take(rows))
        probs[rows], point[rows] = p.probs, p.point
        if p.bucket is None:
            has_bucket = False
        else:
            bucket[rows] = p.bucket
        info[name] = {"fitted_on": "slice" if alone else "all", "n_train": int(tr.sum() if alone else len(train)),
                      **getattr(b, "info", {})}
    return Predictions(probs, point, bucket if has_bucket else None), info
