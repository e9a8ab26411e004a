"""``lengthwise bench models``: several models of several sizes on a fleet of GPUs, in MuxServe's ChatLMSYS setting.

Fidelity comes first (``--fidelity``): our simulator runs the placements MuxServe ran and is compared with what
MuxServe measured, per model and per load level, with the roofline's step times and with step times calibrated on one
level and judged on the others. The placement comparison (GPUs needed per placement) is built on this check.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

from serving.argtypes import comma_list


def add_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        "models", help="several models on a GPU fleet (MuxServe's 16 LLaMA models on 32 A100s): the simulator against "
                       "MuxServe's own measurements", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="MuxServe's ChatLMSYS setting (16 LLaMA models, 7B to 65B, on 4 x 8 A100s, five load levels). "
                    "--fidelity simulates the placements MuxServe ran (spatial: one model per GPU mesh; flexsm, "
                    "MuxServe itself: models sharing a mesh under MPS; temporal: time multiplexing) on the workload it "
                    "ran them on, and compares per model and level with MuxServe's measured throughput, p90/p99 "
                    "latency, mean TTFT and mean TPOT: first with the roofline's step times, then with step times "
                    "calibrated on spatial at one level (--calibrate-on) and judged everywhere else. Prints the "
                    "tables, writes JSON and a PNG (simulated against measured throughput and TPOT).",
        epilog="examples:\n  lengthwise bench models --fidelity\n"
               "  lengthwise bench models --fidelity --systems spatial\n"
               "  lengthwise bench models --fidelity --levels condense500,condense2000 --calibrate-on none\n"
               "  lengthwise bench models --fidelity --lengths sharegpt\n"
               "  lengthwise bench models --gpus-needed --replays 1\n"
               "  lengthwise bench models --gpus-needed --lengths alpaca-eval --placements muxserve,lengthwise\n"
               "  lengthwise bench models --gpus-needed --arrival-cv 4\n"
               "  lengthwise bench models --on-engines\n"
               "  lengthwise bench models --drift --levels condense1200 --gpus 36\n\n"
               "JSON: levels -> LEVEL -> SYSTEM -> ENGINE (roofline, calibrated) -> {models -> NAME -> measured, "
               "simulated, error; summary; held_out}; calibration -> {level, engine, fit_error, tried}.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--fidelity", action="store_true",
                      help="simulate MuxServe's own placements and compare with its measurements")
    mode.add_argument("--on-engines", action="store_true",
                      help="on this machine: SmolLM2 and its two adapters laid on two vLLM-CPU engines as each plan "
                           "says, served by lengthwise serve --models, each model's attainment against the simulator's "
                           "run of the same plan (about 10 minutes)")
    mode.add_argument("--drift", action="store_true",
                      help="the models' rates drift (popularity reshuffled each phase, total rate kept): placements "
                           "made once against placements made again (ours at every check, SeaLLM's adaptive interval) "
                           "on --gpus GPUs at the first of --levels")
    mode.add_argument("--gpus-needed", action="store_true",
                      help="per level, the fewest GPUs each placement needs for >= 99%% attainment overall and >= 90%% "
                           "for every model (SLO scale 8, as MuxServe), beside the GPUs MuxServe's own placements used")
    p.add_argument("--placements", type=comma_list(str.strip, "spatial,lengthwise"),
                   default=["spatial", "muxserve", "temporal", "lengthwise"], metavar="P,P",
                   help="--gpus-needed: placements to size: spatial (each model on its own meshes, sized to its rate), "
                        "muxserve (MuxServe's greedy with its estimator, models sharing meshes under MPS), temporal "
                        "(the same meshes, one step at a time), seallm (SeaLLM's groups by parallelism, services by "
                        "their unserved index scored in the simulator: minutes per level), lengthwise (ours: packed by "
                        "each model's predicted lengths) (default: all but seallm)")
    p.add_argument("--plans", type=comma_list(str.strip, "lengthwise,everywhere"), default=["lengthwise", "everywhere"],
                   metavar="P,P", help="--on-engines: lengthwise (ours: models kept apart or split by predicted load) "
                                       "and everywhere (every model on every engine, no plan) (default: both)")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="--on-engines: req/s over all models (default: what the calibrated simulator says the engines "
                        "sustain at 90%% with every model everywhere)")
    p.add_argument("--requests", type=int, default=120, metavar="N", help="--on-engines: requests replayed per plan "
                                                                          "(default: %(default)s)")
    p.add_argument("--gpus", type=int, default=36, metavar="N",
                   help="--drift: GPUs every arm is given (default: %(default)s, what ours needed at condense1200 "
                        "without drift)")
    p.add_argument("--arms", type=comma_list(str.strip, "lengthwise-static,lengthwise"),
                   default=["lengthwise-static", "lengthwise", "seallm-static", "seallm"], metavar="A,A",
                   help="--drift: lengthwise-static / seallm-static (placed once), lengthwise (ours placed again at "
                        "every check, adopted when it regroups the models), seallm (SeaLLM's adaptive interval, "
                        "minutes) (default: all four)")
    p.add_argument("--phases", type=int, default=4, metavar="K", help="--drift: phases of the run (default: %(default)s)")
    p.add_argument("--phase-s", type=float, default=300.0, metavar="S",
                   help="--drift: seconds of each phase (default: %(default)s)")
    p.add_argument("--lag-s", type=float, default=30.0, metavar="S",
                   help="--drift: seconds from a decision to its plan serving (weights pulled meanwhile) "
                        "(default: %(default)s)")
    p.add_argument("--move-on-any-regroup", action="store_true",
                   help="--drift: ours moves models whenever its new plan groups them differently, even while the "
                        "plan serving still carries the window's demand (every window's noise then moves models)")
    p.add_argument("--duration", type=float, default=300.0, metavar="S",
                   help="--gpus-needed: seconds of arrivals per run (MuxServe's own runs of 20-60 s cannot tell a mesh "
                        "that keeps up from one that does not) (default: %(default)s)")
    p.add_argument("--arrival-cv", type=float, default=1.0, metavar="CV",
                   help="--gpus-needed: the spread of the gaps between a model's arrivals over their mean: 1 is "
                        "Poisson, as MuxServe's runs; above 1 a Gamma process of the same rate, in bursts "
                        "(default: %(default)s)")
    p.add_argument("--levels", type=comma_list(str.strip, "condense500,condense2000"), default=None, metavar="L,L",
                   help="load levels (default: all five)")
    p.add_argument("--systems", type=comma_list(str.strip, "spatial,flexsm"), default=["spatial", "flexsm", "temporal"],
                   metavar="S,S", help="MuxServe's systems to simulate as it placed them: spatial (one model per mesh), "
                                       "flexsm (MuxServe: models sharing a mesh under MPS), temporal (time "
                                       "multiplexing on MuxServe's placement) (default: all three)")
    p.add_argument("--calibrate-on", default="condense800", metavar="LEVEL",
                   help="the level whose measurements fit the step-time model ('none': the roofline only; default: "
                        "%(default)s)")
    p.add_argument("--lengths", choices=["per-model", "level-mean", "sharegpt", "alpaca-eval"], default="per-model",
                   help="request lengths: ShareGPT's first turns scaled to each model's own mean tokens per request "
                        "(MuxServe's tokens/s over its requests/s: 209 to 443), to the level's average output (261), "
                        "as ShareGPT has them (366 after MuxServe's filter), or each model answering as a different "
                        "LLM of AlpacaEval's 62, 16 spread over their answer lengths (default: %(default)s)")
    p.add_argument("--first-turns", type=int, default=None, metavar="N",
                   help="draw lengths from the first N ShareGPT first turns (default: all 14,736; counting them with "
                        "the LLaMA tokenizer takes about 16 s, fewer make a quick run)")
    p.add_argument("--replays", type=int, default=3, metavar="N",
                   help="arrival and length draws per model, averaged (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench-results/models", help="(default: %(default)s)")
    p.add_argument("--json", help="write results here (default: OUT_DIR/bench_models_fidelity.json; the PNG beside it)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(a: argparse.Namespace) -> int:
    from rich.console import Console

    if a.on_engines:
        return _on_engines(a, Console())

    from serving.bench.models.muxserve import SYSTEMS, MuxServeDataError, load_levels

    console = Console()
    try:
        levels = load_levels()
    except MuxServeDataError as exc:
        print(f"lengthwise bench models: error: {exc}", file=sys.stderr)
        return 2
    chosen = a.levels or list(levels)
    unknown = [name for name in [*chosen, *([] if a.calibrate_on == "none" else [a.calibrate_on])] if name not in levels]
    if unknown:
        print(f"lengthwise bench models: error: unknown level {unknown[0]!r}; levels: {', '.join(levels)}",
              file=sys.stderr)
        return 2
    out = Path(a.json) if a.json else Path(a.out_dir) / ("bench_models_fidelity.json" if a.fidelity
                                                         else "bench_models_gpus.json")
    if a.replays < 1:
        print("lengthwise bench models: error: --replays must be at least 1", file=sys.stderr)
        return 2
    if a.first_turns is not None and a.first_turns < 100:
        print("lengthwise bench models: error: --first-turns needs at least 100 first turns to draw lengths from",
              file=sys.stderr)
        return 2
    bad = [s for s in a.systems if s not in SYSTEMS]
    if bad:
        print(f"lengthwise bench models: error: unknown system {bad[0]!r}; systems: {', '.join(SYSTEMS)}", file=sys.stderr)
        return 2
    def save(r: dict) -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(r, indent=1, default=_plain))

    if a.drift:
        return _drift(a, levels, chosen[0], console)
    if a.gpus_needed:
        from serving.bench.models.needed import PLACEMENTS, plot_needed, run_needed

        bad = [x for x in a.placements if x not in PLACEMENTS]
        error = (f"unknown placement {bad[0]!r}; built: {', '.join(PLACEMENTS)}" if bad
                 else "--duration must be a positive number of seconds" if a.duration <= 0
                 else "--arrival-cv must be between 0 and 100" if not 0 < a.arrival_cv < 100 else None)
        if error:
            print(f"lengthwise bench models: error: {error}", file=sys.stderr)
            return 2
        # each level's results are saved as it ends, so that a long run keeps what it has done
        res = run_needed(levels, chosen, a.placements, a.calibrate_on, a.lengths, a.seed, console, a.first_turns,
                         a.replays, a.duration, on_level=save, arrival_cv=a.arrival_cv)
        plot = plot_needed
    else:
        res = run_fidelity(levels, chosen, a.calibrate_on, a.lengths, a.seed, console, a.first_turns, a.replays,
                           tuple(a.systems))
        plot = plot_fidelity
    save(res)
    png = plot(res, out.with_suffix(".png"))
    console.print(f"JSON: {out}\nplot: {png}")
    return 0


def _drift(a: argparse.Namespace, levels: dict, level: str, console) -> int:
    from serving.bench.models.drift import ARMS, DriftConfig, DriftError, plot_drift, run_drift

    bad = [x for x in a.arms if x not in ARMS]
    error = (f"unknown arm {bad[0]!r}; arms: {', '.join(ARMS)}" if bad
             else "--gpus must be between 1 and 64" if not 1 <= a.gpus <= 64
             else "--phases must be at least 2 (a drift needs a phase to drift to)" if a.phases < 2
             else "--phase-s must be at least 60 seconds" if a.phase_s < 60
             else "--lag-s must be 0 or more" if a.lag_s < 0 else None)
    if error:
        print(f"lengthwise bench models: error: {error}", file=sys.stderr)
        return 2
    dc = DriftConfig(gpus=a.gpus, phases=a.phases, phase_s=a.phase_s, lag_s=a.lag_s,
                     keep_while_fits=not a.move_on_any_regroup)
    try:
        res = run_drift(levels, level, a.arms, dc, a.lengths, a.seed, console, a.calibrate_on, a.first_turns)
    except DriftError as exc:  # an arm that places nothing on --gpus
        print(f"lengthwise bench models: error: {exc}", file=sys.stderr)
        return 2
    out = Path(a.json) if a.json else Path(a.out_dir) / "bench_models_drift.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=_plain))
    png = plot_drift(res, out.with_suffix(".png"))
    console.print(f"JSON: {out}\nplot: {png}")
    return 0


def _on_engines(a: argparse.Namespace, console) -> int:
    from pydantic import ValidationError

    from serving.bench.models.onengines import PLANS, OnEnginesConfig, run_on_engines

    bad = [x for x in a.plans if x not in PLANS]
    try:
        cfg = OnEnginesConfig(plans=a.plans, rate=a.rate, requests=a.requests, seed=a.seed)
    except ValidationError as exc:
        err = exc.errors()[0]
        print(f"lengthwise bench models: error: --{str(err['loc'][0]).replace('_', '-')}: {err['msg']}", file=sys.stderr)
        return 2
    if bad:
        print(f"lengthwise bench models: error: unknown plan {bad[0]!r}; plans: {', '.join(PLANS)}", file=sys.stderr)
        return 2
    out = Path(a.json) if a.json else Path(a.out_dir) / "bench_models_on_engines.json"
    res = run_on_engines(cfg, out, console)
    console.print(f"JSON: {out} (engines' and gateways' logs in {res['work_dir']})")
    return 0


def _plain(x: object) -> object:
    return None if isinstance(x, float) and not math.isfinite(x) else str(x)


def run_fidelity(levels: dict, chosen: list[str], calibrate_on: str, lengths: str, seed: int, console,
                 first_turns: int | None = None, replays: int = 3, systems: tuple[str, ...] = ("spatial",)) -> dict:
    """Both engines over the chosen levels and systems (calibrated on ``spatial`` at ``calibrate_on``: that run is
    marked, it is no test of itself; every other system and level is held out)."""
    import dataclasses

    from rich.progress import Progress

    from serving.bench.models.fidelity import FidelityConfig, calibrated, fidelity, summary
    from serving.progress import logged

    def config(level) -> FidelityConfig:
        return FidelityConfig(lengths=lengths, seed=seed, lengths_limit=first_turns, replays=replays)

    res: dict = {"setting": {"lengths": lengths, "first_turns": first_turns, "seed": seed, "replays": replays,
                             "policy": FidelityConfig.policy, "gpu": "a100-80gb",
                             "systems": list(systems)},
                 "levels": {}}
    with Progress(console=console, transient=True) as progress, logged(progress, "bench models"):
        engines, calibration = calibrated(levels, calibrate_on, config, progress)
        if calibration:
            res["calibration"] = calibration
        task = progress.add_task("simulating", total=len(chosen) * len(systems) * len(engines) * 16)
        for name in chosen:
            level = levels[name]
            res["levels"][name] = {}
            for system in systems:
                res["levels"][name][system] = {}
                for label, engine in engines.items():
                    rows = fidelity(level, system, dataclasses.replace(config(level), engine=engine),
                                    on_model=lambda _: progress.advance(task))
                    fitted = label == "calibrated" and name == calibrate_on and system == "spatial"
                    res["levels"][name][system][label] = {"models": rows, "summary": summary(rows), "held_out": not fitted}
    print_fidelity(res, console)
    return res


def print_fidelity(res: dict, console) -> None:
    from rich.table import Table

    for name, systems in res["levels"].items():
        for system, engines in systems.items():
            t = Table(title=f"{name}: {system}, simulated / MuxServe's measured (error)")
            for col in ("model", "size", "GPUs", "shares with", "req/s", "engine", "throughput", "p99 latency s",
                        "mean TTFT s", "mean TPOT s"):
                t.add_column(col, justify="left" if col in ("model", "size", "engine", "shares with") else "right")
            for label, run in engines.items():
                for model, r in run["models"].items():
                    s, m, e = r["simulated"], r["measured"], r["error"]
                    cells = [f"{s[k]:.3g} / {m[k]:.3g} ({e[k]:+.0%})" for k in ("throughput_rps", "jct_p99_s",
                                                                                  "ttft_mean_s", "tpot_mean_s")]
                    t.add_row(model, r["size"], str(r["gpus"]), ", ".join(r["shares_mesh_with"]) or "-",
                              f"{r['rate']:.1f}", label, *cells)
            console.print(t)
    t = Table(title="summary: median |error| and the share of models within 15% (throughput: also within twice its "
                    "arrival noise, and the level's total)")
    for col in ("level", "system", "engine", "held out", "throughput", "total throughput", "p90 latency",
                "p99 latency", "mean TTFT", "mean TPOT"):
        t.add_column(col)
    for name, systems in res["levels"].items():
        for system, label, run in ((sy, lb, r) for sy, engines in systems.items() for lb, r in engines.items()):
            sm = run["summary"]
            thr = sm["throughput_rps"]
            t.add_row(name, system, label, "yes" if run["held_out"] else "no (fitted here)",
                      f"{thr['median_abs_error']:.0%}, {thr['within']:.0%} ({thr.get('within_noise', math.nan):.0%})",
                      f"{thr.get('total_error', math.nan):+.1%}",
                      *(f"{sm[k]['median_abs_error']:.0%}, {sm[k]['within']:.0%}" for k in
                        ("jct_p90_s", "jct_p99_s", "ttft_mean_s", "tpot_mean_s")))
    console.print(t)


def plot_fidelity(res: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    systems = res["setting"]["systems"]
    for ax, key, title in ((axes[0], "throughput_rps", "throughput (req/s)"), (axes[1], "tpot_mean_s", "mean TPOT (s)")):
        lo, hi = math.inf, 0.0
        for (system, label), marker in zip(itertools.product(systems, ("roofline", "calibrated")), "o^sDvP"):
            xs, ys = [], []
            for by_system in res["levels"].values():
                run = by_system.get(system, {}).get(label)
                for r in (run or {}).get("models", {}).values():
                    xs.append(r["measured"][key])
                    ys.append(r["simulated"][key])
            if xs:
                ax.scatter(xs, ys, marker=marker, alpha=0.5, label=f"{system}, {label}")
                lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        if hi > 0:
            line = [lo * 0.8, hi * 1.25]
            ax.plot(line, line, "k-", lw=0.8)
            ax.fill_between(line, [v * 0.85 for v in line], [v * 1.15 for v in line], color="grey", alpha=0.2,
                            label="within 15%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"MuxServe measured {title}")
        ax.set_ylabel(f"simulated {title}")
        ax.legend()
    fig.suptitle("MuxServe's ChatLMSYS setting: our simulator against MuxServe's measurements")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
