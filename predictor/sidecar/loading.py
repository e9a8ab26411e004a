"""One model version in the sidecar: open it (an onnxruntime session per worker, warmed up) and run a micro-batch on it.

Kept apart from the state that decides *which* version serves (predictor/sidecar/state.py), so loading and
inference can be reasoned about, and timed, without the swapping, feedback and monitoring around them.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import numpy as np

from predictor.runtime import OnnxLengthPredictor
from predictor.sidecar.cache import ResolvedModel
from predictor.sidecar.settings import SidecarSettings

NO_TARGET = "unknown: this version records no target model"


def target_of(predictor: OnnxLengthPredictor) -> dict | str:
    """The model whose response lengths this version learned (``model``, ``label_tokenizer``, ``sampling``,
    ``max_tokens``), or a sentence saying it records none: a prediction for another model is a guess, and the
    client should be able to tell."""
    target = getattr(predictor, "target", None)
    return dict(target) if target else NO_TARGET


@dataclass(frozen=True)
class ServedModel:
    """One loaded version: an onnxruntime session per inference worker (sessions are not shared between
    concurrent batches, so each runs single-owner at full speed)."""

    sessions: queue.SimpleQueue
    predictor: OnnxLengthPredictor  # the first session; scheme, tokenizer and input format are the same in all
    resolved: ResolvedModel

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def version(self) -> str:
        return self.resolved.version

    @property
    def target(self) -> dict | str:
        return target_of(self.predictor)


@dataclass(frozen=True)
class PredictItem:
    """One conversation to predict, with the quantile its caller asked for."""

    turns: list[tuple[str, str]]
    quantile: float


def load_served(resolved: ResolvedModel, settings: SidecarSettings) -> ServedModel:
    """Open one ONNX session per worker and run a warm-up prediction on each, so no request pays for it."""
    sessions: queue.SimpleQueue = queue.SimpleQueue()
    preds = [OnnxLengthPredictor(resolved.path, threads=settings.threads, batch_size=settings.max_batch,
                                 token_budget=settings.token_budget, spin=settings.ort_spin, precision=settings.precision,
                                 max_prompt_tokens=settings.max_prompt_tokens)
             for _ in range(settings.workers)]
    for pred in preds:
        pred.predict(["warm-up"])
        sessions.put(pred)
    return ServedModel(sessions, preds[0], resolved)


def predict_items(model: ServedModel, items: list[PredictItem]) -> list[tuple[dict[str, Any], ServedModel]]:
    """One micro-batch: each prompt to its slice's predictor (the package's routes: predictor.slices), the model's
    prompts tokenised once and run in one onnxruntime pass (grouped by length), per-item quantiles."""
    pred = model.sessions.get()  # at most `workers` batches run at once, so one is always free
    try:
        routed = pred.probs_routed([it.turns for it in items])
    finally:
        model.sessions.put(pred)
    return _answers(model, items, routed, overflow=False)


def predict_fast(model: ServedModel, items: list[PredictItem]) -> list[tuple[dict[str, Any], ServedModel] | None]:
    """The same answers from the package's fast tier alone (the encoder never runs): for items a saturated sidecar
    could not run in time. None for an item whose slice the version's fast tier does not cover (none: all None)."""
    covered = [i for i, it in enumerate(items) if model.predictor.has_fast_tier([it.turns])]
    out: list[tuple[dict[str, Any], ServedModel] | None] = [None] * len(items)
    if covered:
        some = [items[i] for i in covered]
        for i, answer in zip(covered, _answers(model, some, model.predictor.probs_fast([it.turns for it in some]), True)):
            out[i] = answer
    return out


def _answers(model: ServedModel, items: list[PredictItem], routed, overflow: bool) -> list[tuple[dict[str, Any], ServedModel]]:
    """Each item's response row from its bucket probabilities (``routed``: predictor.runtime.RoutedProbs)."""
    probs = routed.probs
    scheme = model.predictor.scheme
    expected = scheme.expected(probs)
    buckets = probs.argmax(1)
    qs = np.array([it.quantile for it in items])
    quant = np.empty(len(items))
    for q in np.unique(qs):
        sel = qs == q
        quant[sel] = scheme.quantile(probs[sel], float(q))
    upper = scheme.upper()
    inner = [int(e) for e in scheme.edges[1:]]  # the bucket tops but the last (open) one: len(probs) - 1 of them
    target = model.target
    out = []
    for i in range(len(items)):
        b = int(buckets[i])
        out.append(({
            "bucket": b, "range": [int(scheme.edges[b]), int(upper[b])], "probs": probs[i].tolist(), "edges": list(inner),
            "expected_tokens": float(expected[i]), "quantile": float(qs[i]), "quantile_tokens": float(quant[i]),
            "truncated": bool(routed.truncated[i]), "prompt_tokens": int(routed.prompt_tokens[i]), "model_name": model.name,
            "model_version": model.version, "target": target, "predictor": str(routed.predictor[i]), "overflow": overflow,
        }, model))
    return out
