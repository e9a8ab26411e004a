"""``lengthwise simulate`` and ``lengthwise bench sim``: run, print a table, write JSON and a PNG."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from serving.sim.metrics import RunMetrics
from serving.sim.predictions import bucket_accuracy
from serving.sim.scenarios import Setup
from serving.sim.sweep import BENCH_POLICIES, run_point, sweep_policy

# The fields `lengthwise simulate --json` promises (scripts outside the project read them).
CONTRACT = ("policy", "requests_total", "requests_completed", "slo_attainment", "throughput_rps", "normalized_latency_s",
            "jct_p50_s", "jct_p99_s", "ttft_p50_s", "tbt_p50_s", "preemptions", "kv_utilization", "sched_us_per_step", "wall_s")


def describe_setup(setup: Setup) -> dict:
    s = setup.scenario
    return {
        "scenario": s.name, "description": s.description, "workload": setup.workload.source,
        "requests": len(setup.requests), "dropped_over_context": setup.workload.dropped, "arrival": s.arrival,
        "arrivals": setup.arrivals,
        "model": s.model, "gpu": s.gpu, "latency_model": setup.latency.describe(), "kv_blocks": setup.kv_blocks,
        "predictor": setup.predictor.spec, "policy_config": setup.config.model_dump(),
        "slo": {"scale": setup.slo.scale, "t_p_s": setup.slo.t_p, "t_g_s": setup.slo.t_g, "ttft_s": setup.slo.ttft_s,
                "tpot_s": setup.slo.tpot_s},
    }


def simulate_once(setup: Setup, policy: str, rate: float | None, json_path: str | None, console: Console) -> RunMetrics:
    if rate is None:
        rate = setup.native_rate() if setup.scenario.arrival == "trace" else setup.scenario.start_rate
    m = run_point(setup, policy, rate)
    d = m.to_dict()
    t = Table(title=f"{policy} on {Path(setup.workload.source).name} at {rate:.3g} req/s ({len(setup.requests)} requests)")
    t.add_column("metric")
    t.add_column("value", justify="right")
    for k in ("requests_completed", "slo_attainment", "ttft_tpot_attainment", "throughput_rps", "goodput_rps",
              "normalized_latency_s", "jct_p50_s", "jct_p90_s", "jct_p99_s", "ttft_p50_s", "tbt_p50_s", "kv_utilization",
              "kv_allocated", "forward_size", "batch_size", "preemptions", "pauses", "hosted", "sched_us_per_step",
              "sim_requests_per_s"):
        v = d[k]
        t.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
    console.print(t)
    if json_path:
        out = {**d, "rate": rate, "setup": describe_setup(setup)}
        _write_json(json_path, out)
        console.print(f"JSON written to {json_path}")
    return m


def _write_json(path: str | Path, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(obj, indent=1, default=float))


@contextmanager
def sweep_progress(desc: str) -> Iterator[Callable[[str, float, RunMetrics], None]]:
    """A progress bar over a sweep's runs; yields the ``on_point`` callback :func:`sweep_policy` reports each run to."""
    from serving.progress import Counter

    bar = Counter(desc, unit="run")

    def on_point(policy: str, rate: float, m: RunMetrics) -> None:
        bar.update(1)
        bar.set_postfix_str(f"{policy} @ {rate:.3g}/s: SLO {m.slo_attainment:.2f}")

    try:
        yield on_point
    finally:
        bar.close()


def bench_sim(setup: Setup, policies: list[str], json_path: Path, png_path: Path, console: Console) -> dict:
    """Sweep every policy; print the table; write JSON (policy → max rate and curve) and the figure."""
    t0 = time.perf_counter()
    with sweep_progress(setup.scenario.name) as on_point:
        results = {p: sweep_policy(setup, p, on_point=on_point) for p in policies}
    base = results.get("vllm", {}).get("max_rate_at_90_slo") or None
    table = Table(title=f"{setup.scenario.name}: max rate at >= 90% SLO attainment ({len(setup.requests)} requests, "
                        f"predictor {setup.predictor.spec})")
    for col in ("policy", "max req/s", "x vllm", "peak thr.", "JCT SLO att.", "TTFT+TPOT att.", "norm. lat. (s/tok)",
                "p99 JCT (s)", "preempt",
                "pauses", "hosted", "KV used", "KV alloc", "sched us/step", "sim req/s"):
        table.add_column(col, justify="left" if col == "policy" else "right")
    for p, r in results.items():
        best = _point_at(r["curve"], r["max_rate_at_90_slo"])
        ratio = r["max_rate_at_90_slo"] / base if base else float("nan")
        r["ratio_vs_vllm"] = ratio
        table.add_row(p, rate_text(r), f"{ratio:.2f}", f"{r['peak_throughput_rps']:.3g}",
                      *(f"{best[k]:.3g}" if best else "-" for k in ("slo_attainment", "ttft_tpot_attainment",
                                                                 "normalized_latency_s", "jct_p99_s")),
                      *(str(best[k]) if best else "-" for k in ("preemptions", "pauses", "hosted")),
                      *(f"{best[k]:.2f}" if best else "-" for k in ("kv_utilization", "kv_allocated")),
                      f"{best['sched_us_per_step']:.0f}" if best else "-", f"{best['sim_requests_per_s']:.0f}" if best else "-")
    Console(width=max(console.width, 170)).print(table)
    out = {**results, "_meta": {**describe_setup(setup), "wall_s": time.perf_counter() - t0, "png": str(png_path)}}
    _write_json(json_path, out)
    plot_sweep(results, png_path, title=f"{setup.scenario.name} ({setup.scenario.model} on {setup.scenario.gpu})")
    console.print(f"JSON: {json_path}\nPNG:  {png_path}")
    return out


# Policies that never read a prediction: swept once, drawn as flat reference lines.
BLIND = ("vllm", "vllm-v0", "orca", "sarathi", "fcfs-max-alloc", "oracle")


def prediction_quality(setup: Setup) -> dict:
    """Top-1 accuracy at 200-token buckets and Kendall tau of the setup's predictions against the truth."""
    from training.evaluate import kendall_tau

    truth = np.array([r.output_tokens for r in setup.requests], dtype=np.float64)
    pred = np.array([p.length for p in setup.predictions], dtype=np.float64)
    return {"accuracy": bucket_accuracy(truth, pred), "kendall_tau": kendall_tau(pred, truth)}


def bench_quality(setups: dict[str, Setup], policies: list[str], json_path: Path, png_path: Path, console: Console) -> dict:
    """Benefit against prediction quality: each length-aware policy's max rate under each predictor.

    Prediction-blind policies run once (under the first predictor) as the reference lines.
    """
    t0 = time.perf_counter()
    specs = list(setups)
    quality = {spec: prediction_quality(setups[spec]) for spec in specs}
    rates: dict[str, dict[str, float]] = {}
    with sweep_progress("quality sweep") as on_point:
        for p in policies:
            for spec in specs[:1] if p in BLIND else specs:
                rates.setdefault(p, {})[spec] = sweep_policy(setups[spec], p, on_point=on_point)["max_rate_at_90_slo"]
    table = Table(title=f"{setups[specs[0]].scenario.name}: max req/s at >= 90% SLO by predictor quality")
    table.add_column("policy")
    for spec in specs:
        q = quality[spec]
        table.add_column(f"{spec}\nacc {q['accuracy']:.2f} tau {q['kendall_tau']:.2f}", justify="right")
    for p, by in rates.items():
        table.add_row(p, *(f"{by[s]:.3g}" if s in by else f"({next(iter(by.values())):.3g})" for s in specs))
    Console(width=max(console.width, 170)).print(table)
    out = {"quality": quality, "max_rate_at_90_slo": rates,
           "_meta": {**describe_setup(setups[specs[0]]), "predictors": specs, "wall_s": time.perf_counter() - t0}}
    _write_json(json_path, out)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    xs = [quality[s]["accuracy"] for s in specs]
    for i, (p, by) in enumerate(rates.items()):
        if p in BLIND:
            ax.axhline(next(iter(by.values())), ls="--", lw=0.9, label=f"{p} (blind)", color="grey" if p != "vllm" else "black")
        else:
            ax.plot([quality[s]["accuracy"] for s in by], list(by.values()), label=p, **line_style(i))
    ax.set_xlabel("predictor top-1 accuracy at 200-token buckets")
    ax.set_ylabel("max req/s at >= 90% JCT SLO")
    ax.set_xlim(min(xs) - 0.05, 1.02)
    ax.legend(fontsize=7)
    ax.set_title("benefit against prediction quality")
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    console.print(f"JSON: {json_path}\nPNG:  {png_path}")
    return out


def bench_length_noise(setups: dict[float, Setup], policies: list[str], json_path: Path, png_path: Path,
                       console: Console) -> dict:
    """SeaLLM's figure 13 in the simulator: each policy's max rate at >= 90% SLO, and its normalised latency there, as
    output lengths get noisier than anything a prediction or a profile knows (each setup's ``length_noise``)."""
    t0 = time.perf_counter()
    sigmas = list(setups)
    results: dict[str, dict[str, dict]] = {}
    with sweep_progress("length-noise sweep") as on_point:
        for sigma in sigmas:
            for p in policies:
                r = sweep_policy(setups[sigma], p, on_point=on_point)
                best = _point_at(r["curve"], r["max_rate_at_90_slo"]) or {}
                results.setdefault(p, {})[f"{sigma:g}"] = {
                    "max_rate_at_90_slo": r["max_rate_at_90_slo"], "first_failing_rate": r["first_failing_rate"],
                    "normalized_latency_s": best.get("normalized_latency_s"), "jct_p99_s": best.get("jct_p99_s"),
                    "curve": r["curve"]}
    table = Table(title=f"{setups[sigmas[0]].scenario.name}: max req/s at >= 90% SLO (normalised latency there, s/token) "
                        "by output-length noise (std x length)")
    table.add_column("policy")
    for sigma in sigmas:
        table.add_column(f"noise {sigma:g}", justify="right")
    for p, by in results.items():
        table.add_row(p, *(f"{rate_text(by[f'{s:g}'])} ({by[f'{s:g}']['normalized_latency_s'] or 0:.3f})"
                           for s in sigmas))
    Console(width=max(console.width, 170)).print(table)
    meta = describe_setup(setups[sigmas[0]])
    out = {"by_policy": results, "_meta": {**meta, "length_noises": sigmas, "wall_s": time.perf_counter() - t0}}
    _write_json(json_path, out)
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for i, (p, by) in enumerate(results.items()):
        ax.plot(sigmas, [by[f"{s:g}"]["max_rate_at_90_slo"] for s in sigmas], label=p, **line_style(i))
    ax.set_xlabel("output-length noise (std of the Gaussian delta, x the length)")
    ax.set_ylabel("max req/s at >= 90% JCT SLO")
    ax.legend(fontsize=7)
    ax.set_title("SeaLLM's figure 13: lengths noisier than any profile or prediction")
    fig.tight_layout()
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    console.print(f"JSON: {json_path}\nPNG:  {png_path}")
    return out


def rate_text(r: dict) -> str:
    """A max rate as a table shows it: with ">=" when no rate the search tried fell below the target (the search
    stopped at its last point, so the knee is higher)."""
    return f"{'>=' if r.get('first_failing_rate') is None else ''}{r['max_rate_at_90_slo']:.3g}"


def _point_at(curve: list[dict], rate: float) -> dict | None:
    return next((c for c in curve if abs(c["rate"] - rate) < 1e-9), None)


def line_style(i: int) -> dict:
    """A distinct colour/line/marker per series: ten colours, then dashed lines with other markers."""
    return {"color": f"C{i % 10}", "ls": ("-", "--", ":")[i // 10 % 3], "marker": "os^"[i // 10 % 3], "ms": 3}


def plot_sweep(results: dict, path: Path, title: str = "") -> Path:
    """Normalized latency and SLO attainment against request rate, one line per policy (EcoServe Fig. 10)."""
    fig = Figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    names = [n for n in results if not n.startswith("_")]
    for i, name in enumerate(names):
        r = results[name]
        rates = [c["rate"] for c in r["curve"]]
        style = line_style(i)
        ax1.plot(rates, [c["normalized_latency_s"] for c in r["curve"]], label=name, **style)
        ax2.plot(rates, [c["slo_attainment"] for c in r["curve"]], label=name, **style)
    ax1.set_yscale("log")
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("normalized latency (s/token)")
    ax2.axhline(0.9, color="grey", ls="--", lw=0.8)
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("JCT SLO attainment")
    ax2.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


__all__ = ["BENCH_POLICIES", "CONTRACT", "bench_quality", "bench_sim", "plot_sweep", "simulate_once"]
