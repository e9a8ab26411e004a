"""A distilled student: fewer encoder layers, taught by the trained teacher, served only when it is as good.

Why: the gateway asks for a prediction per request, and each of MiniLM's six layers is about a sixth of the encoder's
cost, so a two-layer student costs about a third of the teacher at the same input budget. Knowledge distillation
(Hinton et al., 2015) trains it on the teacher's bucket probabilities, which carry more than the label does (how far
off a wrong bucket is, how sure the teacher is), and DistilBERT's initialisation from the teacher's own layers
(:func:`predictor.model.student_of`) starts it close to the teacher.

The student's target per training example is ``alpha`` x the teacher's probabilities + (1 - ``alpha``) x the
label's own target in the censored likelihood's ``[N, 2B]`` form (an exact label's mass; a cut answer's lower bound),
so :class:`training.module.LengthModule` trains it with the same loss, ranking term and early stopping as the teacher.
LoRA stays in the teacher: the student is small enough to fine-tune whole.

Which one ships is measured, not assumed: both are exported and scored on the same test rows, and the student ships
when its top-1 is within ``distill_max_top1_drop`` and its Kendall tau within ``distill_max_tau_drop`` of the
teacher's; the report's ``distillation`` block says which shipped, why, and what each costs per prediction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Verdict:
    """The two candidates side by side and the one that ships."""

    ships: str  # "student" or "teacher"
    reason: str
    teacher: dict[str, float]
    student: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"ships": self.ships, "reason": self.reason, "teacher": self.teacher, "student": self.student}


def teacher_probs(teacher: Any, ids: list[list[int]], pad_id: int, batch: int = 64) -> np.ndarray:
    """The trained teacher's bucket probabilities for encoded prompts (torch, eval mode, shortest first for less
    padding), in the prompts' order."""
    import torch

    from predictor.runtime import pad_ids

    teacher = teacher.eval()
    order = np.argsort([len(x) for x in ids], kind="stable")
    out: np.ndarray | None = None
    with torch.no_grad():
        for s in range(0, len(order), batch):
            sel = order[s:s + batch]
            x, m = pad_ids([ids[i] for i in sel], pad_id)
            p = teacher(torch.from_numpy(x), torch.from_numpy(m)).softmax(1).numpy()
            if out is None:
                out = np.zeros((len(ids), p.shape[1]))
            out[sel] = p
    return out if out is not None else np.zeros((0, 0))


def student_targets(labels: np.ndarray, probs: np.ndarray, alpha: float) -> np.ndarray:
    """``[N, 2B]`` targets: ``alpha`` x the teacher's ``probs`` ``[N, B]`` on the exact columns + (1 - ``alpha``) x the
    labels' own targets (bucket indices ``[N]``, or already ``[N, 2B]`` with censored or soft labels)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"the teacher's weight must be within [0, 1], not {alpha}")
    n, b = probs.shape
    if labels.ndim == 1:
        own = np.zeros((n, 2 * b))
        own[np.arange(n), labels.astype(int)] = 1.0
    else:
        own = labels.astype(np.float64)
    if own.shape != (n, 2 * b):
        raise ValueError(f"labels of shape {labels.shape} do not match {n} prompts and {b} buckets")
    mixed = (1.0 - alpha) * own
    mixed[:, :b] += alpha * probs
    return mixed


def judge(teacher: dict[str, float], student: dict[str, float], max_top1_drop: float, max_tau_drop: float) -> Verdict:
    """The student ships when it is within the agreed loss of the teacher on both top-1 and Kendall tau."""
    d_acc = teacher["accuracy"] - student["accuracy"]
    d_tau = teacher["kendall_tau"] - student["kendall_tau"]
    if d_acc <= max_top1_drop and d_tau <= max_tau_drop:
        return Verdict("student", f"within the agreed loss: top-1 {-d_acc:+.3f}, tau {-d_tau:+.3f} against the teacher",
                       teacher, student)
    worse = [f"top-1 {-d_acc:+.3f} (allowed -{max_top1_drop:g})"] if d_acc > max_top1_drop else []
    worse += [f"tau {-d_tau:+.3f} (allowed -{max_tau_drop:g})"] if d_tau > max_tau_drop else []
    return Verdict("teacher", "the student loses too much: " + ", ".join(worse), teacher, student)


def cpu_ms_per_prediction(predictor: Any, encoded: list, n: int = 100) -> float:
    """CPU milliseconds per prediction at batch size 1 over the first ``n`` encoded prompts (process time, so the
    figure counts every thread the runtime used and nothing else the machine did)."""
    sample = encoded[:n]
    if not sample:
        return float("nan")
    predictor.predict_encoded(sample[:1])  # warm-up: the first run allocates
    t0 = time.process_time()
    for e in sample:
        predictor.predict_encoded([e])
    return (time.process_time() - t0) / len(sample) * 1e3


def score(predictor: Any, encoded: list, lengths: np.ndarray, scheme: Any, padding: float) -> dict[str, float]:
    """Top-1, within-one, MAE, Kendall tau and pairwise accuracy of one exported candidate on the test rows, and its CPU
    cost per prediction."""
    from training.evaluate import Predictions, compute_metrics

    batch = predictor.predict_encoded(encoded)
    m = compute_metrics(Predictions(batch.probs, batch.expected), lengths, scheme, padding)
    keep = ("accuracy", "accuracy_within_1", "mae_tokens", "kendall_tau", "pairwise_accuracy")
    return {**{k: float(m[k]) for k in keep}, "cpu_ms_per_prediction": cpu_ms_per_prediction(predictor, encoded)}


def describe(layers: int, teacher_layers: int, kept: list[int], alpha: float) -> dict[str, Any]:
    """What ``meta.json`` records of a student package (the registry's variant tag reads ``layers``)."""
    return {"layers": layers, "teacher_layers": teacher_layers, "initialised_from_layers": kept, "alpha": alpha}


def package_dir(work: Path, role: str) -> Path:
    return work / f"{role}-package"
