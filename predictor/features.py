"""What the TF-IDF baseline reads of a prompt, computed one way for training and for serving.

A baseline fitted in training (training.baselines) and shipped in a model package (predictor.slices) must see a
prompt exactly as it saw its training rows, or its probabilities drift from what the report measured. So the text it
reads, the length hints and the slice of a prompt are defined here, on plain ``(role, text)`` turns, and both sides call
these functions. Nothing here imports torch, transformers or training code.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from predictor.prompt import approx_words

Turns = Sequence[tuple[str, str]]

# The text a baseline reads: the last TEXT_TURNS turns, each cut to its last TEXT_CHARS characters (the end of a long
# paste is closest to the request; the cap keeps a 394k-character turn from costing seconds to vectorise).
TEXT_TURNS = 3
TEXT_CHARS = 4000
# Previous-answer lengths (words) binned so a linear model can bend: no answer, short, ..., very long.
PREV_BINS = np.array([1, 10, 30, 100, 300, 1000])


def is_first_turn(turns: Turns) -> bool:
    """A conversation's opening request: no user turn before the latest one (training.data's ``Example.first_turn``)."""
    return sum(role == "user" for role, _ in turns) <= 1


def baseline_text(turns: Turns) -> str:
    """The text a baseline vectorises: the last :data:`TEXT_TURNS` turns, each cut to its last :data:`TEXT_CHARS`."""
    return " \n".join(text[-TEXT_CHARS:] for _, text in turns[-TEXT_TURNS:])


def length_hints(turns: Turns) -> tuple[int, int]:
    """Words in the latest request and in the last assistant answer before it (0: none), rounded as the LoRA model's
    length hints round them (:func:`predictor.prompt.approx_words`)."""
    latest = approx_words(turns[-1][1]) if turns else 0
    previous = next((approx_words(text) for role, text in reversed(turns[:-1]) if role == "assistant"), 0)
    return latest, previous


def hint_columns(hints: np.ndarray) -> np.ndarray:
    """``[n, 2]`` hints as dense columns beside the TF-IDF weights: both on a log scale of about 0..1 (as TF-IDF weights
    are), and the previous answer's length one-hot over :data:`PREV_BINS` so a linear model can bend."""
    hints = np.asarray(hints, dtype=np.float64).reshape(-1, 2)
    logs = np.log1p(hints) / np.log1p(1000.0)
    prev = np.eye(len(PREV_BINS) + 1)[np.searchsorted(PREV_BINS, hints[:, 1], side="right")]
    return np.hstack([logs, prev])


def tfidf_matrix(vectorizer, texts: Sequence[str], hints: np.ndarray, fit: bool = False):
    """The sparse feature matrix of a fitted (or, with ``fit``, fitting) ``TfidfVectorizer``: TF-IDF of ``texts``
    followed by :func:`hint_columns`."""
    from scipy.sparse import csr_matrix, hstack

    text = vectorizer.fit_transform(texts) if fit else vectorizer.transform(texts)
    return hstack([text, csr_matrix(hint_columns(hints))]).tocsr()
