"""A request's length as a distribution that sharpens as the request runs, and the Gittins rank it implies.

A prediction says more than one number: a bucket classifier gives a probability per bucket, and even a point
prediction comes with the error its predictor has shown lately. Once a request has written ``a`` tokens, every
length at or below ``a`` is ruled out, so what is left is ``P(L > a + x | L > a)``: a request at 300 tokens whose
prediction said "100 to 200, probably" is now a request whose remaining length is whatever the tail says.

The belief is a discrete distribution over support points (token counts, sorted) with their probabilities. On a
discrete support the conditional distribution only changes when the age passes a support point, so everything the
scheduler reads of it (mean, quantile, the Gittins rank's best stopping point) is cached per segment and recomputed
at most once per point passed, not once per step.

The Gittins rank (Gittins, *Multi-armed Bandit Allocation Indices*; for queues with unknown sizes see Aalto, Ayesta
and Righter, "On the Gittins index in the M/G/1 queue", Queueing Systems 2009, and Scully, Harchol-Balter and
Scheller-Wolf, "SOAP", SIGMETRICS 2018): the least, over the points ``x`` where the request might finish, of the
expected work until it finishes or reaches ``x``, over the probability (weighted by what finishing is worth) that it
finishes by ``x``. Serving the least rank first minimises mean response time in M/G/1; with exact lengths it is
SRPT, with a heavy-tailed belief and growing age it sinks a long-running request behind fresh ones (what SeaLLM's
doubling budget does by rule). Weighting each finish by ``1 / L`` makes it the c-mu rule for mean normalised latency
(SeaLLM §4.2's objective), which also suits a deadline that scales with the length (EcoServe's JCT SLO).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

SUB_POINTS = 4  # support points per bucket: the bucket's mass spread evenly inside it


class LengthBelief:
    """A discrete distribution of a request's total output length (``xs`` sorted, ``ps`` summing to 1)."""

    __slots__ = ("_seg", "cap", "ps", "xs")

    def __init__(self, xs: Sequence[float], ps: Sequence[float], cap: float = math.inf) -> None:
        hi = cap if math.isfinite(cap) else math.inf
        pts = sorted((min(max(1.0, float(x)), hi), p) for x, p in zip(xs, ps) if p > 0)
        if not pts:
            raise ValueError("a length belief needs at least one point of positive probability")
        total = math.fsum(p for _, p in pts)
        self.xs = tuple(x for x, _ in pts)
        self.ps = tuple(p / total for _, p in pts)
        self.cap = cap
        self._seg: list | None = None  # [k, next point, tail mass, sum p*x over the tail, last point below, {q: quantile}]

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def point(cls, length: float, cap: float = math.inf) -> LengthBelief:
        return cls((length,), (1.0,), cap)

    @classmethod
    def from_buckets(cls, edges: Sequence[int], probs: Sequence[float], cap: float = math.inf) -> LengthBelief:
        """A bucket distribution (tops of all buckets but the last, open one), each bucket's mass spread over
        :data:`SUB_POINTS` points inside it; the open bucket reaches twice its floor (or the cap, if lower)."""
        lows = (0, *edges)
        xs: list[float] = []
        ps: list[float] = []
        for i, p in enumerate(probs):
            lo = lows[i]
            hi = edges[i] if i < len(edges) else max(lo + 1, min(2 * lo, cap) if math.isfinite(cap) else 2 * lo)
            for s in range(SUB_POINTS):
                xs.append(lo + (s + 0.5) * (hi - lo) / SUB_POINTS)
                ps.append(p / SUB_POINTS)
        return cls(xs, ps, cap)

    @classmethod
    def scaled(cls, length: float, ratios: Sequence[float], cap: float = math.inf) -> LengthBelief:
        """A point prediction with the error its predictor has shown: ``length`` times each measured ratio of
        actual to predicted length, equally likely."""
        if not ratios:
            return cls.point(length, cap)
        return cls([length * r for r in ratios], [1.0] * len(ratios), cap)

    @classmethod
    def mixture(cls, parts: Sequence[tuple[float, LengthBelief]], cap: float = math.inf) -> LengthBelief:
        """``sum(w * belief)`` over ``parts`` (weights need not sum to 1; zero weights are skipped)."""
        xs: list[float] = []
        ps: list[float] = []
        for w, b in parts:
            if w > 0:
                xs.extend(b.xs)
                ps.extend(w * p for p in b.ps)
        return cls(xs, ps, cap)

    def mass_near(self, length: float) -> float:
        """The probability of the half-octave ``[2^(k/2), 2^((k+1)/2))`` that holds ``length``: how likely the belief
        found the length that came, at the resolution a length prediction has."""
        k = math.floor(2 * math.log2(max(1.0, length)))
        return math.fsum(p for x, p in zip(self.xs, self.ps) if math.floor(2 * math.log2(x)) == k)

    # -- reading it at an age --------------------------------------------------------------------------------------
    def _segment(self, age: int) -> list:
        """[k, next point, tail mass, sum p*x over the tail, point below, quantiles] for the points above ``age``,
        cached for the segment ``age`` is in (the conditional distribution changes only when a point is passed)."""
        seg = self._seg
        if seg is not None and seg[4] <= age < seg[1]:
            return seg
        xs, ps = self.xs, self.ps
        k = bisect.bisect_right(xs, age)
        mass = math.fsum(ps[k:])
        px = math.fsum(p * x for p, x in zip(ps[k:], xs[k:]))
        seg = [k, xs[k] if k < len(xs) else math.inf, mass, px, xs[k - 1] if k else -math.inf, {}]
        self._seg = seg
        return seg

    def outlived(self, age: int) -> bool:
        """True once the request is longer than every point: the belief has nothing left to say."""
        return age >= self.xs[-1]

    def mean_total(self, age: int) -> float:
        """``E[L | L > age]``; past the last point, doubling (the request needs as much again as it has written)."""
        k, _, mass, px = self._segment(age)[:4]
        if k >= len(self.xs) or mass <= 1e-12:
            return float(self._beyond(age))
        return px / mass

    def quantile_total(self, age: int, q: float) -> float:
        """The ``q`` quantile of ``L | L > age``."""
        seg = self._segment(age)
        k, mass, cache = seg[0], seg[2], seg[5]
        if k >= len(self.xs) or mass <= 1e-12:
            return float(self._beyond(age))
        hit = cache.get(q)
        if hit is not None:
            return hit
        target = q * mass - 1e-12
        acc = 0.0
        xs, ps = self.xs, self.ps
        out = float(xs[-1])
        for i in range(k, len(xs)):
            acc += ps[i]
            if acc >= target:
                out = float(xs[i])
                break
        cache[q] = out
        return out

    def quantile_span(self, age: int, q: float) -> tuple[float, float, float]:
        """``(lo, hi, quantile_total(age, q))``: the quantile holds for every age in ``[lo, hi)``, so a caller that
        asks every step keeps it until the age leaves the span."""
        seg = self._segment(age)
        if seg[0] >= len(self.xs):
            return age, age + 1, self.quantile_total(age, q)
        return seg[4], seg[1], self.quantile_total(age, q)

    def remaining(self, age: int, q: float | None = None) -> float:
        """Tokens still to come: the conditional mean, or its ``q`` quantile; at least one."""
        total = self.mean_total(age) if q is None else self.quantile_total(age, q)
        return max(1.0, total - age)

    def _beyond(self, age: int) -> int:
        return int(min(2 * max(age, 8), self.cap)) if math.isfinite(self.cap) else 2 * max(age, 8)

    def gittins_rank(self, age: int, weighted: bool) -> float:
        """Lower runs first: ``min over stopping points x of E[min(L, x) - age | L > age] / E[w(L) 1{L <= x} | L > age]``,
        ``w(L) = 1/L`` when ``weighted`` (mean normalised latency; deadlines proportional to length), else 1 (mean
        response time). With one point left it is the remaining length (times the length when weighted): SRPT."""
        k, _, mass = self._segment(age)[:3]
        xs, ps = self.xs, self.ps
        if k >= len(xs) or mass <= 1e-12:
            rem = self._beyond(age) - age
            return float(rem * (self._beyond(age) if weighted else 1))
        best = math.inf
        done_p = 0.0   # P(age < L <= x_j), unnormalised
        done_px = 0.0  # sum p_i x_i over those
        done_w = 0.0   # sum p_i w(x_i) over those
        for j in range(k, len(xs)):
            x, p = xs[j], ps[j]
            done_p += p
            done_px += p * x
            done_w += p / x if weighted else p
            work = (done_px - done_p * age) + (mass - done_p) * (x - age)
            best = min(best, work / done_w)
        return best
