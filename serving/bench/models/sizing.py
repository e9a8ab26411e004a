"""How many GPUs a placement needs: spatial partitioning sized to each model's rate, the baseline every placement of
several models is measured against (MuxServe's "spatial", SeaLLM's dedicated groups).

Each model gets the fewest GPUs that keep its attainment at the target on its own: replicas of a tensor-parallel mesh
of 1, 2, 4 or 8 GPUs (at each total, the best of the ways to make it; arrivals split evenly between replicas: a
random split of a Poisson stream is Poisson at the split rate). The engine is the one :mod:`fidelity` calibrates;
the KV cache is what vLLM's ``gpu_memory_utilization`` of 0.9 leaves beside the weights. A request meets its SLO
when it finishes within ``slo_scale`` times its execution time alone on the model's smallest mesh (MuxServe §4.1:
"different multiplies of single device execution latency"; scale 8 in its ChatLMSYS figure).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from serving.bench.models.fidelity import BLOCK, GPU, FidelityConfig, requests_for, run_blind, v0_config
from serving.bench.models.muxserve import Level, ServedLLM
from serving.perf.hardware import HardwareError, get_gpu, get_model, kv_blocks, kv_bytes_available
from serving.perf.slo import derive_slo

MESHES = (1, 2, 4, 8)
MAX_REPLICAS = 8  # 64 GPUs for one model: past this the search gives up and says so


@dataclass(frozen=True)
class Sized:
    """One model's mesh: ``gpus`` per replica, ``replicas`` of it, and the attainment simulated there; ``curve``:
    every total tried on the way, with its best way's (gpus, replicas, attainment)."""

    model: str
    size: str
    gpus: int
    replicas: int
    attainment: float
    curve: tuple[tuple[int, int, float], ...] = ()

    @property
    def total_gpus(self) -> int:
        return self.gpus * self.replicas


def smallest_mesh(size: str) -> int:
    """The fewest GPUs of :data:`MESHES` whose memory holds the model's weights with room for KV."""
    for g in MESHES:
        try:
            kv_bytes_available(get_model(size), get_gpu(GPU), g)
        except HardwareError:
            continue
        return g
    raise HardwareError(f"{size} does not fit {MESHES[-1]} x {GPU}")


def attainment_on(model: ServedLLM, level: Level, gpus: int, replicas: int, cfg: FidelityConfig, slo_scale: float,
                  n_requests: int, salt: int) -> float:
    """The share of ``model``'s requests within SLO on ``replicas`` meshes of ``gpus`` (mean over the replays)."""
    spec, gpu = get_model(model.size), get_gpu(GPU)
    latency = cfg.engine.latency(model.size, gpus)
    blocks = kv_blocks(spec, kv_bytes_available(spec, gpu, gpus), BLOCK)
    config = v0_config(model.size, 256)
    alone = cfg.engine.latency(model.size, smallest_mesh(model.size))
    met = []
    for k in range(cfg.replays):
        per_replica = max(1, round(n_requests / replicas))
        requests = requests_for(per_replica, model.rate / replicas, cfg, salt + 100 * k, level, model.name)
        slo = derive_slo(alone, [r.prompt_tokens for r in requests], [r.output_tokens for r in requests], slo_scale)
        met.append(run_blind(requests, cfg, config, blocks, latency, slo).slo_attainment)
    return float(np.mean(met))


def size_spatial(level: Level, cfg: FidelityConfig, target: float = 0.99, slo_scale: float = 8.0,
                 duration_s: float = 300.0, on_model: Callable[[Sized], None] | None = None) -> list[Sized]:
    """Each model of ``level`` on the fewest GPUs that keep it at ``target``. Each run is ``duration_s`` of arrivals:
    MuxServe's own runs last 20-60 s, within which a queue that grows without bound still meets an SLO of eight
    times a request's execution time, so they cannot tell a mesh that keeps up from one that does not."""
    out = []
    for salt, model in enumerate(level.models):
        n = max(1, math.ceil(model.rate * duration_s))
        first = smallest_mesh(model.size)
        found = None
        curve: list[tuple[int, int, float]] = []
        for total in range(first, MESHES[-1] * MAX_REPLICAS + 1):
            # every way to make ``total`` GPUs of equal meshes; the best of them at this total
            ways = [(g, total // g) for g in MESHES if g >= first and total % g == 0 and total // g <= MAX_REPLICAS]
            tried = [Sized(model.name, model.size, g, r, attainment_on(model, level, g, r, cfg, slo_scale, n, salt))
                     for g, r in ways]
            if tried:
                found = max(tried, key=lambda x: (x.attainment, -x.replicas))
                curve.append((found.gpus, found.replicas, found.attainment))
                if found.attainment >= target:
                    break
        assert found is not None
        found = dataclasses.replace(found, curve=tuple(curve))
        out.append(found)
        if on_model is not None:
            on_model(found)
    return out


def allocate(sized: list[Sized], rates: dict[str, float], overall: float, each: float) -> list[Sized]:
    """Spatial partitioning at a fleet's criterion: each model first on the fewest GPUs of its curve that keep it at
    ``each``, then GPUs added where they bring the most requests within SLO per GPU until the rate-weighted
    attainment reaches ``overall`` (each curve runs up to the model alone at ``overall`` or more, so this ends)."""
    at = {s.model: next(i for i, (_, _, a) in enumerate(s.curve) if a >= each) for s in sized}
    by = {s.model: s for s in sized}
    total_rate = sum(rates.values())

    def met() -> float:
        return sum(rates[m] * by[m].curve[i][2] for m, i in at.items()) / total_rate

    while met() < overall:
        def gain(m: str) -> float:
            i = at[m]
            (g0, r0, a0), (g1, r1, a1) = by[m].curve[i], by[m].curve[i + 1]
            return rates[m] * (a1 - a0) / (g1 * r1 - g0 * r0)
        options = [m for m, i in at.items() if i + 1 < len(by[m].curve)]
        if not options:
            break
        at[max(options, key=gain)] += 1
    return [dataclasses.replace(by[m], gpus=by[m].curve[i][0], replicas=by[m].curve[i][1],
                                attainment=by[m].curve[i][2]) for m, i in at.items()]
