"""Which engine gets a request: one small interface, implementations registered by name.

A placement sees only plain data (each engine's health, outstanding requests and the predicted tokens
they still owe, and the new request's prediction and deadline), never HTTP, so the same objects can be
driven by the simulator, and Aladdin's bin packing (SPEC §7) slots in as one more entry in
:data:`PLACEMENTS`.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class EngineLoad(Protocol):
    """What a placement may read about an engine."""

    name: str
    healthy: bool
    outstanding: int  # requests sent and not yet answered in full
    outstanding_tokens: int  # their predicted output tokens


@dataclass(frozen=True, slots=True)
class Placed:
    """The request being placed."""

    pred_tokens: int
    deadline: float


class Placement(ABC):
    name: str

    @abstractmethod
    def choose(self, engines: Sequence[EngineLoad], request: Placed, exclude: frozenset[str] = frozenset()) -> int | None:
        """Index of the engine to use, or None when no healthy engine outside ``exclude`` is left."""


class LeastOutstanding(Placement):
    """Join the shortest queue (JSQ): fewest outstanding requests, then fewest predicted tokens owed.

    Ties rotate, so an idle fleet is filled evenly rather than always from the first engine.
    """

    name = "least-outstanding"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, engines, request, exclude=frozenset()):
        ok = [i for i, e in enumerate(engines) if e.healthy and e.name not in exclude]
        if not ok:
            return None
        start = next(self._turn) % len(engines)
        return min(ok, key=lambda i: (engines[i].outstanding, engines[i].outstanding_tokens, (i - start) % len(engines)))


class RoundRobin(Placement):
    """Each healthy engine in turn (the baseline that ignores load)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, engines, request, exclude=frozenset()):
        for k in range(len(engines)):
            i = (self._next + k) % len(engines)
            if engines[i].healthy and engines[i].name not in exclude:
                self._next = i + 1
                return i
        return None


PLACEMENTS: dict[str, type[Placement]] = {p.name: p for p in (LeastOutstanding, RoundRobin)}


def make_placement(name: str) -> Placement:
    try:
        return PLACEMENTS[name]()
    except KeyError:
        raise ValueError(f"unknown placement {name!r}; choose one of: {', '.join(PLACEMENTS)}") from None
