"""Predictions wrong in every way a predictor can be wrong, shared by the policy and placement hostile tests."""

from __future__ import annotations

import random

from serving.policy.request import Prediction
from serving.sim.workload import TraceRequest  # the simulator's own request type, which the hostile traces are

__all__ = ["MODES", "TraceRequest", "hostile_prediction"]

MODES = ("low10", "high10", "zero", "max", "noise16", "wrong_bucket")


def hostile_prediction(mode: str, true_len: int, rng: random.Random, max_len: int, edges: tuple[int, ...]) -> Prediction:
    """A prediction of ``true_len`` that is wrong the way ``mode`` says, for a model whose longest answer is ``max_len``
    and whose buckets start at ``edges``."""
    if mode == "low10":
        return Prediction(length=true_len / 10)
    if mode == "high10":
        return Prediction(length=min(true_len * 10, max_len))
    if mode == "zero":
        return Prediction(length=0.0)
    if mode == "max":
        return Prediction(length=float(max_len))
    if mode == "noise16":  # SeaLLM's error: up to 16x either way, so past max_model_len too
        return Prediction(length=true_len * 16 ** rng.uniform(-1, 1))
    true_bucket = sum(true_len > e for e in edges)  # all mass in the bucket farthest from the true one
    wrong = 0 if true_bucket > len(edges) // 2 else len(edges)
    probs = tuple(1.0 if i == wrong else 0.0 for i in range(len(edges) + 1))
    lo, hi = (0, edges[0]) if wrong == 0 else (edges[-1], max_len)
    return Prediction(length=(lo + hi) / 2, hi=hi, bucket=wrong, edges=edges, probs=probs)
