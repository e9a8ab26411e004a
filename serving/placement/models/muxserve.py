"""MuxServe's placement (MuxServe §3.2, Algorithm 1), on :class:`~serving.placement.models.estimate.Estimator`.

Every way to split the cluster's nodes into meshes of 8, 4, 2 and 1 GPUs is tried. For each, the models go in
descending computation (rate x a size scale) onto the mesh whose estimated throughput gains most, where their
memory fits and the mesh has SM percentage left for their decode share; the split of the highest estimated
throughput wins. Each model is served by one mesh. Its lengths are one mean prompt and one mean output for every
model, as MuxServe's optimiser takes them.

MuxServe's configuration also caps each model's batch (``max_num_seqs``) at the batch its estimator found just
enough for the model's rate. That is a runtime setting, not a placement: here every placement's engines keep vLLM's
256, so that what is compared is where the models go.

Memory is MuxServe's own accounting: a mesh offers 0.9 x 0.6 of its memory to weights (its default
``gpu_memory_utilization`` of 0.4 held back for KV), each model taking its weights and 7.6 GB of process and
activation memory; a mesh may be over-subscribed by 20 SM percentage points.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from serving.placement.models.estimate import ACTIVATION_GB, MAX_BATCH, PROCESS_GB, Demand, Estimator
from serving.placement.models.plan import Plan, Unit, UnitModel

MESH_SIZES = (8, 4, 2, 1)
SIZE_SCALE = {"llama-7b": 1, "llama-13b": 2, "llama-30b": 4, "llama-65b": 8}  # MuxServe's rate_scale
BASE_GPUS = {"llama-7b": 1, "llama-13b": 1, "llama-30b": 2, "llama-65b": 4}  # the smallest mesh it gives each size
PREFILL_SM = {"llama-7b": 0.8, "llama-13b": 0.9, "llama-30b": 1.0, "llama-65b": 1.0}  # its prefill MPS by size
OVERSUBSCRIBE = 0.2


def node_splits(gpus: int) -> list[tuple[int, ...]]:
    """Every multiset of mesh sizes (8, 4, 2, 1) that makes up a node of ``gpus`` GPUs, largest meshes first."""
    out: list[tuple[int, ...]] = []

    def grow(rest: int, largest: int, acc: tuple[int, ...]) -> None:
        if rest == 0:
            out.append(acc)
            return
        for s in MESH_SIZES:
            if s <= min(rest, largest):
                grow(rest - s, s, (*acc, s))
    grow(gpus, MESH_SIZES[0], ())
    return out


def mesh_groups(gpus: int, per_node: int = 8) -> Iterator[list[int]]:
    """Every split of a cluster of ``gpus`` (full nodes of ``per_node``, then what is left) into meshes within
    nodes: MuxServe's generate_candidate_clusters, which takes node splits as a multiset."""
    full, rest = divmod(gpus, per_node)
    tails = node_splits(rest) if rest else [()]
    for nodes in itertools.combinations_with_replacement(node_splits(per_node), full):
        for tail in tails:
            yield [s for node in (*nodes, tail) for s in node]


@dataclass
class _Mesh:
    gpus: int
    gpu_gb: float
    free_gb: float = 0.0
    sm_left: float = 1.0
    tag: float = 0.0  # MuxServe's computation tag: what its models' computation amortises over its GPUs, negated
    models: list[tuple[Demand, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_gb = 0.9 * (1 - 0.4) * self.gpu_gb * self.gpus

    def fits(self, d: Demand, share: float) -> bool:
        return self.free_gb >= d.weights_gb and self.sm_left + OVERSUBSCRIBE >= share

    def add(self, d: Demand, share: float) -> None:
        self.models.append((d, share))
        self.free_gb -= d.weights_gb + PROCESS_GB + ACTIVATION_GB
        self.sm_left -= share
        self.tag -= d.rate * SIZE_SCALE[d.size] / self.gpus


def _candidates(est: Estimator, d: Demand, cluster_gb: float, gpu_gb: float, used_gb: float) -> dict[int, tuple[float, int]]:
    """Per mesh size at least the model's base: its decode share and batch alone there (MuxServe's mesh candidates,
    the KV cache taken as the cluster's average memory in use over the mesh, as its optimiser does)."""
    util = used_gb / cluster_gb
    out = {}
    for g in MESH_SIZES[::-1]:
        if g >= BASE_GPUS[d.size]:
            _, share, bs, _ = est.share_for(d, g, util * gpu_gb * g)
            out[g] = (share, bs)
    return out


def _place(est: Estimator, demands: list[Demand], sizes: list[int], cand: dict[str, dict[int, tuple[float, int]]],
           gpu_gb: float) -> tuple[list[_Mesh], float] | None:
    """One mesh group: each model, in descending computation, onto the mesh of the largest estimated gain."""
    meshes = sorted((_Mesh(g, gpu_gb) for g in sizes), key=lambda m: (m.tag, m.free_gb), reverse=True)
    gains = [0.0] * len(meshes)
    for d in sorted(demands, key=lambda x: (x.rate * SIZE_SCALE[x.size], SIZE_SCALE[x.size]), reverse=True):
        best, best_gain = -1, -100.0
        for i, m in enumerate(meshes):
            if m.gpus not in cand[d.name]:
                continue
            share = cand[d.name][m.gpus][0]
            if not m.fits(d, share):
                continue
            tpt = est.mesh_throughput(m.gpus, [x for x, _ in m.models] + [d], [s for _, s in m.models] + [share],
                                      gpu_gb)[0]
            gain = tpt - gains[i]
            if gain > best_gain or (gain == best_gain and m.gpus < meshes[best].gpus):
                best, best_gain = i, gain
        if best < 0:
            return None
        meshes[best].add(d, cand[d.name][meshes[best].gpus][0])
        gains[best] += best_gain
        order = sorted(range(len(meshes)), key=lambda i: (meshes[i].tag, meshes[i].free_gb), reverse=True)
        meshes, gains = [meshes[i] for i in order], [gains[i] for i in order]
    total_tpt = total_rate = 0.0
    for m in meshes:
        if m.models:
            rate = sum(d.rate for d, _ in m.models)
            total_tpt += est.mesh_throughput(m.gpus, [d for d, _ in m.models], [s for _, s in m.models], gpu_gb)[0] * rate
            total_rate += rate
    return meshes, total_tpt / total_rate


def kv_fraction(gpus: int, demands: list[Demand], est: Estimator, gpu_gb: float) -> float:
    """The share of a mesh's memory its models' KV gets: what MuxServe's estimator planned with (its memory less
    the weights and each model's activations). Its configuration builder charges each model's process memory on
    every GPU of the mesh instead, which leaves a mesh of seven models no KV at all; its own runs never put more than
    two models on a mesh."""
    return est.mesh_cache_gb(gpus, demands, gpu_gb) / (gpus * gpu_gb)


def place_muxserve(demands: list[Demand], gpus: int, est: Estimator, gpu_gb: float = 80.0,
                   per_node: int = 8) -> Plan | None:
    """MuxServe's placement of ``demands`` on ``gpus`` GPUs; None where no mesh group holds every model."""
    t0 = time.perf_counter()
    used = sum(d.weights_gb for d in demands) + ACTIVATION_GB * len(demands)
    cand = {d.name: _candidates(est, d, gpu_gb * gpus, gpu_gb, used) for d in demands}
    need = max(BASE_GPUS[d.size] for d in demands)
    best: tuple[list[_Mesh], float] | None = None
    tried = 0
    for sizes in mesh_groups(gpus, per_node):
        if max(sizes) < need or len(sizes) > len(demands):
            continue
        tried += 1
        placed = _place(est, demands, sizes, cand, gpu_gb)
        if placed is not None and (best is None or placed[1] > best[1]):
            best = placed
    if best is None:
        return None
    units = []
    for m in sorted(best[0], key=lambda m: -m.gpus):
        if not m.models:
            continue
        units.append(Unit(m.gpus, kv_fraction(m.gpus, [d for d, _ in m.models], est, gpu_gb), tuple(
            UnitModel(d.name, d.size, m.gpus, PREFILL_SM[d.size], share, MAX_BATCH) for d, share in m.models)))
    return Plan("muxserve", tuple(units), time.perf_counter() - t0,
                {"estimated_throughput": best[1], "mesh_groups_tried": tried})
