"""Latency targets a request is judged by, and how they are derived from a latency model.

EcoServe's JCT SLO (§4) is ``scale x (t_p + t_g x RL)``: t_p and t_g are the mean prefill time and decode-step
time of the workload's requests run alone, RL the response length. The per-token targets (TTFT, TPOT) are the
DistServe-style SLOs. The gateway, the plug-in's profile and the simulator all judge by this one definition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from serving.perf.latency import LatencyModel, isolated_latency


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets. EcoServe's JCT SLO is ``scale × (t_p + t_g × RL)`` with the workload's mean t_p, t_g."""

    scale: float
    t_p: float
    t_g: float
    ttft_s: float
    tpot_s: float

    def jct_limit(self, rl: float) -> float:
        return self.scale * (self.t_p + self.t_g * rl)


def derive_slo(latency: LatencyModel, prompts: Sequence[int], outputs: Sequence[int], scale: float,
               ttft_s: float | None = None, tpot_s: float | None = None, sample: int = 200) -> SLO:
    """Measure t_p and t_g of requests running alone (a deterministic sample) and build the SLOs.

    Defaults for the per-token SLOs: TTFT within ``scale`` × 5 mean prefills, TPOT within ``scale`` ×
    the isolated decode step (what DistServe-style SLOs express).
    """
    n = len(prompts)
    idx = np.linspace(0, n - 1, min(n, sample)).astype(int) if n else []
    pairs = [isolated_latency(latency, int(prompts[i]), int(outputs[i])) for i in idx]
    t_p = float(np.mean([p for p, _ in pairs])) if pairs else 0.0
    t_g = float(np.mean([g for _, g in pairs])) if pairs else 0.0
    return SLO(scale, t_p, t_g, ttft_s if ttft_s is not None else scale * 5 * t_p, tpot_s if tpot_s is not None else scale * t_g)
