"""The late tier: a waiting request that can no longer meet its deadline yields to those that still can.

Goodput counts requests that finish inside their SLO. Under overload a queue ordered by predicted RL
(or FCFS) keeps starting requests that have already waited past hope; each of them holds KV and batch
slots for its whole RL and still misses, while requests behind it that could have made it wait and miss
too. So when a request reaches the head of the queue, its finish is projected at the engine's current
pace: ``now + (prefill steps + predicted remaining RL) × TBT``, where TBT (time between tokens) is a
moving average of the measured step interval while requests decode. If that lands past its deadline,
it is *late*: it moves behind every request that can still make it. Nothing is dropped: late requests
run whenever no on-time request is waiting (the policy stays work-conserving), and a request that has
waited ``aging_s`` returns to the on-time tier for good, so the aging bound on starvation still holds.

The test is made at the head only, when the request is about to be admitted: that is when its
projection is freshest, and each request is demoted at most once (O(log n) each).
"""

from __future__ import annotations

import heapq
import math

from serving.policy.request import Request


class LateTier:
    """Who is late, the TBT estimate the test uses, and when a late request's aging brings it back."""

    def __init__(self, aging_s: float, margin: float = 1.0, smoothing: float = 0.1) -> None:
        self.aging_s, self.margin, self.smoothing = aging_s, margin, smoothing
        self.tbt: float | None = None  # seconds per step while decoding; None until measured (nobody is late)
        self.late: set[int] = set()
        self.aged: set[int] = set()  # back from the late tier after aging_s: never demoted again
        self._returns: list[tuple[float, int]] = []  # (time it returns, rid), a heap
        self._last: float | None = None

    def observe(self, now: float, decoding: bool) -> None:
        """One step starts at ``now``; ``decoding``: the previous step ran requests (its interval is a TBT)."""
        if self._last is not None and decoding and now > self._last:
            dt = now - self._last
            self.tbt = dt if self.tbt is None else self.tbt + self.smoothing * (dt - self.tbt)
        self._last = now

    def projected_finish(self, req: Request, now: float, remaining: int, budget: int) -> float:
        """When ``req`` would finish if admitted now, at the measured pace."""
        if self.tbt is None:
            return now
        prefill_steps = math.ceil(req.uncomputed / max(1, budget))
        return now + self.margin * (prefill_steps + max(1, remaining)) * self.tbt

    def is_late(self, req: Request, now: float, remaining: int, budget: int) -> bool:
        # one that has already waited aging_s is back for good, even if it reaches the head only now
        if req.rid in self.late or req.rid in self.aged or math.isinf(req.deadline) or now >= req.arrival + self.aging_s:
            return False
        return self.projected_finish(req, now, remaining, budget) > req.deadline

    def demote(self, req: Request) -> None:
        self.late.add(req.rid)
        heapq.heappush(self._returns, (req.arrival + self.aging_s, req.rid))

    def due(self, now: float) -> list[int]:
        """Late requests whose wait reached ``aging_s``: they return to the on-time tier (the caller re-queues them)."""
        back = []
        while self._returns and self._returns[0][0] <= now:
            _, rid = heapq.heappop(self._returns)
            if rid in self.late:
                self.late.discard(rid)
                self.aged.add(rid)
                back.append(rid)
        return back

    def forget(self, rid: int) -> None:
        """``rid`` finished or was aborted (its heap entry is skipped when it comes due)."""
        self.late.discard(rid)
        self.aged.discard(rid)
