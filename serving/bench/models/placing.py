"""A placement's plan run in the simulator, and the fewest GPUs at which a placement keeps the fleet within SLO.

Every unit of a plan runs on its own simulated mesh (:func:`~serving.sim.mesh.simulate_mesh`): each model's share
of its Poisson arrivals for ``duration_s``, lengths as the fidelity run draws them, vLLM v0 at the unit's batch cap,
the unit's KV quota, and the calibrated step model at the mesh's tensor-parallel size. A request meets its SLO when
it finishes within ``slo_scale`` times its execution time alone on its model's smallest mesh (MuxServe §4.1). A plan
passes when the overall attainment is at least ``overall`` and every model's at least ``each``.

What a placement is told of the requests: ``muxserve`` gets one average prompt and output for every model, as
MuxServe's optimiser takes them (here the fleet's, from the same window ours learns from); ``lengthwise`` gets each
model's own mean prompt and output from a window of its past requests (a draw of its lengths apart from the run's,
as a fleet's predictor learns them), never the run's. ``seallm`` gets the same window, as SeaLLM's service monitor
collects it, and scores its plans by running them on its first 30 seconds in the simulator (:func:`seallm_score`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from serving.bench.models.fidelity import FidelityConfig, mesh_model, requests_for
from serving.bench.models.muxserve import Level
from serving.bench.models.sizing import smallest_mesh
from serving.perf.hardware import get_model
from serving.placement.models.estimate import Demand, Estimator
from serving.placement.models.lengthwise import place_lengthwise
from serving.placement.models.muxserve import place_muxserve
from serving.placement.models.plan import Plan, Unit
from serving.placement.models.seallm import Score, Scored, place_seallm
from serving.sim.mesh import simulate_mesh

HISTORY = 500  # requests per model in the window a fleet's predictor learns its lengths from
HISTORY_SALT = 77_777  # keeps that window's draw apart from every run's


@dataclass(frozen=True)
class Criterion:
    overall: float = 0.99
    each: float = 0.90
    slo_scale: float = 8.0

    def met(self, per_model: dict[str, dict]) -> bool:
        met, total = tally(per_model)
        return met >= self.overall * total and all(r["attainment"] >= self.each for r in per_model.values())


def tally(per_model: dict[str, dict]) -> tuple[int, int]:
    """(requests within SLO, requests) over every model of a run."""
    return sum(r["met"] for r in per_model.values()), sum(r["requests"] for r in per_model.values())


def fleet_demands(own: list[Demand]) -> list[Demand]:
    """Every model at the fleet's average prompt and output (over each model's own, :func:`predicted_demands`,
    weighted by rate): what MuxServe's optimiser knows, one pair of lengths for every model."""
    rate = sum(d.rate for d in own)
    prompt = sum(d.rate * d.prompt_len for d in own) / rate
    output = sum(d.rate * d.output_len for d in own) / rate
    return [Demand(d.name, d.size, d.rate, prompt, output) for d in own]


def predicted_demands(level: Level, cfg: FidelityConfig) -> list[Demand]:
    """Every model at the mean prompt and output of a window of its own past requests."""
    out = []
    for k, m in enumerate(level.models):
        past = requests_for(HISTORY, m.rate, cfg, HISTORY_SALT + k, level, m.name)
        out.append(Demand(m.name, m.size, m.rate, float(np.mean([r.prompt_tokens for r in past])),
                          float(np.mean([r.output_tokens for r in past]))))
    return out


def kv_split(unit: Unit, rates: dict[str, float]) -> dict[str, float]:
    """Each model's share of its mesh's KV: the unit's own quotas, else by rate x KV bytes a token (MuxServe's
    estimator's split)."""
    if all(m.kv_share is not None for m in unit.models):
        return {m.name: float(m.kv_share) for m in unit.models}  # type: ignore[arg-type]
    w = {m.name: rates[m.name] * m.rate_share * get_model(m.size).kv_bytes_per_token() for m in unit.models}
    return {k: v / sum(w.values()) for k, v in w.items()}


def run_unit(unit: Unit, level: Level, cfg: FidelityConfig, duration_s: float, sharing: str, replicas: dict[str, int],
             criterion: Criterion = Criterion(), salt: int = 0) -> dict[str, dict]:
    """One mesh of a plan: each of its models' share of ``duration_s`` of arrivals (``replicas``: which of the
    model's meshes this is, which keeps their draws apart) through its engine; per model its requests, those within
    SLO and its normalised latency."""
    rates = {m.name: m.rate for m in level.models}
    salts = {m.name: k for k, m in enumerate(level.models)}
    split = kv_split(unit, rates)
    models = []
    for m in unit.models:
        rate = rates[m.name] * m.rate_share
        reqs = requests_for(max(1, math.ceil(rate * duration_s)), rate, cfg,
                            salt + salts[m.name] + 1000 * replicas.get(m.name, 0), level, m.name)
        models.append(mesh_model(unit, m.name, reqs, cfg, split[m.name], criterion.slo_scale,
                                 slo_latency=cfg.engine.latency(m.size, smallest_mesh(m.size))))
    return {name: {"requests": run.requests_total, "met": round(run.slo_attainment * run.requests_total),
                   "normalised_latency": run.normalized_latency_s}
            for name, run in simulate_mesh(models, sharing).items()}


def run_plan(plan: Plan, level: Level, cfg: FidelityConfig, duration_s: float, sharing: str = "mps",
             criterion: Criterion = Criterion()) -> dict[str, dict]:
    """Per model of ``level``: its requests, those within SLO and its attainment over every mesh serving it."""
    tally = {m.name: {"requests": 0, "met": 0, "meshes": 0} for m in level.models}
    replica: dict[str, int] = {}
    for unit in plan.units:
        for name, r in run_unit(unit, level, cfg, duration_s, sharing, replica, criterion).items():
            tally[name]["requests"] += r["requests"]
            tally[name]["met"] += r["met"]
            tally[name]["meshes"] += 1
        for m in unit.models:
            replica[m.name] = replica.get(m.name, 0) + 1
    for r in tally.values():
        r["attainment"] = r["met"] / r["requests"] if r["requests"] else 0.0
    return tally


SEALLM_WINDOW_S = 30.0  # the past requests SeaLLM's simulator scores a plan on
SEALLM_SALT = 55_555  # that window's draw, apart from the run's


def seallm_score(level: Level, cfg: FidelityConfig, window_s: float = SEALLM_WINDOW_S,
                 criterion: Criterion = Criterion()) -> Score:
    """SeaLLM's simulator as its placement calls it: the units run on a window of past requests, each unit once
    (a plan grows one service at a time, so the units it keeps are not run again)."""
    cache: dict[tuple, dict[str, dict]] = {}

    def score(units: tuple[Unit, ...]) -> dict[str, Scored]:
        out: dict[str, list] = {}
        replica: dict[str, int] = {}
        for unit in units:
            key = (unit.gpus, tuple((m.name, round(m.rate_share, 6)) for m in unit.models),
                   tuple(replica.get(m.name, 0) for m in unit.models))
            if key not in cache:
                cache[key] = run_unit(unit, level, cfg, window_s, "mps", replica, criterion, SEALLM_SALT)
            for name, r in cache[key].items():
                out.setdefault(name, []).append(r)
            for m in unit.models:
                replica[m.name] = replica.get(m.name, 0) + 1
        return {name: Scored(sum(r["requests"] for r in rs), sum(r["requests"] - r["met"] for r in rs),
                             sum(r["normalised_latency"] * r["requests"] for r in rs) / sum(r["requests"] for r in rs))
                for name, rs in out.items()}
    return score


Placer = Callable[[Level, int], Plan | None]


def placers(cfg: FidelityConfig) -> dict[str, tuple[Placer, str]]:
    """Each placement sized by :func:`fewest_gpus`, with the sharing its meshes run under."""
    est = Estimator(cfg.engine.latency)
    known: dict[str, list[Demand]] = {}  # each level's window of past requests, drawn once for every size tried

    def own(level: Level) -> list[Demand]:
        if level.name not in known:
            known[level.name] = predicted_demands(level, cfg)
        return known[level.name]

    return {
        "muxserve": (lambda level, n: place_muxserve(fleet_demands(own(level)), n, est), "mps"),
        "temporal": (lambda level, n: place_muxserve(fleet_demands(own(level)), n, est), "temporal"),
        "lengthwise": (lambda level, n: place_lengthwise(own(level), n, est), "mps"),
        "seallm": (lambda level, n: place_seallm(own(level), n, seallm_score(level, cfg), SEALLM_WINDOW_S), "mps"),
    }


def fewest_gpus(placer: Placer, sharing: str, level: Level, cfg: FidelityConfig, duration_s: float, lo: int, hi: int,
                criterion: Criterion = Criterion(), on_try: Callable[[int, bool], None] | None = None) -> dict:
    """The fewest GPUs in [lo, hi] given to ``placer`` at which its plan passes, by bisection (a placement that passes
    on n GPUs is taken to pass on more), and the GPUs that plan holds; every size tried, with its plan and per-model
    attainment."""
    tried: dict[int, dict] = {}

    def passes(n: int) -> bool:
        plan = placer(level, n)
        if plan is None:
            tried[n] = {"plan": None, "passes": False}
        else:
            per_model = run_plan(plan, level, cfg, duration_s, sharing, criterion)
            tried[n] = {"plan": plan, "passes": criterion.met(per_model), "models": per_model}
        if on_try is not None:
            on_try(n, tried[n]["passes"])
        return tried[n]["passes"]

    if not passes(hi):
        return {"gpus": None, "tried": tried}
    while hi - lo > 0:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid + 1
    # a plan may leave some of the GPUs it is given idle: what it needs is what the passing plan holds
    return {"gpus": tried[hi]["plan"].gpus, "given": hi, "tried": tried}
