"""``lengthwise bench models --gpus-needed``: per load level, the fewest GPUs each placement needs, beside the GPUs
MuxServe's own placements used.

A placement passes on a number of GPUs when the overall attainment within SLO scale 8 is at least 99% and every
model's at least 90% (MuxServe §4.3's scale). ``spatial`` is sized per model (:mod:`serving.bench.models.sizing`):
each model's curve of attainment against GPUs, then GPUs where they bring most (:func:`allocate`). The placements of
several models per mesh are each asked for a plan on n GPUs and the plan run in the simulator
(:mod:`serving.bench.models.placing`); the fewest n that passes is found by bisection.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

from serving.bench.models.fidelity import GPU, FidelityConfig, calibrated
from serving.bench.models.muxserve import SYSTEMS, Level, load_placement
from serving.bench.models.placing import Criterion, fewest_gpus, placers, tally
from serving.bench.models.sizing import allocate, size_spatial
from serving.perf.hardware import get_gpu, get_model
from serving.placement.models.estimate import MEMORY_UTILISATION

PLACEMENTS = ("spatial", "muxserve", "temporal", "seallm", "lengthwise")
SHARED = ("muxserve", "temporal", "seallm", "lengthwise")  # placements asked for a plan on a number of GPUs
CRITERION = Criterion()  # 99% overall, 90% each, within SLO scale 8 (MuxServe §4.3)
MOST_GPUS = 64
COLOURS = {"spatial": "tab:blue", "muxserve": "tab:orange", "temporal": "tab:green", "seallm": "tab:red",
           "lengthwise": "tab:purple"}  # one colour a placement in every plot


def fewest_possible(level: Level) -> int:
    """No placement fits the level's weights on fewer GPUs than their bytes over vLLM's share of a GPU."""
    weights = sum(get_model(m.size).weight_bytes() for m in level.models)
    return math.ceil(weights / (MEMORY_UTILISATION * get_gpu(GPU).mem_bytes))


def _plan_json(plan) -> dict | None:
    if plan is None:
        return None
    return {"gpus": plan.gpus, "decision_s": plan.decision_s, "notes": plan.notes,
            "units": [dataclasses.asdict(u) for u in plan.units]}


def run_needed(levels: dict, chosen: list[str], placements: list[str], calibrate_on: str, lengths: str, seed: int,
               console, first_turns: int | None, replays: int, duration_s: float,
               on_level: Callable[[dict], None] | None = None, arrival_cv: float = 1.0) -> dict:
    """Each chosen level sized by each placement, with the calibrated engine where there is one; ``on_level`` gets
    the results so far after each level (a long run keeps what it has done)."""
    from rich.progress import Progress

    from serving.progress import logged

    def config(level) -> FidelityConfig:
        return FidelityConfig(lengths=lengths, seed=seed, lengths_limit=first_turns, replays=replays,
                              arrival_cv=arrival_cv)

    res: dict = {"setting": {"lengths": lengths, "seed": seed, "replays": replays, "duration_s": duration_s,
                             "arrival_cv": arrival_cv,
                             "target": CRITERION.overall, "each": CRITERION.each, "slo_scale": CRITERION.slo_scale,
                             "gpu": GPU},
                 "levels": {}}
    with Progress(console=console, transient=True) as progress, logged(progress, "bench models"):
        # the engine is fitted to MuxServe's measurements on the requests MuxServe ran, whatever lengths are sized here
        engines, calibration = calibrated(levels, calibrate_on, lambda lv: dataclasses.replace(
            config(lv), lengths="per-model", arrival_cv=1.0), progress)
        engine_name = "calibrated" if "calibrated" in engines else "roofline"
        res["setting"]["engine"] = {"name": engine_name, **dataclasses.asdict(engines[engine_name])}
        if calibration:
            res["calibration"] = calibration
        for name in chosen:
            level = levels[name]
            cfg = dataclasses.replace(config(level), engine=engines[engine_name])
            theirs = {s: sum(u.gpus for u in load_placement(name, s)) for s in SYSTEMS}
            entry: dict = {"total_rate": level.total_rate, "cluster_gpus": level.cluster_gpus, "muxserve_ran_on": theirs,
                           "fewest_possible": fewest_possible(level), "placements": {}}
            if "spatial" in placements:
                task = progress.add_task(f"{name}: spatial", total=len(level.models))
                sized = size_spatial(level, cfg, CRITERION.overall, CRITERION.slo_scale, duration_s,
                                     on_model=lambda _, task=task: progress.advance(task))
                alloc = allocate(sized, {m.name: m.rate for m in level.models}, CRITERION.overall, CRITERION.each)
                entry["placements"]["spatial"] = {
                    "gpus": sum(s.total_gpus for s in alloc),
                    "every_model_at_target": sum(s.total_gpus for s in sized),
                    "min_attainment": min(s.attainment for s in alloc),
                    "models": [dataclasses.asdict(s) | {"total_gpus": s.total_gpus} for s in alloc]}
                progress.remove_task(task)
            hi = MOST_GPUS
            for p in (x for x in placements if x in SHARED):
                placer, sharing = placers(cfg)[p]
                task = progress.add_task(f"{name}: {p}", total=math.ceil(math.log2(max(2, hi))) + 2)
                t0 = time.perf_counter()
                got = fewest_gpus(placer, sharing, level, cfg, duration_s, entry["fewest_possible"], hi, CRITERION,
                                  on_try=lambda n, ok, task=task: progress.advance(task))
                progress.remove_task(task)
                t1 = time.perf_counter()
                on_cluster = placer(level, level.cluster_gpus)
                decision_s = time.perf_counter() - t1  # also where no plan fits the cluster
                found = got["tried"][got["given"]] if got["gpus"] is not None else None
                entry["placements"][p] = {
                    "gpus": got["gpus"], "given": got.get("given"), "searched_up_to": hi, "search_s": time.perf_counter() - t0,
                    "decision_s_on_cluster": decision_s, "fits_cluster": on_cluster is not None,
                    "plan": _plan_json(found["plan"]) if found else None,
                    "models": found["models"] if found else None,
                    "tried": {n: {"passes": t["passes"], "plan_gpus": t["plan"].gpus if t["plan"] else None,
                                  **_attainment(t.get("models"))} for n, t in sorted(got["tried"].items())}}
            res["levels"][name] = entry
            if on_level is not None:
                on_level(res)
    print_needed(res, console)
    return res


def _attainment(models: dict | None) -> dict:
    if not models:
        return {}
    met, total = tally(models)
    return {"overall": met / total, "worst_model": min(r["attainment"] for r in models.values())}


def print_needed(res: dict, console) -> None:
    from rich.table import Table

    placements = [p for p in PLACEMENTS if any(p in e["placements"] for e in res["levels"].values())]
    s = res["setting"]
    t = Table(title=f"GPUs needed: overall >= {s['target']:.0%} and every model >= {s['each']:.0%} within SLO scale "
                    f"{s['slo_scale']:g} ({s['engine']['name']} engine, {s['duration_s']:g} s of arrivals; "
                    "every baseline is their placement in our simulator)")
    for col in ("level", "req/s", *placements, "ours vs spatial", "ours vs best of muxserve, seallm",
                "decision s (32 GPUs)",
                "MuxServe ran: spatial", "flexsm"):
        t.add_column(col, justify="right")
    for name, e in res["levels"].items():
        g = {p: e["placements"].get(p, {}).get("gpus") for p in placements}
        ours = g.get("lengthwise")

        def vs(other: int | None, ours: int | None = ours) -> str:
            return f"{ours / other - 1:+.0%}" if ours and other else "-"
        decision = e["placements"].get("lengthwise", {}).get("decision_s_on_cluster")
        t.add_row(name, f"{e['total_rate']:.1f}", *(str(g[p]) if g[p] else "> searched" for p in placements),
                  vs(g.get("spatial")), vs(min((x for x in (g.get("muxserve"), g.get("seallm")) if x), default=None)),
                  f"{decision:.3f}" if decision is not None else "-",
                  *(str(e["muxserve_ran_on"][x]) for x in ("spatial", "flexsm")))
    console.print(t)


def plot_needed(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = [e["total_rate"] for e in res["levels"].values()]
    placements = [p for p in PLACEMENTS if any(p in e["placements"] for e in res["levels"].values())]
    for p in placements:
        ys = [e["placements"].get(p, {}).get("gpus") for e in res["levels"].values()]
        line, = ax.plot(rates, [y if y else float("nan") for y in ys], "o-", color=COLOURS[p],
                        label=p if p == "lengthwise" else f"{p} (theirs)")
        over = [r for r, y, e in zip(rates, ys, res["levels"].values()) if y is None and p in e["placements"]]
        ax.plot(over, [MOST_GPUS] * len(over), "^", color=line.get_color(), ms=8, ls="none")
    ax.plot([], [], "^", color="grey", ls="none", label=f"does not pass on {MOST_GPUS} GPUs")
    for s, marker in (("spatial", "x"), ("flexsm", "+")):
        ax.plot(rates, [e["muxserve_ran_on"][s] for e in res["levels"].values()], marker, ls="none", ms=9,
                color="dimgrey", label=f"GPUs MuxServe's {s} ran on")
    cluster = max(e["cluster_gpus"] for e in res["levels"].values())
    ax.axhline(cluster, color="grey", lw=0.8, ls="--", label=f"the cluster ({cluster} GPUs)")
    ax.set_xlabel("total request rate (req/s)")
    ax.set_ylabel(f"GPUs for >= {CRITERION.overall:.0%} overall, >= {CRITERION.each:.0%} each")
    ax.set_ylim(0, max(math.ceil(ax.get_ylim()[1]), cluster + 4, MOST_GPUS + 4))
    ax.legend(fontsize=8, loc="lower right")
    cv = res["setting"].get("arrival_cv", 1.0)
    arrivals = "" if cv == 1.0 else f", bursts (CV {cv:g})"
    ax.set_title(f"MuxServe's ChatLMSYS setting, {res['setting']['lengths']} lengths{arrivals}:\nGPUs needed (simulator)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
