"""KVC pipelining (EcoServe §3.4): hosted GTs borrow the unused tail of a host's exact allocation.

A GT admitted with ``L`` tokens of allocation writes them front to back, one per step. The second half
of its region is idle for ``L/2`` steps, so a GT whose (padded) RL is at most ``L/2 − b`` can run there
and be gone before the host's write pointer arrives. The same holds recursively, like nested dolls:
the host's first half ``[0, L/2)`` can lend its second quarter, and each hosted GT can lend the second
half of its own span. ``b`` (the buffer) absorbs under-prediction of the hosted GT.

A hosted GT that is still running when its host reaches it must move out: it gets blocks of its own
if the pool has them, otherwise it is preempted (recompute). If a host finishes first, the blocks of
every live hosted span pass to the hosted GT, so no block is ever freed while someone writes in it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Lend:
    """A span of ``writer``'s region lent to ``hosted``: the writer reaches it after ``offset`` tokens."""

    writer: int
    hosted: int
    offset: int
    length: int


def nested_slots(length: int, buffer: float, depth: int) -> list[tuple[int, int, int]]:
    """Slots ``(offset, max_length, level)`` a region of ``length`` tokens can lend, halves first.

    Only the writer's own chain is listed (second half, second quarter, ...); spans lent to hosted GTs
    are expanded by the caller once the hosted GT's real length is known.
    """
    slots = []
    size = length
    for level in range(1, depth + 1):
        half = size // 2
        limit = half - int(buffer * size)
        if limit <= 0:
            break
        slots.append((half, limit, level))
        size = half
    return slots
