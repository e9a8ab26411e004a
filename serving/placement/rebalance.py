"""Aladdin Alg. 2: re-balance prediction error by moving requests that have not started.

Each instance's error since the last re-balancing is a point (l_e, b_e): tokens and requests beyond
plan. A job that outlived its prediction adds its re-predicted extra tokens and one request; a job that
finished early subtracts what it did not produce and one request. Through Eq. 3's decode cost the point
becomes a step-time error ``α·l_e + β·b_e`` (α: seconds per context token, β: per sequence; the
distance of the worker's error line from the origin, Alg. 2 line 29, up to one shared constant). Moving a
not-yet-started job j from x to y shifts x by −(α·l_pred + β) and y by the same amount up. Moves are
chosen greedily, each the one that most reduces Σ|error|, only onto instances where Alg. 1's
constraints still hold, until no move helps. Each error event is used once: an overrun when first
seen, an early finish at the next re-balancing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serving.perf.latency import StepShape
from serving.placement.limits import Limits
from serving.placement.state import Instance


@dataclass(frozen=True, slots=True)
class Move:
    rid: int
    src: int
    dst: int


def _coefficients(limits: Limits) -> tuple[float, float]:
    """α (s per context token) and β (s per sequence) of a decode step: Eq. 3's k2 and c2."""
    if limits.latency is None:
        return 1.0 / limits.kv_tokens, 1.0 / limits.max_num_seqs  # each dimension relative to its limit
    t = limits.latency.step_time
    base = t(StepShape(0, 1, 1024, 1))
    alpha = max(0.0, t(StepShape(0, 1, 1024 + 4096, 1)) - base) / 4096
    beta = max(0.0, t(StepShape(0, 2, 2048, 2)) - base - 1024 * alpha)
    if alpha == 0.0 and beta == 0.0:
        return 1.0 / limits.kv_tokens, 1.0 / limits.max_num_seqs
    return alpha, beta


def errors(instances: Sequence[Instance], alpha: float, beta: float, consume: bool = True) -> list[float]:
    """Each instance's new prediction error as decode step time (``alpha``, ``beta`` from :func:`_coefficients`);
    ``consume`` marks the events as used."""
    out = []
    for inst in instances:
        l_e, b_e = inst.early_tokens, -inst.early_count
        for j in inst.jobs.values():
            if j.generated > j.pred_len and j.rid not in inst.overruns_seen:
                l_e += j.planned_len - j.pred_len
                b_e += 1
                if consume:
                    inst.overruns_seen.add(j.rid)
        if consume:
            inst.early_tokens, inst.early_count = 0.0, 0
        out.append(alpha * l_e + beta * b_e)
    return out


def rebalance(instances: Sequence[Instance], limits: Limits, now: float, max_moves: int = 64) -> list[Move]:
    """Plan moves of not-started jobs; the caller applies them (instance views and engines both)."""
    alpha, beta = _coefficients(limits)
    err = errors(instances, alpha, beta)
    moves: list[Move] = []
    moved: set[int] = set()
    live = [i for i, e in enumerate(instances) if e.healthy]
    for _ in range(max_moves):
        best = None
        for x in live:
            if err[x] <= 0:
                continue
            for j in instances[x].jobs.values():
                if j.started or j.rid in moved:
                    continue
                w = alpha * j.pred_len + beta
                for y in live:
                    if y == x:
                        continue
                    gain = abs(err[x]) + abs(err[y]) - abs(err[x] - w) - abs(err[y] + w)
                    if gain > 1e-12 and (best is None or gain > best[0]) and limits.violation(instances[y], j, now) is None:
                        best = (gain, j, x, y, w)
        if best is None:
            break
        _, j, x, y, w = best
        err[x] -= w
        err[y] += w
        instances[x].remove(j.rid)
        instances[y].add(j)
        moved.add(j.rid)
        moves.append(Move(j.rid, x, y))
    return moves
