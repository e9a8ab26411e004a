"""Observed output lengths, and Aladdin's re-prediction for a request that outlived its prediction.

Aladdin §4.3 re-predicts an underestimated request as the conditional mean of the output length given
it exceeds what was predicted, taken from history. The history here is the lengths of requests that
finished (the simulator's completions, the gateway's feedback), kept in a bounded window so it follows
a drifting workload.
"""

from __future__ import annotations

import bisect
from collections import deque


class LengthHistory:
    """A sliding window of finished requests' output lengths, answering E[L | L > x]."""

    def __init__(self, window: int = 4096) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self._order: deque[int] = deque()
        self._sorted: list[int] = []
        self._suffix: list[int] | None = None  # suffix sums of _sorted, rebuilt lazily
        self.window = window

    def __len__(self) -> int:
        return len(self._order)

    def add(self, length: int) -> None:
        length = int(length)
        if length < 0:
            raise ValueError(f"an output length cannot be negative, got {length}")
        self._order.append(length)
        bisect.insort(self._sorted, length)
        if len(self._order) > self.window:
            old = self._order.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        self._suffix = None

    def mean_beyond(self, x: float) -> float | None:
        """E[L | L > x] over the window, or None when no finished request was longer than ``x``."""
        i = bisect.bisect_right(self._sorted, x)
        n = len(self._sorted) - i
        if n == 0:
            return None
        if self._suffix is None:
            acc = [0] * (len(self._sorted) + 1)
            for k in range(len(self._sorted) - 1, -1, -1):
                acc[k] = acc[k + 1] + self._sorted[k]
            self._suffix = acc
        return self._suffix[i] / n

    def repredict(self, predicted: float, generated: int) -> float:
        """The total length to plan for once ``generated`` ≥ ``predicted``: history's conditional mean.

        Without history beyond that point the request is assumed to need as much again as it has
        produced (doubling), the same fallback the policy core uses.
        """
        m = self.mean_beyond(max(predicted, generated))
        return float(m) if m is not None else float(2 * max(generated, 1))
