"""``lengthwise bench models --drift``: placements made once against placements made again as the models' rates drift.

The fleet's total rate stays the level's, but which model is popular moves: the run is cut into phases, and each
phase after the first gives the level's rates to the models in another (seeded) order, as popularity shifts do in a
real fleet. Each model's arrivals are one Poisson stream at its phase's rate, drawn once and replayed under every arm.

Every decision reads only the past: each model's rate counted over the last ``window_s`` seconds of its arrivals,
its lengths as each placement knows them (:mod:`serving.bench.models.placing`), and takes effect ``lag_s`` after it
is made (the new engines' weights pulled while the old ones serve, as SeaLLM's node workers do). Arms:

- ``lengthwise-static`` and ``seallm-static``: the plan made at the start, kept;
- ``lengthwise``: ours placed again at every check (``check_s``), adopted when the plan serving no longer carries the
  window's demand and the new one regroups the models (:mod:`serving.placement.models.replace`);
- ``seallm``: SeaLLM's placement at its adaptive interval (SeaLLM §4.3), its estimate its own simulator's score of the
  plan on its window, its real figure the attainment the last interval's requests got.

A run's plans are simulated mesh by mesh: a mesh that stays in the next plan (the same GPUs count, models and shares)
keeps running with its queues; one that leaves ends (its requests finish there: SeaLLM migrates them, which is not
priced), one that enters starts empty. Each request goes to one of its model's meshes in the plan in force when it
arrives, drawn by the plan's rate shares.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serving.bench.models.fidelity import FidelityConfig, mesh_model, requests_for
from serving.bench.models.muxserve import Level, ServedLLM
from serving.bench.models.placing import (
    SEALLM_WINDOW_S,
    Criterion,
    kv_split,
    predicted_demands,
    seallm_score,
    tally,
)
from serving.bench.models.sizing import smallest_mesh
from serving.placement.models.estimate import Demand, Estimator
from serving.placement.models.lengthwise import place_lengthwise, still_fits
from serving.placement.models.plan import Plan, Unit
from serving.placement.models.replace import AdaptiveInterval, regroups
from serving.placement.models.seallm import place_seallm
from serving.sim.mesh import simulate_mesh
from serving.sim.metrics import RequestRecord
from serving.sim.workload import TraceRequest

ARMS = ("lengthwise-static", "lengthwise", "seallm-static", "seallm")


class DriftError(ValueError):
    """A drift run that cannot start (a placement that places nothing on the GPUs given); one line."""


@dataclass(frozen=True)
class DriftConfig:
    gpus: int = 36
    phases: int = 4
    phase_s: float = 300.0
    window_s: float = 60.0
    check_s: float = 30.0
    lag_s: float = 30.0
    seallm_interval_s: float = 120.0  # SeaLLM's I_0, its cluster manager's choice
    seallm_beta: float = 0.2
    bin_s: float = 30.0  # the attainment-over-time plot's bins
    keep_while_fits: bool = True  # ours keeps a plan that still carries the window's demand (False: moves on any regroup)

    @property
    def duration_s(self) -> float:
        return self.phases * self.phase_s


def drifted_levels(level: Level, phases: int, seed: int) -> list[Level]:
    """Phase 0 is ``level``; each later phase gives its rates to the models in a seeded random order."""
    rates = [m.rate for m in level.models]
    out = [level]
    for k in range(1, phases):
        order = np.random.default_rng(seed * 7_919 + k).permutation(len(rates))
        out.append(dataclasses.replace(level, models=tuple(ServedLLM(m.name, m.size, rates[j])
                                                           for m, j in zip(level.models, order))))
    return out


def arrivals(levels: list[Level], phase_s: float, cfg: FidelityConfig) -> dict[str, list[TraceRequest]]:
    """Each model's requests over every phase: Poisson at its phase's rate, lengths as ``cfg`` draws them."""
    out: dict[str, list[TraceRequest]] = {m.name: [] for m in levels[0].models}
    for k, level in enumerate(levels):
        for i, m in enumerate(level.models):
            n = max(1, math.ceil(m.rate * phase_s * 1.2))
            for r in requests_for(n, m.rate, cfg, 31_000 + 100 * k + i, level, m.name):
                if r.arrival < phase_s:
                    out[m.name].append(dataclasses.replace(r, rid=len(out[m.name]), arrival=r.arrival + k * phase_s))
    return out


def observed(stream: dict[str, list[TraceRequest]], lengths: list[Demand], t0: float, t1: float) -> list[Demand]:
    """Each model's demand over [t0, t1): its rate counted there (one request a window at least, so that a model that
    fell quiet keeps a place), its lengths as the placement knows them."""
    span = t1 - t0
    out = []
    for d in lengths:
        n = sum(1 for r in stream[d.name] if t0 <= r.arrival < t1)
        out.append(dataclasses.replace(d, rate=max(n, 1) / span))
    return out


def level_of(level: Level, demands: list[Demand]) -> Level:
    return dataclasses.replace(level, models=tuple(ServedLLM(d.name, d.size, d.rate) for d in demands))


@dataclass(frozen=True)
class Decision:
    decided_at: float
    effective_at: float
    plan: Plan
    rates: dict[str, float]  # the rates it was made for
    estimated: float | None = None  # SeaLLM's estimate of its attainment


def _unit_key(u: Unit) -> tuple:
    return (u.gpus, round(u.kv_fraction, 6), tuple((m.name, m.size, m.tp, round(m.prefill_sm, 4), round(m.decode_sm, 4),
                                                    m.max_num_seqs, round(m.rate_share, 6),
                                                    None if m.kv_share is None else round(m.kv_share, 6))
                                                   for m in u.models))


def simulate_timeline(decisions: list[Decision], stream: dict[str, list[TraceRequest]], level: Level,
                      cfg: FidelityConfig, t0: float, t1: float, criterion: Criterion, seed: int
                      ) -> tuple[dict[str, dict], list[RequestRecord]]:
    """The requests arriving in [t0, t1) under the plans in force, mesh by mesh (see the module's docstring): per
    model its requests and those within SLO, and every request's record."""
    live = [d for d in decisions if d.effective_at < t1]
    starts = [max(t0, d.effective_at) for d in live]
    ends = [*starts[1:], t1]
    # each mesh's lifetime: the consecutive plans it stays in
    lifetimes: list[dict[str, Any]] = []
    active: dict[tuple, int] = {}
    for d, a, b in zip(live, starts, ends):
        if b <= a:  # superseded before it served (only the last plan ends at t1 > its start)
            continue
        seen: dict[tuple, int] = {}
        now: dict[tuple, int] = {}
        for u in d.plan.units:
            k = _unit_key(u)
            seen[k] = seen.get(k, 0) + 1
            key = (*k, seen[k])
            now[key] = active[key] if key in active else len(lifetimes)
            if key not in active:
                lifetimes.append({"unit": u, "rates": d.rates, "requests": {m.name: [] for m in u.models}})
        active = now
        for k, i in now.items():
            lifetimes[i].setdefault("spans", []).append((a, b))
    # each request to one of its model's meshes in the plan in force when it arrives
    rng = random.Random(seed)
    records: list[RequestRecord] = []
    arrived: dict[str, int] = {name: 0 for name in stream}
    for name, reqs in stream.items():
        for r in reqs:
            if not t0 <= r.arrival < t1:
                continue
            arrived[name] += 1
            mine = [(i, m.rate_share) for i, lt in enumerate(lifetimes) for m in lt["unit"].models
                    if m.name == name and any(a <= r.arrival < b for a, b in lt.get("spans", []))]
            if not mine:  # no plan serves it: a record that never finishes, missed
                records.append(RequestRecord(-1, r.arrival, r.prompt_tokens, r.output_tokens, 0.0, service=name))
                continue
            i = rng.choices([i for i, _ in mine], weights=[w for _, w in mine])[0]
            lifetimes[i]["requests"][name].append(r)
    met: dict[str, int] = {}
    for lt in lifetimes:
        unit, split = lt["unit"], kv_split(lt["unit"], lt["rates"])
        models = [mesh_model(unit, m.name, lt["requests"][m.name], cfg, split[m.name], criterion.slo_scale,
                             slo_latency=cfg.engine.latency(m.size, smallest_mesh(m.size)))
                  for m in unit.models if lt["requests"][m.name]]
        if not models:
            continue
        mine: dict[int, RequestRecord] = {}
        for name, run in simulate_mesh(models, "mps", records=mine).items():
            met[name] = met.get(name, 0) + round(run.slo_attainment * run.requests_total)
        records += mine.values()
    per_model = {}
    for m in level.models:
        n = arrived[m.name]
        per_model[m.name] = {"requests": n, "met": met.get(m.name, 0), "attainment": met.get(m.name, 0) / n if n else 1.0}
    return per_model, records


Placer = Callable[[list[Demand], Level], Plan | None]


def placers(cfg: FidelityConfig, gpus: int) -> dict[str, Placer]:
    est = Estimator(cfg.engine.latency)
    return {"lengthwise": lambda demands, _level: place_lengthwise(demands, gpus, est),
            "seallm": lambda demands, level: place_seallm(demands, gpus, seallm_score(level, cfg), SEALLM_WINDOW_S)}


def _estimate(plan: Plan, level: Level, cfg: FidelityConfig) -> float:
    """SeaLLM's simulator's attainment for ``plan`` on its window of ``level``'s requests."""
    scored = seallm_score(level, cfg)(plan.units)
    total = sum(s.requests for s in scored.values())
    return 1 - sum(s.missed for s in scored.values()) / total if total else 1.0


def decide(arm: str, dc: DriftConfig, level: Level, stream: dict[str, list[TraceRequest]], lengths: list[Demand],
           cfg: FidelityConfig, criterion: Criterion, on_decision: Callable[[Decision], None] | None = None
           ) -> list[Decision]:
    """The arm's decisions over the run: the first from the window before the start (phase 0's rates), the later ones
    as its rule says."""
    kind = arm.removesuffix("-static")
    place = placers(cfg, dc.gpus)[kind]
    est = Estimator(cfg.engine.latency)

    def make(t: float) -> tuple[Plan | None, list[Demand]]:
        demands = (observed(stream, lengths, max(0.0, t - dc.window_s), t) if t > 0
                   else [dataclasses.replace(d, rate=m.rate) for d, m in zip(lengths, level.models)])
        return place(demands, level_of(level, demands)), demands

    first, demands = make(0.0)
    if first is None:
        raise DriftError(f"{kind} places nothing on {dc.gpus} GPUs at this level; give more --gpus")
    first_est = _estimate(first, level_of(level, demands), cfg) if kind == "seallm" else None
    out = [Decision(0.0, 0.0, first, {d.name: d.rate for d in demands}, first_est)]
    if arm.endswith("-static"):
        return out
    interval = AdaptiveInterval(dc.seallm_interval_s, dc.seallm_beta) if kind == "seallm" else None
    t = dc.check_s if interval is None else interval.interval_s
    while t < dc.duration_s:
        if interval is not None:  # the interval just ended: its real attainment against the estimate it began with
            real, _ = simulate_timeline(out, stream, level, cfg, max(0.0, t - interval.interval_s), t, criterion, seed=7)
            met, n = tally(real)
            assert out[-1].estimated is not None  # every SeaLLM decision carries its estimate
            interval.next(met / n if n else 1.0, out[-1].estimated)
        plan, demands = make(t)
        if interval is not None:
            move = plan is not None
        else:  # ours: the plan serving no longer carries the window's demand, and the new one regroups the models
            move = regroups(out[-1].plan, plan) and not (dc.keep_while_fits and still_fits(out[-1].plan, demands, est))
        if move:
            assert plan is not None
            score = _estimate(plan, level_of(level, demands), cfg) if kind == "seallm" else None
            out.append(Decision(t, t + dc.lag_s, plan, {d.name: d.rate for d in demands}, score))
            if on_decision is not None:
                on_decision(out[-1])
        t += dc.check_s if interval is None else interval.interval_s
    return out


def run_drift(levels: dict[str, Level], level_name: str, arms: list[str], dc: DriftConfig, lengths_kind: str, seed: int,
              console, calibrate_on: str = "condense800", first_turns: int | None = None,
              criterion: Criterion | None = None) -> dict[str, Any]:
    """Every arm on the same drifting arrivals; per arm the tallies, the decisions and attainment over time."""
    criterion = criterion or Criterion()
    from rich.progress import Progress

    from serving.bench.models.fidelity import calibrated
    from serving.progress import logged, waiting

    level = levels[level_name]
    base = FidelityConfig(lengths="per-model", seed=seed, lengths_limit=first_turns)
    # fitted on the requests MuxServe ran, as --gpus-needed
    with Progress(console=console, transient=True) as progress, logged(progress, "bench models"):
        engines, _ = calibrated(levels, calibrate_on, lambda _lv: base, progress)
    engine = engines.get("calibrated", engines["roofline"])
    cfg = dataclasses.replace(base, lengths=lengths_kind, engine=engine)
    phases = drifted_levels(level, dc.phases, seed)
    stream = arrivals(phases, dc.phase_s, cfg)
    lengths = predicted_demands(level, cfg)
    out: dict[str, Any] = {"level": level_name, "config": dataclasses.asdict(dc), "lengths": lengths_kind,
                           "engine": dataclasses.asdict(engine),
                           "phases": [{m.name: m.rate for m in p.models} for p in phases],
                           "requests": sum(len(v) for v in stream.values()), "arms": {}}
    for arm in arms:
        t_start = time.perf_counter()
        with waiting(console, f"{arm}: deciding..."):
            decisions = decide(arm, dc, level, stream, lengths, cfg, criterion)
        with waiting(console, f"{arm}: {len(decisions)} plan(s) on {dc.gpus} GPUs, simulating..."):
            per_model, records = simulate_timeline(decisions, stream, level, cfg, 0.0, dc.duration_s, criterion, seed)
        met, total = tally(per_model)
        row = {"attainment": met / total, "worst_model": min(r["attainment"] for r in per_model.values()),
               "models_at_90": sum(r["attainment"] >= criterion.each for r in per_model.values()),
               "passes": criterion.met(per_model), "replacements": len(decisions) - 1,
               "decision_s": [d.plan.decision_s for d in decisions],
               "decisions": [{"at": d.decided_at, "effective": d.effective_at, "gpus": d.plan.gpus,
                              "units": [[u.gpus, [m.name for m in u.models]] for u in d.plan.units],
                              "estimated": d.estimated} for d in decisions],
               "over_time": _over_time(records, dc), "models": per_model, "wall_s": time.perf_counter() - t_start}
        out["arms"][arm] = row
        console.print(f"{arm}: attainment {row['attainment']:.3f}, worst model {row['worst_model']:.2f}, "
                      f"{row['models_at_90']}/{len(per_model)} models at 90%, {row['replacements']} re-placement(s)")
    return out


def _over_time(records: list[RequestRecord], dc: DriftConfig) -> list[float | None]:
    """Attainment of the requests arriving in each ``bin_s`` bin (None for an empty bin)."""
    bins = math.ceil(dc.duration_s / dc.bin_s)
    met, n = [0] * bins, [0] * bins
    for r in records:
        b = min(bins - 1, int(r.arrival // dc.bin_s))
        n[b] += 1
        met[b] += r.finished is not None and r.finished - r.arrival <= r.jct_limit
    return [m / k if k else None for m, k in zip(met, n)]


STYLE = {"lengthwise": ("tab:green", "-"), "lengthwise-static": ("tab:green", ":"), "seallm": ("tab:purple", "-"),
         "seallm-static": ("tab:purple", ":")}


def plot_drift(res: dict[str, Any], path: Path) -> Path:
    """Attainment of the requests arriving in each bin, one line per arm, phases marked; re-placements as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = res["config"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm, row in res["arms"].items():
        colour, ls = STYLE.get(arm, ("grey", "-"))
        xs = [(i + 0.5) * cfg["bin_s"] for i in range(len(row["over_time"]))]
        label = f"{arm}{'' if arm.startswith('lengthwise') else ' (theirs)'}: {row['attainment']:.1%}"
        ax.plot(xs, [float("nan") if y is None else y for y in row["over_time"]], color=colour, ls=ls, label=label)
        if not arm.endswith("-static"):
            ax.plot([d["effective"] for d in row["decisions"][1:]], [0.02] * row["replacements"], "|", color=colour,
                    ms=10)
    for k in range(1, cfg["phases"]):
        ax.axvline(k * cfg["phase_s"], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("time (s); dashed: the rates reshuffled; ticks: a new plan serving")
    ax.set_ylabel(f"attainment of the requests arriving per {cfg['bin_s']:g} s")
    ax.set_ylim(0, 1.05)
    ax.set_xlim(0, cfg["phases"] * cfg["phase_s"])
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"{res['level']}, {res['lengths']} lengths, {cfg['gpus']} GPUs, rates drifting (simulator)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
