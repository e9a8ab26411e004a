"""When a fleet's placement is made again as its models' request rates drift.

A plan is made for the rates of a window of past requests; when the rates move, the plan may no longer fit. Two
rules decide when to place again:

- **SeaLLM's adaptive interval** (SeaLLM §4.3, Eq. 8): place again every ``I_t`` seconds, where ``I_t`` shrinks by
  ``(1 - beta)`` when the attainment the last interval achieved differs from the one its simulator estimated by more
  than ``beta`` (relative), and grows by ``(1 + beta)`` otherwise.
- **Ours**: our placement takes a fraction of a second, so it is made again at every check from the last window's
  rates and the models' predicted lengths. It is adopted when the plan serving no longer carries those demands within
  the slowdown it was made at (:func:`~serving.placement.models.lengthwise.still_fits`: what it was sized for has
  grown) and the new plan groups the models differently (which models share which meshes, of which sizes); a plan
  that only moves shares within the same meshes is not worth a move. Without the first condition every window's
  Poisson noise would move models.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.placement.models.plan import Plan


@dataclass
class AdaptiveInterval:
    """SeaLLM's replacement interval ``I_t``: :meth:`next` gives ``I_{t+1}`` from the interval's real and estimated
    performance (both attainment, in [0, 1])."""

    interval_s: float
    beta: float = 0.2
    min_s: float = 10.0

    def __post_init__(self) -> None:
        if not 0 < self.beta < 1:
            raise ValueError(f"beta is in (0, 1) (SeaLLM Eq. 8), got {self.beta}")
        if self.interval_s <= 0:
            raise ValueError("the first interval must be positive")

    def next(self, real: float, estimated: float) -> float:
        off = abs(real - estimated) / estimated if estimated > 0 else float("inf")
        self.interval_s = max(self.min_s, self.interval_s * ((1 - self.beta) if off > self.beta else (1 + self.beta)))
        return self.interval_s


def grouping(plan: Plan) -> tuple:
    """Which models share which meshes, and of how many GPUs: what a move changes (shares within a mesh do not)."""
    return tuple(sorted((u.gpus, tuple(sorted(m.name for m in u.models))) for u in plan.units))


def regroups(current: Plan | None, new: Plan | None) -> bool:
    """Whether adopting ``new`` moves a model (our rule); a failed placement (None) moves nothing."""
    return new is not None and (current is None or grouping(new) != grouping(current))
