"""Placement policies behind one interface, chosen by name (Aladdin §3–§4).

``choose(instances, job, now, exclude)`` returns the index of the instance to use, or None when no
healthy instance outside ``exclude`` is left. A policy reads only :class:`Instance` views; its
``stats`` count what the comparison needs (Aladdin's "would open a new instance" events, the
constraint that rejected each candidate).

* ``round-robin``: each healthy instance in turn.
* ``jsq`` (alias ``least-outstanding``): fewest outstanding requests, then fewest predicted tokens owed.
* ``least-kv``: fewest context tokens held or queued (prompt + generated), no prediction: the KV-aware router
  a production fleet would try before any length predictor, so a predictor's gain is measured against it.
* ``p2c``: TetriInfer's dispatcher: two instances drawn at random from those with room for the job's
  predicted KV, the one whose heavy:light decode mix stays lowest.
* ``aladdin``: Alg. 1 best fit: the most loaded instance (capacity_norm) that still meets every
  constraint; otherwise the least loaded, counted as ``would_open``.
* ``lengthwise-pack``: Aladdin's best fit (and its re-balancing), trying last the instances that still have a
  prompt to prefill, and with several gateway replicas each replica's own share of the fleet first.
* ``lengthwise``: Aladdin's constraints with the opposite choice: the least loaded feasible instance (with several
  gateway replicas, one of the two least loaded). Spreading the predicted work keeps every batch small and keeps
  prompts' prefills apart on a colocated fleet, and the random pick of two keeps gateway replicas with stale views
  from herding. In a
  decode pool with long contexts best fit (``lengthwise-pack``) serves more: packing keeps instances free
  for them (docs/results/placement.md, "Aladdin's best fit and lengthwise-pack on the whole trace");
  ``lengthwise bench placement`` measures which wins.
"""

from __future__ import annotations

import itertools
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence

from serving.placement.limits import Limits
from serving.placement.state import Instance, Job


class PlacementError(ValueError):
    """Unknown placement name, or one that needs instance limits it was not given."""


class Placement(ABC):
    name: str = "base"
    needs_limits: bool = False
    rebalances: bool = False
    uses_replica: bool = False  # takes ``replica=(index, count)``: which gateway replica it decides for

    def __init__(self, limits: Limits | None = None, seed: int = 0) -> None:
        if self.needs_limits and limits is None:
            raise PlacementError(f"placement {self.name!r} needs the instances' limits (KV capacity, latency model)")
        self.limits = limits
        self.stats: Counter[str] = Counter()

    @staticmethod
    def candidates(instances: Sequence[Instance], exclude: frozenset[str]) -> list[int]:
        return [i for i, e in enumerate(instances) if e.healthy and e.name not in exclude]

    def choose(self, instances: Sequence[Instance], job: Job, now: float = 0.0,
               exclude: frozenset[str] = frozenset()) -> int | None:
        ok = self.candidates(instances, exclude)
        if not ok:
            self.stats["no_instance"] += 1
            return None
        self.stats["placed"] += 1
        return self._choose(instances, ok, job, now)

    @abstractmethod
    def _choose(self, instances: Sequence[Instance], ok: list[int], job: Job, now: float) -> int: ...


class RoundRobin(Placement):
    name = "round-robin"

    def __init__(self, limits: Limits | None = None, seed: int = 0) -> None:
        super().__init__(limits, seed)
        self._next = 0

    def _choose(self, instances, ok, job, now):
        n = len(instances)
        i = min(ok, key=lambda k: (k - self._next) % n)
        self._next = i + 1
        return i


class LeastOutstanding(Placement):
    """Join the shortest queue; ties rotate, so an idle fleet fills evenly rather than from the first instance."""

    name = "jsq"

    def __init__(self, limits: Limits | None = None, seed: int = 0) -> None:
        super().__init__(limits, seed)
        self._turn = itertools.count()

    def _load(self, inst: Instance) -> tuple[float, ...]:
        return inst.outstanding, inst.outstanding_tokens

    def _choose(self, instances, ok, job, now):
        n = len(instances)
        start = next(self._turn) % n
        return min(ok, key=lambda i: (*self._load(instances[i]), (i - start) % n))


class LeastKV(LeastOutstanding):
    """Fewest KV tokens (prompt + generated of every request placed there), then fewest requests; ties rotate.

    Needs no prediction: long contexts are kept apart by what they already hold. In a decode pool, where a
    step's cost is its decodes' KV reads, this is what separates the length-aware placements from JSQ.
    """

    name = "least-kv"

    def _load(self, inst: Instance) -> tuple[float, ...]:
        return sum(j.context for j in inst.jobs.values()), inst.outstanding


class PowerOfTwo(Placement):
    """TetriInfer §3.3's decode dispatcher: random pair among instances with room, least heavy-decode interference.

    A job is *heavy* when its predicted output reaches ``heavy_tokens`` (TetriInfer splits decodes by
    predicted length bucket). With limits, "room" is the projected KV peak; without, every healthy
    instance qualifies.
    """

    name = "p2c"

    def __init__(self, limits: Limits | None = None, seed: int = 0, heavy_tokens: int = 256) -> None:
        super().__init__(limits, seed)
        self.rng = random.Random(seed)
        self.heavy_tokens = heavy_tokens

    def _ratio(self, inst: Instance, job: Job) -> tuple[float, int]:
        heavy = sum(j.planned_len >= self.heavy_tokens for j in inst.jobs.values()) + (job.planned_len >= self.heavy_tokens)
        n = inst.outstanding + 1
        return heavy / n, n

    def _choose(self, instances, ok, job, now):
        room = ok
        if self.limits is not None:
            lim = self.limits
            room = [i for i in ok if lim.kv_peak_blocks(instances[i].jobs.values(), job) <= lim.kv_room_blocks(instances[i])]
            if not room:
                self.stats["no_room"] += 1
                room = ok
        pair = self.rng.sample(room, 2) if len(room) >= 2 else room
        return min(pair, key=lambda i: self._ratio(instances[i], job))


class Aladdin(Placement):
    """Alg. 1: best fit on capacity_norm under constraints (b)–(e); ties broken by index for determinism."""

    name = "aladdin"
    needs_limits = True
    rebalances = True

    def _order(self, instances: Sequence[Instance], ok: list[int], load: dict[int, float]) -> list[int]:
        """The order in which candidates are tried: most loaded first."""
        return sorted(ok, key=lambda i: (-load[i], i))

    def _choose(self, instances, ok, job, now):
        lim = self.limits
        assert lim is not None
        load = {i: lim.capacity_norm(instances[i]) for i in ok}
        for i in self._order(instances, ok, load):
            why = lim.violation(instances[i], job, now)
            if why is None:
                return i
            self.stats[f"rejected_{why}"] += 1
        self.stats["would_open"] += 1  # Aladdin opens a new worker here; a fixed fleet takes the least loaded
        return min(ok, key=lambda i: (load[i], i))


class Pack(Aladdin):
    """Ours: Aladdin's best fit, trying last the instances that still have a prompt to prefill, and with several
    gateway replicas each replica's own share of the fleet first.

    Best fit fills the loaded instances to their limits and keeps the others nearly empty, so a long context
    finds room when it lands: in a decode pool that is what saves instances. On a colocated fleet plain best
    fit also stacks new prompts on the instance that is already prefilling one, and every decode there waits
    for both; trying the instances with no prefill pending first keeps the packing and parts the prefills.

    Replicas see each other's requests only through the engines' metrics, so plain best fit from each of them
    packs the same instances at once (it herds). Replica ``index`` of ``count`` tries the instances ``i`` with
    ``i % count == index`` first, which it alone fills between reads, and the others' only when none of its own
    is feasible. Every replica must list the instances in the same order.
    """

    name = "lengthwise-pack"
    uses_replica = True

    def __init__(self, limits: Limits | None = None, seed: int = 0, replica: tuple[int, int] = (0, 1)) -> None:
        super().__init__(limits, seed)
        index, count = replica
        if not (count >= 1 and 0 <= index < count):
            raise PlacementError(f"replica {index} of {count}: the index must be in [0, count) and count at least 1")
        self.replica = (index, count)

    def _order(self, instances, ok, load):
        me, count = self.replica
        prefilling = {i for i in ok if any(j.first_token_at is None for j in instances[i].jobs.values())}
        return sorted(ok, key=lambda i: (i % count != me, i in prefilling, -load[i], i))


class Spread(Aladdin):
    """Ours: Aladdin's constraints, then the least loaded feasible instance; with several gateway replicas, a random one
    of the two least loaded.

    Least loaded rather than most (no instance is saved by packing a fixed fleet). A lone gateway counts its own
    requests the moment it sends them, so its view is fresh and the least loaded is the right pick; choosing at random
    between two there only throws away what it knows (with two instances, it is a coin flip). Several gateway replicas
    see each other's requests only at their metrics refresh, and all of them sending to the same least-loaded instance
    in between is the herding that choosing among two breaks (measured in ``lengthwise bench placement --gateways``).
    """

    name = "lengthwise"
    uses_replica = True

    def __init__(self, limits: Limits | None = None, seed: int = 0, replica: tuple[int, int] = (0, 1)) -> None:
        super().__init__(limits, seed)
        self.rng = random.Random(seed)
        self.shared = replica[1] > 1  # other gateway replicas send to the same instances unseen between refreshes

    def _choose(self, instances, ok, job, now):
        lim = self.limits
        assert lim is not None
        load = {i: lim.capacity_norm(instances[i]) for i in ok}
        feasible: list[int] = []
        for i in sorted(ok, key=lambda i: (load[i], i)):
            why = lim.violation(instances[i], job, now)
            if why is None:
                feasible.append(i)
                if not self.shared:
                    return i
                if len(feasible) == 2:
                    return self.rng.choice(feasible)
            else:
                self.stats[f"rejected_{why}"] += 1
        if feasible:
            return feasible[0]
        self.stats["would_open"] += 1
        return min(ok, key=lambda i: (load[i], i))


_ALIASES = {"least-outstanding": "jsq", "power-of-two": "p2c", "rr": "round-robin"}
PLACEMENTS: dict[str, type[Placement]] = {p.name: p for p in (RoundRobin, LeastOutstanding, LeastKV, PowerOfTwo, Aladdin, Pack,
                                                               Spread)}


def placement_names() -> list[str]:
    return list(PLACEMENTS)


def make_placement(name: str, limits: Limits | None = None, seed: int = 0, replica: tuple[int, int] = (0, 1)) -> Placement:
    """The placement called ``name``; ``replica`` (index, count of gateway replicas) reaches those that use it."""
    key = _ALIASES.get(name.strip().lower(), name.strip().lower())
    if key not in PLACEMENTS:
        raise PlacementError(f"unknown placement {name!r}; choose one of: {', '.join(PLACEMENTS)}")
    cls = PLACEMENTS[key]
    return cls(limits, seed, replica=replica) if cls.uses_replica else cls(limits, seed)
