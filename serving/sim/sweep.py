"""Rate sweeps: the highest request rate each policy sustains at >= 90% SLO attainment, and its curves.

Every policy walks the same geometric grid of rates (so curves line up in the figure) until its
attainment drops below the target, then bisects between the last rate that passed and the first that
failed. One run per point, all in this process, so ratios between policies are measured side by side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from serving.sim.engine import simulate
from serving.sim.metrics import RunMetrics
from serving.sim.scenarios import EXACT_SUFFIX, REFINED_SUFFIX, Setup

BENCH_POLICIES = ("vllm", "vllm-v0", "orca", "sarathi", "sjf", "ecoserve-D", "ecoserve-SD", "ecoserve-SDO", "ecoserve", "oracle",
                  "lengthwise-fcfs", "lengthwise-sjf", "lengthwise")


def run_point(setup: Setup, policy: str, rate: float, check: bool = False) -> RunMetrics:
    """One run at ``rate``; ``POLICY+refined`` runs POLICY with the setup's refinements (none given: an error)."""
    refined = policy.endswith(REFINED_SUFFIX)
    if refined and setup.refinements is None:
        raise ValueError(f"{policy}: no refinements in this setup (lengthwise bench sim --refine QUALITY.json)")
    preds, oracle = setup.predictions_for(policy.removesuffix(REFINED_SUFFIX))
    reqs = setup.at_rate(rate)
    m = simulate(reqs, preds, policy.removesuffix(REFINED_SUFFIX).removesuffix(EXACT_SUFFIX), setup.config,
                 setup.kv_blocks, setup.latency, setup.slo, repredict=oracle.repredict, check=check,
                 refinements=setup.refinements if refined else None)
    m.extra["rate"] = rate
    m.policy = policy
    return m


def sweep_policy(setup: Setup, policy: str, *, target: float = 0.9, factor: float = 1.25, max_points: int = 20,
                 refine: int = 3, on_point: Callable[[str, float, RunMetrics], None] | None = None,
                 key: str = "slo_attainment") -> dict:
    """Max rate at ``target`` attainment (of ``key``: JCT, or ``ttft_tpot_attainment``) for one policy, with every
    point it ran."""
    return max_rate(lambda rate: run_point(setup, policy, rate), setup.scenario.start_rate, target=target, factor=factor,
                    max_points=max_points, refine=refine, key=key,
                    on_point=(lambda rate, m: on_point(policy, rate, m)) if on_point else None)


def max_rate(run: Callable[[float], RunMetrics], start_rate: float, *, target: float = 0.9, key: str = "slo_attainment",
             factor: float = 1.25, max_points: int = 20, refine: int = 3,
             on_point: Callable[[float, RunMetrics], None] | None = None) -> dict:
    """The highest rate whose ``key`` attainment is at least ``target``: a geometric walk from ``start_rate``, then bisection."""
    points: dict[float, RunMetrics] = {}

    def at(rate: float) -> RunMetrics:
        if rate not in points:
            points[rate] = run(rate)
            if on_point:
                on_point(rate, points[rate])
        return points[rate]

    def ok(rate: float) -> bool:
        return getattr(at(rate), key) >= target

    rate = start_rate
    lo = hi = None
    if ok(rate):
        lo = rate
        for _ in range(max_points):
            rate = round(rate * factor, 4)
            if not ok(rate):
                hi = rate
                at(round(rate * factor, 4))  # one more point past the knee for the curve
                break
            lo = rate
    else:
        hi = rate
        for _ in range(max_points):
            rate = round(rate / factor, 4)
            if ok(rate):
                lo = rate
                break
            hi = rate
    if lo is not None and hi is not None:
        for _ in range(refine):
            mid = round(math.sqrt(lo * hi), 4)
            if ok(mid):
                lo = mid
            else:
                hi = mid
    curve = [{"rate": r, **{k: v for k, v in m.to_dict().items() if not isinstance(v, dict)}} for r, m in sorted(points.items())]
    return {"max_rate_at_90_slo": lo or 0.0, "first_failing_rate": hi,
            "peak_throughput_rps": max((c["throughput_rps"] for c in curve), default=0.0), "curve": curve}


def sweep(setup: Setup, policies: Sequence[str] = BENCH_POLICIES, **kw) -> dict:
    return {p: sweep_policy(setup, p, **kw) for p in policies}
