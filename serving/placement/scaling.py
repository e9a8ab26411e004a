"""Aladdin Eq. 7: how many instances a request rate needs, ``N = ceil(k5 · rate + c5)``.

Aladdin observes that, above a low-rate floor R, the instance count that keeps the SLO is linear in the
arrival rate, and learns k5, c5 from history. Here the history is a list of (rate, instances needed)
points, from ``lengthwise bench placement`` (simulated) or from a fleet's own records; the fit is least
squares on the points above R, and the recommendation is never below one instance nor below the
largest count observed at or under the asked rate (the relation is monotone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ScalingFit:
    k5: float
    c5: float
    min_rate: float           # R: the fit holds above it
    points: tuple[tuple[float, int], ...]
    r2: float | None

    def recommend(self, rate: float) -> int:
        if not rate >= 0 or math.isinf(rate):
            raise ValueError(f"rate must be a non-negative number of requests per second, got {rate}")
        n = math.ceil(self.k5 * rate + self.c5 - 1e-9)
        floor = max((m for r, m in self.points if r <= rate), default=1)
        return max(1, n, floor)

    def to_dict(self) -> dict:
        return {"k5": self.k5, "c5": self.c5, "min_rate": self.min_rate, "r2": self.r2,
                "points": [{"rate": r, "instances": m} for r, m in self.points]}


def fit_scaling(points: Sequence[tuple[float, int]], min_rate: float = 0.0) -> ScalingFit:
    """Least-squares k5, c5 on (rate, instances) points with rate > ``min_rate``; needs two distinct rates."""
    pts = sorted((float(r), int(n)) for r, n in points if n is not None and n > 0)
    use = [(r, n) for r, n in pts if r > min_rate]
    if len({r for r, _ in use}) < 2:
        raise ValueError(f"need instance counts at two or more distinct rates above {min_rate:g} req/s to fit Eq. 7, got {use}")
    x = np.array([r for r, _ in use])
    y = np.array([n for _, n in use], dtype=float)
    k5, c5 = np.polyfit(x, y, 1)
    pred = k5 * x + c5
    ss = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - pred) ** 2).sum()) / ss if ss > 0 else None
    return ScalingFit(float(k5), float(c5), min_rate, tuple(pts), r2)
