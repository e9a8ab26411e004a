"""Figures logged with every evaluation: confusion matrix, reliability diagram, error by prompt length.

Built on ``matplotlib.figure.Figure`` (no pyplot), so saving a PNG never touches the global backend of
the caller (a notebook keeps its inline backend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from predictor.buckets import BucketScheme
from training.evaluate import reliability


def _labels(scheme: BucketScheme) -> list[str]:
    return [f"{lo}-{hi}" for lo, hi in (scheme.range_of(i) for i in range(scheme.n))]


def confusion_png(truth: np.ndarray, pred: np.ndarray, scheme: BucketScheme, path: Path, title: str = "") -> Path:
    cm = np.zeros((scheme.n, scheme.n))
    np.add.at(cm, (truth, pred), 1)
    norm = cm / np.maximum(cm.sum(1, keepdims=True), 1)
    fig = Figure(figsize=(7, 6))
    ax = fig.subplots()
    im = ax.imshow(norm, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(scheme.n), _labels(scheme), rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(scheme.n), _labels(scheme), fontsize=7)
    ax.set_xlabel("predicted bucket (tokens)")
    ax.set_ylabel("true bucket (tokens)")
    ax.set_title(title or "Confusion matrix (row-normalised)")
    for i in range(scheme.n):
        for j in range(scheme.n):
            if cm[i, j]:
                ax.text(j, i, int(cm[i, j]), ha="center", va="center", fontsize=6,
                        color="white" if norm[i, j] > 0.5 else "black")
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def reliability_png(probs: np.ndarray, truth: np.ndarray, path: Path, ece: float) -> Path:
    conf, acc, cnt = reliability(probs, truth)
    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], "--", color="grey", label="perfect calibration")
    sel = cnt > 0
    ax.plot(conf[sel], acc[sel], "o-", label=f"model (ECE {ece:.3f})")
    for c, a, n in zip(conf[sel], acc[sel], cnt[sel]):
        ax.annotate(str(n), (c, a), fontsize=7, textcoords="offset points", xytext=(4, -8))
    ax.set_xlabel("confidence of the top bucket")
    ax.set_ylabel("accuracy")
    ax.set_title("Reliability diagram")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def error_by_prompt_length_png(prompt_len: np.ndarray, errors: dict[str, np.ndarray], path: Path, bins: int = 8) -> Path:
    """Mean absolute error (tokens) per prompt-length quantile bin, one line per predictor."""
    edges = np.unique(np.quantile(prompt_len, np.linspace(0, 1, bins + 1)))
    which = np.clip(np.searchsorted(edges, prompt_len, side="right") - 1, 0, len(edges) - 2)
    centers = [f"{int(edges[i])}-{int(edges[i + 1])}" for i in range(len(edges) - 1)]
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for name, err in errors.items():
        ax.plot(range(len(centers)), [np.abs(err[which == b]).mean() if np.any(which == b) else np.nan
                                      for b in range(len(centers))], "o-", label=name)
    ax.set_xticks(range(len(centers)), centers, rotation=30, fontsize=8)
    ax.set_xlabel("prompt length (target-model tokens, whole conversation)")
    ax.set_ylabel("MAE (response tokens)")
    ax.set_title("Error by prompt length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
