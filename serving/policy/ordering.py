"""EcoServe's queue ordering (§3.3) and the binary search that finds a task that fits.

Tasks are ordered by three factors, each in magnitude ranges: (1) deadline, ascending — the JCT SLO
must be met first; (2) occupied KV, descending — running it releases KV sooner; (3) predicted RL for
GTs, prompt length for PTs, descending — long tasks first so few picks fill the resource. A leading
*tier* puts requests that already made progress (paused or preempted) ahead of new ones, as the paper's
"regroup at higher priority".

Keys are static while a task waits, so the queue is a sorted list: insertion O(log n) search, and
within a run of equal (tier, deadline range, KV range) the lengths are sorted, so the task whose length
is closest below what still fits is one binary search away.
"""

from __future__ import annotations

import math

from serving.policy.config import PolicyConfig
from serving.policy.request import SortedQueue

_FAR = 1 << 40


def order_key(cfg: PolicyConfig, tier: int, deadline: float, occupied_tokens: int, length: int, ordered: bool) -> tuple:
    """Sort key of a waiting task; without ordering (``ordered=False``) only the tier counts (FCFS)."""
    if not ordered:
        return (tier,)
    dbin = _FAR if math.isinf(deadline) else int(deadline // cfg.deadline_bin_s)
    return (tier, dbin, -(occupied_tokens // cfg.kv_bin_tokens), -length)


def find_fitting(queue: SortedQueue, fit_length: int, start: int = 0) -> tuple[int, int]:
    """In ordered mode, the index of the longest task with length <= ``fit_length`` in the segment at ``start``.

    Returns ``(index or -1, end of that segment)``; the caller moves on to the next segment when the
    index is -1. A segment is the run of entries sharing tier, deadline range and KV range.
    """
    prefix = queue.key(start)[:3]
    end = queue.bisect_key((*prefix, math.inf), start)
    j = queue.bisect_key((*prefix, -fit_length), start, end)
    return (j if j < end else -1), end
