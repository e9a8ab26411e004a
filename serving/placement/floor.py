"""How few decode instances any placement could need: the fluid floor of a decode pool.

Why: "ours needs 13 instances, JSQ 21" says how two placements compare, not how much room is left. In a decode
pool a step costs a fixed part plus, per decoding request, a part that grows with its context (its KV read). A
request keeps its average token time (ATGT) on target only if the steps it shares cost at most the target, so an
instance can carry decodes whose per-step costs sum to at most ``tpot - fixed``. Summing what every request
decoding at time t costs, on pace (one token per ``tpot``: a faster pace shortens each stay but leaves less of
each step to share, and needs more instances), and dividing by that per-instance room gives ``need(t)``: the
instances a perfectly balanced fleet that could move any request anywhere at any moment would need at t.

* ``mean``: the time average of ``need``. In this fluid model (every instance stepping at the target pace) no
  placement, migration included, keeps every request on pace with fewer. A real fleet can go a little under it: a
  99% target lets 1% miss, and a step slower than the target can be made up by its requests' faster steps.
* ``peak``: the largest ``need`` averaged over a window as long as the median decode (a request's ATGT is an
  average over its own stay, so bursts shorter than a stay are absorbed). An estimate, not a bound: what that
  perfect balancer needs for the trace's bursts.

Exact for step models linear in decodes and KV read (BLIS, ``linear``); for the roofline model it linearizes the
memory-bound decode step, which is what a decode-only step is at these batch sizes.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from serving.perf.latency import LatencyModel, StepShape

PROBE_CONTEXT = 100_000  # tokens: the context at which the per-token KV-read cost is read off the step model


@dataclass(frozen=True)
class DecodeCost:
    """A decode step as ``fixed + Σ (per_decode + per_context_token · context)`` over the requests it decodes."""

    fixed_s: float
    per_decode_s: float
    per_context_token_s: float

    @classmethod
    def of(cls, latency: LatencyModel) -> DecodeCost:
        empty = latency.step_time(StepShape.of())
        one = latency.step_time(StepShape.of(decode_contexts=[0]))
        long = latency.step_time(StepShape.of(decode_contexts=[PROBE_CONTEXT]))
        return cls(empty, max(0.0, one - empty), max(0.0, (long - one) / PROBE_CONTEXT))


@dataclass(frozen=True)
class FluidFloor:
    mean: float        # instances: the time-averaged need (the fluid model's bound)
    peak: float        # instances: the largest need over a median-decode window (an estimate)
    window_s: float
    room_s: float      # per-instance step budget left for decodes: tpot - fixed

    def to_dict(self) -> dict:
        return {"mean": self.mean, "peak": self.peak, "window_s": self.window_s, "room_s": self.room_s}


def need_curve(arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int], cost: DecodeCost, tpot_s: float,
               dt: float = 0.05) -> np.ndarray:
    """Per-step cost of every request decoding in each ``dt`` cell from the first arrival on (seconds of a step; divide
    by ``tpot_s - cost.fixed_s`` for instances). Each request decodes from its arrival, one token per ``tpot_s``."""
    if not (len(arrivals) == len(prompts) == len(outputs)) or not len(arrivals):
        raise ValueError("the fluid floor needs one arrival, prompt and output length per request, and at least one request")
    t0 = min(arrivals)
    end = max(a + o * tpot_s for a, o in zip(arrivals, outputs))
    cells = math.ceil((end - t0) / dt) + 2
    # each stay's cost is linear in t (its context grows one token per tpot): build the curve from two difference
    # arrays, a level and a slope, rather than touching every cell of every stay
    level = np.zeros(cells + 2)
    slope = np.zeros(cells + 2)
    grow = cost.per_context_token_s * dt / tpot_s  # cost added per cell as a decode's context grows
    for a, p, o in zip(arrivals, prompts, outputs):
        if o <= 0:
            continue
        i0 = int((a - t0) / dt)
        i1 = max(i0 + 1, math.ceil((a - t0 + o * tpot_s) / dt))
        c0 = cost.per_decode_s + cost.per_context_token_s * p
        level[i0] += c0
        level[i1] -= c0 + grow * (i1 - i0)
        slope[i0 + 1] += grow
        slope[i1 + 1] -= grow
    return (np.cumsum(level) + np.cumsum(np.cumsum(slope)))[:cells]


def fluid_floor(arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int], latency: LatencyModel,
                tpot_s: float, dt: float = 0.05) -> FluidFloor:
    """The floor's mean and peak (see the module doc) for requests with these arrivals and prompt and output lengths.

    Raises ValueError when the fixed part of a step alone reaches ``tpot_s`` (no fleet keeps that target)."""
    cost = DecodeCost.of(latency)
    room = tpot_s - cost.fixed_s
    if room <= 0:
        raise ValueError(f"a step's fixed cost ({cost.fixed_s * 1e3:.2f} ms) is not under the token-time target "
                         f"({tpot_s * 1e3:.2f} ms): no fleet size keeps it")
    need = need_curve(arrivals, prompts, outputs, cost, tpot_s, dt) / room
    window = statistics.median(o * tpot_s for o in outputs)
    k = max(1, round(window / dt))
    smooth = np.convolve(need, np.ones(k) / k, mode="valid") if k < len(need) else np.array([need.mean()])
    # the mean while requests arrive: the drain after the last arrival is not load a fleet is sized for
    arriving = max(1, math.ceil((max(arrivals) - min(arrivals)) / dt))
    return FluidFloor(mean=float(need[:arriving].mean()), peak=float(smooth.max()), window_s=float(window), room_s=float(room))
