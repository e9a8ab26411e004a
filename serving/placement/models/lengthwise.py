"""Our placement of a fleet's models: pack them by what their requests will hold, as the length predictor sees it.

Each model's demand is estimated from its own predicted lengths (its mean prompt and output), not the fleet's
average. Models that share a mesh share its HBM bandwidth, so their reads stretch by a common factor; a stretched
model settles at a larger decode batch (Little's law: ``B = rate x O x t_step(B)``, its steps also waiting out the
prefills), which reads its weights for more tokens at once. A mesh holds a set of models where some stretch lets
the bandwidth they draw (their reads over their step times, and their prefills' share of the time) sum to at most the
mesh's, every batch stays under vLLM's 256 and its KV (the batch's 99th percentile, each request holding its prompt
and half its answer) fits beside the weights, and no model's steps take longer than ``slowdown`` times its decode
alone on its smallest mesh (what its SLO is measured against).

For a slowdown, each model gets the fewest GPUs that carry it alone (a mesh size and its replicas, which split its
requests); the pieces, most demanding first, then go onto the mesh they fit that is left most stretched (best
fit), else onto a new mesh of their own. The placement bisects the slowdown down to the least whose meshes fit the
cluster's nodes: given GPUs to spare, it spends them on larger meshes that run the models faster. Within a mesh,
each model's KV quota is its predicted KV and its decode SM share its share of the bandwidth drawn.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from serving.perf.latency import StepShape
from serving.placement.models.estimate import ACTIVATION_GB, GB, MAX_BATCH, MEMORY_UTILISATION, Demand, Estimator
from serving.placement.models.muxserve import MESH_SIZES
from serving.placement.models.plan import Plan, Unit, UnitModel

KV_QUANTILE = 2.33  # KV held for the batch's 99th percentile, its count taken as Poisson
MIN_DECODE_SM = 0.3  # the smallest decode share MuxServe's own placements give
MAX_REPLICAS = 8
MAX_SLOWDOWN = 8.0  # MuxServe's SLO scale: a request slowed past it misses however short its queue
MIN_SLOWDOWN = 0.25  # given GPUs to spare, larger meshes run a model's steps faster than alone on its smallest
STRETCHES = np.geomspace(1.0, 16.0, 49)  # the stretches a mesh is tried at


@dataclass(frozen=True)
class Fit:
    """One model (or one replica's ``share`` of it) on a mesh of ``gpus``, at each of :data:`STRETCHES`: the share
    of the mesh's bandwidth it draws, its slowdown against its decode alone on its smallest mesh, and its KV."""

    demand: Demand
    gpus: int
    share: float
    draw: np.ndarray
    slowdown: np.ndarray
    kv_gb: np.ndarray

    def memory_gb(self, k: int) -> float:
        return self.demand.weights_gb + ACTIVATION_GB + float(self.kv_gb[k])


def fit_on(est: Estimator, d: Demand, gpus: int, share: float, base_gpus: int) -> Fit:
    """``share`` of ``d``'s requests on a mesh of ``gpus`` at every stretch of its HBM reads (infinite draw where its
    batch outgrows :data:`MAX_BATCH` or never settles). A stretched decode step is ``max(compute, stretch x reads) +
    overhead``: the per-step overhead (launches, tensor parallelism's dispatch) is not the bandwidth's to share."""
    c = est.costs(d, gpus)
    lat = c.latency
    alone = est.costs(d, base_gpus).decode(1, 1.0)
    rate = d.rate * share

    def step(b: int, stretch: float) -> tuple[float, float]:
        compute, reads = lat.parts(StepShape(0, b, b * c.context, b))
        return max(compute, stretch * reads) + lat.overhead_s, reads

    prefilling = rate * c.prefill(1, 1.0)  # the share of the time its prefills hold the mesh (one at a time)
    draw, slow, kv = (np.full(len(STRETCHES), np.inf) for _ in range(3))
    if prefilling >= 1:
        return Fit(d, gpus, share, draw, slow, kv)
    for k, stretch in enumerate(STRETCHES):
        batch = 1.0  # requests in decode on average; under 1, the share of the time it has any
        for _ in range(60):
            # a token comes every stretched step, and the steps wait out the prefills
            nxt = rate * d.output_len * step(max(1, math.ceil(batch)), stretch)[0] / (1 - prefilling)
            if nxt > MAX_BATCH or abs(nxt - batch) < 0.05:
                batch = nxt
                break
            batch = nxt
        if batch > MAX_BATCH:
            continue
        t, reads = step(max(1, math.ceil(batch)), stretch)
        draw[k] = (1 - prefilling) * reads / t * min(1.0, batch) + prefilling
        slow[k] = t / alone
        # a request holds its prompt and, on average over its answer, half of it; the batch a Poisson stream keeps
        # in flight passes its mean by 2.33 standard deviations 1% of the time
        kv[k] = (batch + KV_QUANTILE * math.sqrt(batch)) * (d.prompt_len + d.output_len / 2) * d.kv_bytes_per_token / GB
    return Fit(d, gpus, share, draw, slow, kv)


@dataclass
class _Mesh:
    gpus: int
    capacity_gb: float
    fits: list[Fit] = field(default_factory=list)

    def stretch_index(self, extra: Fit | None, slowdown: float) -> int | None:
        """The least stretch at which the mesh (with ``extra``) draws at most its bandwidth, every model within
        ``slowdown`` and the memory within its capacity; None where none does."""
        fits = self.fits + ([extra] if extra is not None else [])
        draw = np.sum([f.draw for f in fits], axis=0)
        ok = (draw <= 1.0) & np.all([f.slowdown <= slowdown for f in fits], axis=0)
        for k in np.flatnonzero(ok):
            if sum(f.memory_gb(int(k)) for f in fits) <= self.capacity_gb:
                return int(k)
        return None


def smallest_mesh(d: Demand, gpu_gb: float) -> int:
    """The fewest GPUs of a mesh whose memory holds the model's weights with room for activations."""
    for g in MESH_SIZES[::-1]:
        if d.weights_gb + ACTIVATION_GB < MEMORY_UTILISATION * gpu_gb * g:
            return g
    raise ValueError(f"{d.name}: {d.size} does not fit {MESH_SIZES[0]} GPUs of {gpu_gb:g} GB")


class _Packer:
    """The packing at a slowdown, with every model's fits computed once and kept across the bisection."""

    def __init__(self, est: Estimator, demands: list[Demand], gpu_gb: float) -> None:
        self.est, self.demands, self.gpu_gb = est, demands, gpu_gb
        self._fits: dict[tuple[str, int, float], Fit] = {}
        self.base = {d.name: smallest_mesh(d, gpu_gb) for d in demands}

    def fit(self, d: Demand, gpus: int, share: float) -> Fit:
        key = (d.name, gpus, share)
        if key not in self._fits:
            self._fits[key] = fit_on(self.est, d, gpus, share, self.base[d.name])
        return self._fits[key]

    def alone(self, d: Demand, gpus: int, share: float, slowdown: float) -> bool:
        return _Mesh(gpus, MEMORY_UTILISATION * self.gpu_gb * gpus).stretch_index(self.fit(d, gpus, share),
                                                                                  slowdown) is not None

    def replicas(self, d: Demand, slowdown: float) -> tuple[int, int] | None:
        """(mesh size, replicas) of the fewest GPUs that carry ``d`` alone within ``slowdown`` (fewer replicas on a
        tie); None where no mesh of 8 GPUs over :data:`MAX_REPLICAS` replicas does."""
        best = None
        for g in MESH_SIZES[::-1]:
            if g < self.base[d.name]:
                continue
            r = next((r for r in range(1, MAX_REPLICAS + 1) if self.alone(d, g, 1 / r, slowdown)), None)
            if r is not None and (best is None or (g * r, r) < (best[0] * best[1], best[1])):
                best = (g, r)
        return best

    def pack(self, slowdown: float) -> list[_Mesh] | None:
        """Every model's replicas packed in descending draw: each onto the mesh it fits that is left most stretched
        (best fit), else onto a new mesh of its own size; None where a model fits no mesh alone."""
        pieces = []
        for d in self.demands:
            way = self.replicas(d, slowdown)
            if way is None:
                return None
            g, r = way
            pieces += [(d, 1 / r, g)] * r
        pieces.sort(key=lambda p: -float(self.fit(p[0], p[2], p[1]).draw[0]))
        meshes: list[_Mesh] = []
        for d, share, g in pieces:
            best: tuple[int, int] | None = None  # (stretch index with it, mesh index)
            for i, m in enumerate(meshes):
                if m.gpus < self.base[d.name] or any(f.demand.name == d.name for f in m.fits):
                    continue
                k = m.stretch_index(self.fit(d, m.gpus, share), slowdown)
                if k is not None and (best is None or k > best[0]):
                    best = (k, i)
            if best is not None:
                meshes[best[1]].fits.append(self.fit(d, meshes[best[1]].gpus, share))
            else:
                meshes.append(_Mesh(g, MEMORY_UTILISATION * self.gpu_gb * g, [self.fit(d, g, share)]))
        return meshes


def fits_nodes(sizes: list[int], gpus: int, per_node: int = 8) -> bool:
    """Whether meshes of these sizes go into a cluster of ``gpus`` (full nodes of ``per_node`` first), each mesh
    within one node: first fit in descending size."""
    full, rest = divmod(gpus, per_node)
    free = [per_node] * full + ([rest] if rest else [])
    for size in sorted(sizes, reverse=True):
        for i, f in enumerate(free):
            if f >= size:
                free[i] -= size
                break
        else:
            return False
    return True


def place_lengthwise(demands: list[Demand], gpus: int, est: Estimator, gpu_gb: float = 80.0,
                     per_node: int = 8, steps: int = 14) -> Plan | None:
    """Our placement of ``demands`` on ``gpus`` GPUs: the least slowdown whose packing fits the cluster's nodes, by
    bisection; None where even :data:`MAX_SLOWDOWN` does not."""
    t0 = time.perf_counter()
    packer = _Packer(est, demands, gpu_gb)

    def packed(slowdown: float) -> list[_Mesh] | None:
        meshes = packer.pack(slowdown)
        return meshes if meshes is not None and fits_nodes([m.gpus for m in meshes], gpus, per_node) else None

    lo, hi = MIN_SLOWDOWN, MAX_SLOWDOWN
    best = packed(hi)
    if best is None:
        return None
    for _ in range(steps):
        mid = (lo + hi) / 2
        meshes = packed(mid)
        if meshes is None:
            lo = mid
        else:
            hi, best = mid, meshes
    units = []
    for m in sorted(best, key=lambda m: -m.gpus):
        k = m.stretch_index(None, hi)
        assert k is not None
        kv = sum(float(f.kv_gb[k]) for f in m.fits)
        draw = sum(float(f.draw[k]) for f in m.fits)
        pool = m.capacity_gb - sum(f.demand.weights_gb + ACTIVATION_GB for f in m.fits)
        units.append(Unit(m.gpus, pool / (m.gpus * gpu_gb), tuple(
            UnitModel(f.demand.name, f.demand.size, m.gpus, 1.0, min(0.9, max(MIN_DECODE_SM, float(f.draw[k]) / draw)),
                      MAX_BATCH, rate_share=f.share, kv_share=float(f.kv_gb[k]) / kv)
            for f in m.fits)))
    return Plan("lengthwise", tuple(units), time.perf_counter() - t0,
                {"slowdown": hi, "unused_gpus": gpus - sum(m.gpus for m in best)})


def still_fits(plan: Plan, demands: list[Demand], est: Estimator, gpu_gb: float = 80.0) -> bool:
    """Whether ``plan``'s meshes carry ``demands`` (the rates of a later window) within the slowdown the plan was made
    at: what it was sized for still holds, so moving a model would buy nothing the plan does not give."""
    by_name = {d.name: d for d in demands}
    slowdown = float(plan.notes.get("slowdown", MAX_SLOWDOWN))
    packer = _Packer(est, demands, gpu_gb)
    for u in plan.units:
        mesh = _Mesh(u.gpus, MEMORY_UTILISATION * gpu_gb * u.gpus,
                     [packer.fit(by_name[m.name], u.gpus, m.rate_share) for m in u.models])
        if mesh.stretch_index(None, slowdown) is None:
            return False
    return True
