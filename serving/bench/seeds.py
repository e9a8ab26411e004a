"""``lengthwise bench sim --seeds 0,1,2``: each policy's max rate under one SLO kind, on several seeds side by side.

One seed is one draw of arrivals and prediction noise; a ratio that holds on one draw can vanish on the next. So
every policy is swept on every seed, its ratio to each named baseline taken seed by seed (the same arrivals and the
same predictions), and the table shows the mean with the spread. Whatever the search judges by, every run reports
all three SLO kinds: JCT attainment (EcoServe), TTFT+TPOT attainment (DistServe, ``vllm bench serve --goodput``) and
mean normalised latency (SeaLLM). The ``normalised`` kind is judged by attainment of an SLO that is a multiple of
each request's own execution time (SeaLLM §5), which is the JCT SLO's definition, so its max rate is the JCT one.

Each policy is also run at stock vLLM's knee (``vllm``'s max rate on that seed), where its TTFT p99 is compared with
stock's: a scheduler that wins rate by starving first tokens shows there.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from serving.bench.sim import describe_setup, line_style, sweep_progress
from serving.sim.scenarios import Setup
from serving.sim.sweep import run_point, sweep_policy

JUDGE_KEY = {"jct": "slo_attainment", "normalised": "slo_attainment", "ttft+tpot": "ttft_tpot_attainment"}
REPORTED = ("slo_attainment", "ttft_tpot_attainment", "normalized_latency_s", "ttft_p99_s", "jct_p99_s", "preemptions")


def _spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "values": values}


def _pick(m: dict) -> dict:
    return {k: m.get(k) for k in REPORTED}


def bench_seeds(setups: dict[int, Setup], policies: list[str], judge: str, baselines: list[str], json_path: Path,
                console: Console) -> dict:
    """Sweep every policy on every seed's setup; ratios to ``baselines`` seed by seed; write JSON and a PNG."""
    t0 = time.perf_counter()
    key = JUDGE_KEY[judge]
    order = ["vllm", *[p for p in policies if p != "vllm"]]  # stock first: every policy is also run at its knee
    per: dict[str, dict[int, dict]] = {}
    with sweep_progress(f"{next(iter(setups.values())).scenario.name}, {len(setups)} seeds") as on_point:
        for seed, setup in setups.items():
            knee = None
            for p in order:
                r = sweep_policy(setup, p, key=key, on_point=on_point)
                best = next((c for c in r["curve"] if abs(c["rate"] - r["max_rate_at_90_slo"]) < 1e-9), {})
                if p == "vllm":
                    knee = r["max_rate_at_90_slo"]
                at_knee = run_point(setup, p, knee).to_dict() if knee else {}
                per.setdefault(p, {})[seed] = {"max_rate": r["max_rate_at_90_slo"], "bounded": r["first_failing_rate"]
                                               is not None, "at_max": _pick(best), "at_stock_knee": _pick(at_knee),
                                               "stock_knee_rate": knee, "curve": r["curve"]}
    seeds = list(setups)
    summary: dict[str, dict] = {}
    for p in order:
        runs = per[p]
        row = {"max_rate": _spread([runs[s]["max_rate"] for s in seeds]),
               "bounded": all(runs[s]["bounded"] for s in seeds)}
        for b in baselines:
            if b in per:
                row[f"x_{b}"] = _spread([runs[s]["max_rate"] / per[b][s]["max_rate"] if per[b][s]["max_rate"] else
                                         float("nan") for s in seeds])
        stock = [per["vllm"][s]["at_stock_knee"].get("ttft_p99_s") for s in seeds]
        row["ttft_p99_vs_stock_at_knee"] = _spread([runs[s]["at_stock_knee"]["ttft_p99_s"] / t if t else float("nan")
                                                    for s, t in zip(seeds, stock)])
        row["preemptions_at_knee"] = _spread([runs[s]["at_stock_knee"]["preemptions"] for s in seeds])
        for k in ("slo_attainment", "ttft_tpot_attainment", "normalized_latency_s"):
            row[f"{k}_at_knee"] = _spread([runs[s]["at_stock_knee"][k] for s in seeds])
        summary[p] = row
    _table(summary, baselines, judge, setups, console)
    meta = {**describe_setup(next(iter(setups.values()))), "seeds": seeds, "judge": judge, "baselines": baselines,
            "wall_s": time.perf_counter() - t0}
    out = {"summary": summary, "per_seed": per, "_meta": meta}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1, default=float))
    _plot(per, summary, seeds, judge, json_path.with_suffix(".png"), meta["scenario"])
    console.print(f"JSON: {json_path}\nPNG:  {json_path.with_suffix('.png')}")
    return out


def _fmt(s: dict, digits: str = ".3g") -> str:
    return f"{s['mean']:{digits}} [{s['min']:{digits}}-{s['max']:{digits}}]"


def _table(summary: dict, baselines: list[str], judge: str, setups: dict[int, Setup], console: Console) -> None:
    setup = next(iter(setups.values()))
    t = Table(title=f"{setup.scenario.name}: max req/s at >= 90% {judge} attainment, seeds {', '.join(map(str, setups))} "
                    f"(mean [min-max]; predictor {setup.predictor.spec}, arrivals {setup.arrivals})")
    for col in ("policy", "max req/s", *(f"x {b}" for b in baselines), "at stock's knee: JCT att.", "TTFT+TPOT att.",
                "norm. lat. (s/tok)", "TTFT p99 / stock's", "preemptions"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for p, row in summary.items():
        t.add_row(p, ("" if row["bounded"] else ">=") + _fmt(row["max_rate"]),
                  *(_fmt(row[f"x_{b}"], ".2f") if f"x_{b}" in row else "-" for b in baselines),
                  _fmt(row["slo_attainment_at_knee"], ".3f"), _fmt(row["ttft_tpot_attainment_at_knee"], ".3f"),
                  _fmt(row["normalized_latency_s_at_knee"], ".3f"), _fmt(row["ttft_p99_vs_stock_at_knee"], ".2f"),
                  _fmt(row["preemptions_at_knee"], ".0f"))
    Console(width=max(console.width, 200)).print(t)


def _plot(per: dict, summary: dict, seeds: list[int], judge: str, path: Path, scenario: str) -> None:
    fig = Figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    key = JUDGE_KEY[judge]
    for i, (p, runs) in enumerate(per.items()):
        curve = runs[seeds[0]]["curve"]
        style = line_style(i)
        ax1.plot([c["rate"] for c in curve], [c[key] for c in curve], label=p, **style)
        rate = summary[p]["max_rate"]
        ax2.errorbar([i], [rate["mean"]], yerr=[[rate["mean"] - rate["min"]], [rate["max"] - rate["mean"]]], fmt="o",
                     color=style["color"])
    ax1.axhline(0.9, color="grey", ls="--", lw=0.8)
    ax1.set_xlabel(f"request rate (req/s), seed {seeds[0]}")
    ax1.set_ylabel(f"{judge} attainment")
    ax1.legend(fontsize=7)
    ax2.set_xticks(range(len(per)), list(per), rotation=45, ha="right", fontsize=7)
    ax2.set_ylabel("max req/s at >= 90% (seeds: mean, min-max)")
    fig.suptitle(f"{scenario}: {judge}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
