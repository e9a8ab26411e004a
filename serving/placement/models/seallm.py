"""SeaLLM's placement (SeaLLM §4.1, Appendix A.1 Algorithm 1): GPU groups by parallelism, services allocated by
their unserved index, each plan scored by a simulator.

For each tensor-parallel size p of 1, 2, 4 and 8 the cluster is cut into groups of p GPUs within nodes; where p is
too small for a service's weights, two groups of a node are merged until every service has a group to go to. Then,
one service at a time: the simulator scores the plan so far, and the service of the highest unserved index
``UI = requests missing their SLO + alpha x normalised latency`` (an unplaced service misses all of its requests)
goes to the group of the lowest request rate that can take it (its weights fit, at most two services a group, not
there already). A service placed on several groups splits its requests between them. When no group can take any
service, the plan is scored whole; the best plan over p (attainment, then normalised latency) wins.

The scoring needs a simulator, which the policy layer does not import: the caller passes ``score``, which runs the
units it is given on a window of each service's past requests and answers, per service, its requests, those that
missed the SLO and its normalised latency. SeaLLM's adaptive re-placement interval is not built here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.placement.models.estimate import ACTIVATION_GB, GB, MAX_BATCH, MEMORY_UTILISATION, Demand
from serving.placement.models.muxserve import MESH_SIZES
from serving.placement.models.plan import Plan, Unit, UnitModel

ALPHA = 1e-3  # SeaLLM's alpha << 1: attainment first, normalised latency second
MAX_SHARED = 2  # SeaLLM shares at most two services a group
MIN_CONTEXTS, MAX_CONTEXT = 16, 2048  # a service needs KV for at least this many requests of the longest context


@dataclass(frozen=True)
class Scored:
    """One service under a plan, as the simulator saw it: its requests, those that missed the SLO, and its normalised
    latency (seconds per output token)."""

    requests: int
    missed: int
    normalised_latency: float


Score = Callable[[tuple[Unit, ...]], dict[str, Scored]]


@dataclass
class _Group:
    gpus: int
    gpu_gb: float
    services: list[Demand] = field(default_factory=list)

    def can_take(self, d: Demand) -> bool:
        """Room for ``d`` beside the group's services: a free place, and memory for every weight and for each
        service's KV of :data:`MIN_CONTEXTS` full contexts (SeaLLM's check against profiled memory use)."""
        if len(self.services) >= MAX_SHARED or any(s.name == d.name for s in self.services):
            return False
        need = sum(s.weights_gb + ACTIVATION_GB + MIN_CONTEXTS * MAX_CONTEXT * s.kv_bytes_per_token / GB
                   for s in (*self.services, d))
        return need < MEMORY_UTILISATION * self.gpu_gb * self.gpus


def groups_for(tp: int, gpus: int, demands: list[Demand], per_node: int = 8, gpu_gb: float = 80.0) -> list[_Group] | None:
    """The cluster cut into groups of ``tp`` GPUs per node (a node's rest into powers of two), then two groups of a
    node merged, smallest first, until each service too large for ``tp`` has a group of its own size; None where the
    nodes cannot give them."""
    full, rest = divmod(gpus, per_node)
    nodes: list[list[int]] = []
    for size in [per_node] * full + ([rest] if rest else []):
        parts, left = [], size
        for s in MESH_SIZES:
            while s <= min(tp, left):
                parts.append(s)
                left -= s
        nodes.append(parts)

    def need(d: Demand) -> int:
        return next((g for g in MESH_SIZES[::-1] if _Group(g, gpu_gb).can_take(d)), MESH_SIZES[0] * 2)

    for d in sorted(demands, key=need, reverse=True):
        q = need(d)
        if q <= tp:
            continue
        if q > per_node:
            return None
        taken = sum(1 for node in nodes for s in node if s >= q)
        wanted = sum(1 for x in demands if need(x) >= q)
        while taken < wanted:
            merged = False
            for node in sorted(nodes, key=lambda n: -len(n)):  # merge where a node has most groups left
                node.sort()
                small = [s for s in node if s < q]
                pair = next(((i, j) for i in range(len(node)) for j in range(i + 1, len(node))
                             if node[i] == node[j] and node[i] in small), None)
                if pair is not None:
                    i, j = pair
                    size = node[i] * 2
                    del node[j], node[i]
                    node.append(size)
                    merged = True
                    break
            if not merged:
                return None
            taken = sum(1 for node in nodes for s in node if s >= q)
    return [_Group(s, gpu_gb) for node in nodes for s in node]


def _units(groups: list[_Group]) -> tuple[Unit, ...]:
    served = {}
    for g in groups:
        for d in g.services:
            served[d.name] = served.get(d.name, 0) + 1
    units = []
    for g in groups:
        if not g.services:
            continue
        pool = MEMORY_UTILISATION * g.gpu_gb * g.gpus - sum(d.weights_gb + ACTIVATION_GB for d in g.services)
        units.append(Unit(g.gpus, pool / (g.gpu_gb * g.gpus), tuple(
            UnitModel(d.name, d.size, g.gpus, 1.0, 0.9, MAX_BATCH, rate_share=1 / served[d.name])
            for d in g.services)))
    return tuple(units)


def _index(demands: list[Demand], scored: dict[str, Scored], window_s: float) -> dict[str, float]:
    """Each service's unserved index; one not placed misses all of its requests."""
    out = {}
    for d in demands:
        s = scored.get(d.name)
        out[d.name] = d.rate * window_s if s is None else s.missed + ALPHA * s.normalised_latency
    return out


def place_seallm(demands: list[Demand], gpus: int, score: Score, window_s: float, per_node: int = 8,
                 gpu_gb: float = 80.0) -> Plan | None:
    """SeaLLM's placement of ``demands`` on ``gpus`` GPUs, each step scored by ``score``; None where no
    parallelism size places every service."""
    t0 = time.perf_counter()
    best: tuple[tuple[float, float], tuple[Unit, ...], int] | None = None
    scored_plans = 0
    for tp in MESH_SIZES[::-1]:
        groups = groups_for(tp, gpus, demands, per_node, gpu_gb)
        if groups is None:
            continue
        while True:
            ui = _index(demands, score(_units(groups)), window_s)
            scored_plans += 1
            placed = False
            # the group of the lowest request rate (per GPU); among equals the smaller, so that the large groups
            # merged for the large services are still free when their turn comes
            for g in sorted(groups, key=lambda g: (sum(d.rate for d in g.services) / g.gpus, g.gpus)):
                for d in sorted(demands, key=lambda d: -ui[d.name]):
                    if g.can_take(d):
                        g.services.append(d)
                        placed = True
                        break
                if placed:
                    break
            if not placed:
                break
        units = _units(groups)
        if {m.name for u in units for m in u.models} != {d.name for d in demands}:
            continue
        final = score(units)
        scored_plans += 1
        requests = sum(s.requests for s in final.values())
        attainment = 1 - sum(s.missed for s in final.values()) / max(1, requests)
        latency = sum(s.normalised_latency * s.requests for s in final.values()) / max(1, requests)
        key = (-attainment, latency)
        if best is None or key < best[0]:
            best = (key, units, tp)
    if best is None:
        return None
    return Plan("seallm", best[1], time.perf_counter() - t0,
                {"tp": best[2], "estimated_attainment": -best[0][0], "scored_plans": scored_plans})
