"""``lengthwise bench models --gpus-needed``: per load level, the fewest GPUs each placement needs, beside the GPUs
MuxServe's own placements used.

The attainment asked of a placement is every model at >= 99% within SLO scale 8 (MuxServe §4.3), which also keeps
the overall attainment at >= 99%. Only ``spatial`` is sized so far (:mod:`serving.bench.models.sizing`); MuxServe's,
SeaLLM's and ours are the next arms, judged on the same engine and workload.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from serving.bench.models.fidelity import FidelityConfig, calibrated
from serving.bench.models.muxserve import SYSTEMS, load_placement
from serving.bench.models.sizing import size_spatial

PLACEMENTS = {"spatial": size_spatial}  # placement -> its sizing of a level
TARGET, SLO_SCALE = 0.99, 8.0


def run_needed(levels: dict, chosen: list[str], placements: list[str], calibrate_on: str, lengths: str, seed: int,
               console, first_turns: int | None, replays: int, duration_s: float) -> dict:
    """Each chosen level sized by each placement, with the calibrated engine where there is one."""
    from rich.progress import Progress

    def config(level) -> FidelityConfig:
        return FidelityConfig(lengths=lengths, seed=seed, lengths_limit=first_turns, replays=replays)

    res: dict = {"setting": {"lengths": lengths, "seed": seed, "replays": replays, "duration_s": duration_s,
                             "target": TARGET, "slo_scale": SLO_SCALE, "gpu": "a100-80gb"}, "levels": {}}
    with Progress(console=console, transient=True) as progress:
        engines, calibration = calibrated(levels, calibrate_on, config, progress)
        engine_name = "calibrated" if "calibrated" in engines else "roofline"
        res["setting"]["engine"] = {"name": engine_name, **dataclasses.asdict(engines[engine_name])}
        if calibration:
            res["calibration"] = calibration
        task = progress.add_task("sizing", total=len(chosen) * len(placements) * 16)
        for name in chosen:
            level = levels[name]
            cfg = dataclasses.replace(config(level), engine=engines[engine_name])
            theirs = {s: sum(u.gpus for u in load_placement(name, s)) for s in SYSTEMS}
            entry: dict = {"total_rate": level.total_rate, "cluster_gpus": level.cluster_gpus, "muxserve_ran_on": theirs,
                           "placements": {}}
            for placement in placements:
                sized = PLACEMENTS[placement](level, cfg, TARGET, SLO_SCALE, duration_s,
                                              on_model=lambda _: progress.advance(task))
                entry["placements"][placement] = {
                    "gpus": sum(s.total_gpus for s in sized),
                    "fits_cluster": sum(s.total_gpus for s in sized) <= level.cluster_gpus,
                    "min_attainment": min(s.attainment for s in sized),
                    "models": [dataclasses.asdict(s) | {"total_gpus": s.total_gpus} for s in sized]}
            res["levels"][name] = entry
    print_needed(res, console)
    return res


def print_needed(res: dict, console) -> None:
    from rich.table import Table

    placements = sorted({p for e in res["levels"].values() for p in e["placements"]})
    t = Table(title=f"GPUs needed, every model at >= {TARGET:.0%} within SLO scale {SLO_SCALE:g} "
                    f"({res['setting']['engine']['name']} engine, {res['setting']['duration_s']:g} s of arrivals)")
    for col in ("level", "req/s", *placements, "MuxServe ran: spatial", "flexsm", "temporal"):
        t.add_column(col, justify="right")
    for name, e in res["levels"].items():
        t.add_row(name, f"{e['total_rate']:.1f}", *(str(e["placements"][p]["gpus"]) for p in placements),
                  *(str(e["muxserve_ran_on"][s]) for s in ("spatial", "flexsm", "temporal")))
    console.print(t)
    for name, e in res["levels"].items():
        for p, r in e["placements"].items():
            meshes = ", ".join(f"{m['model']} {m['size'][6:]} {m['replicas']}x{m['gpus']}" for m in r["models"])
            console.print(f"{name} {p}: {meshes}")


def plot_needed(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rates = [e["total_rate"] for e in res["levels"].values()]
    placements = sorted({p for e in res["levels"].values() for p in e["placements"]})
    for p in placements:
        ax.plot(rates, [e["placements"][p]["gpus"] for e in res["levels"].values()], "o-", label=f"{p} (sized here)")
    for s, marker in (("spatial", "x"), ("flexsm", "+")):
        ax.plot(rates, [e["muxserve_ran_on"][s] for e in res["levels"].values()], marker, ls="none", ms=9,
                label=f"GPUs MuxServe's {s} ran on")
    cluster = max(e["cluster_gpus"] for e in res["levels"].values())
    ax.axhline(cluster, color="grey", lw=0.8, ls="--", label=f"the cluster ({cluster} GPUs)")
    ax.set_xlabel("total request rate (req/s)")
    ax.set_ylabel(f"GPUs for every model at >= {TARGET:.0%}")
    ax.set_ylim(0, max(math.ceil(ax.get_ylim()[1]), cluster + 4))
    ax.legend(fontsize=8)
    ax.set_title("MuxServe's ChatLMSYS setting: GPUs needed per placement (simulator)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
