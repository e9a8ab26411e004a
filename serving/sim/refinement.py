"""Refined predictions in the simulator: at chosen points of each answer, a sharper prediction of what is left, as
good as it was measured to be.

A remaining-length predictor reads the prompt and the answer so far (:mod:`predictor.partial`); on held-out answers
it ranks what is left of the answers still running at ``k`` tokens at a Kendall tau measured per ``k``
(``python -m serving.bench.predictor.remaining`` writes the table). The simulator has no text, so a refinement here is the true
remaining length times log-normal noise, its spread set per point so that over the workload's requests still running
there the noisy remaining ranks the true one at the measured tau: the quality measured, not assumed. The host
(:func:`serving.sim.engine.simulate`) hands it to the policy through :meth:`serving.policy.base.Policy.refine` when a
request has written exactly ``k`` tokens, as the gateway hands the sidecar's answer to the plug-in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serving.policy.request import Prediction
from serving.sim.workload import TraceRequest

_SALT_REFINE = 7  # the noise of a refinement is drawn apart from the first prediction's


@dataclass(frozen=True)
class RefinementQuality:
    """Measured Kendall tau of the refined remaining length at each point ``k`` (answers still running there)."""

    taus: dict[int, float]
    source: str = ""

    @classmethod
    def from_file(cls, path: Path) -> RefinementQuality:
        """The table ``python -m serving.bench.predictor.remaining --out`` writes (its rows' ``k`` and ``tau_refined``)."""
        doc = json.loads(Path(path).read_text())
        return cls({int(r["k"]): float(r["tau_refined"]) for r in doc["rows"]}, str(path))

    @property
    def points(self) -> tuple[int, ...]:
        return tuple(sorted(self.taus))


class RefinedNoise:
    """The refinement a host hands the policy at each point of :class:`RefinementQuality`."""

    def __init__(self, quality: RefinementQuality, requests: list[TraceRequest], seed: int = 0) -> None:
        from serving.sim.predictions import standard_normal

        self.quality = quality
        self.seed = seed
        self.sigma: dict[int, float] = {}
        self.achieved: dict[int, float] = {}
        for k, tau in quality.taus.items():
            running = [r for r in requests if r.output_tokens > k]
            if len(running) < 3:
                continue
            rem = np.array([r.output_tokens - k for r in running], dtype=float)
            z = standard_normal(seed, np.array([r.rid for r in running]), _SALT_REFINE + k)
            self.sigma[k], self.achieved[k] = _sigma_for_tau(rem, z, tau)

    def at(self, request: TraceRequest, k: int) -> Prediction | None:
        """The refined prediction of ``request`` after ``k`` tokens (of its whole length), or None at no such point."""
        from serving.sim.predictions import standard_normal

        sigma = self.sigma.get(k)
        if sigma is None or request.output_tokens <= k:
            return None
        z = float(standard_normal(self.seed, np.array([request.rid]), _SALT_REFINE + k)[0])
        rem = max(1.0, (request.output_tokens - k) * float(np.exp(sigma * z)))
        return Prediction(length=k + rem)


def _sigma_for_tau(rem: np.ndarray, z: np.ndarray, tau: float) -> tuple[float, float]:
    """The log-normal spread whose noisy ``rem`` ranks ``rem`` closest to ``tau`` (tau falls as the spread grows)."""
    from scipy.stats import kendalltau

    from serving.sim.predictions import bracket_spread

    def achieved(sigma: float) -> float:
        t = kendalltau(rem * np.exp(sigma * z), rem).statistic
        return float(0.0 if np.isnan(t) else t)

    lo, hi = bracket_spread(achieved, tau, 0.0, 8.0, 40)
    sigma = (lo + hi) / 2
    return sigma, achieved(sigma)
