"""``lengthwise bench overload``: the gateway's outstanding bound past saturation, measured on real engines.

The claim under test (serving/gateway/admission.py): past the fleet's capacity, a gateway that answers 429 at once
beyond its bound on requests in flight keeps its goodput flat, and the requests it accepts still meet their SLOs;
without the bound every request queues, each waits longer, and goodput collapses.

On ``bench fleet``'s calibrated fleet (:mod:`serving.bench.load.run`), with R the saturation rate (the
calibrated simulator's 90% point under the placement, or ``--rate``), the same ShareGPT trace is replayed at m x R
for each multiple m, through two gateways in turn: "bounded" (the gateway's default bound, 2 x the engines'
max_num_seqs per engine, or the bench's ``--max-outstanding``) and "unbounded" (both bounds far above any run), and with
``--arms`` "learnt": the bounded gateway with ``--engine-bound slo``, each engine's bound learnt from the SLO its
answers meet (:mod:`serving.gateway.concurrency`), at most the bounded arm's; "learnt-at-end": the same with every
answer judged at its end (``--engine-bound-checkpoint 0``: the ablation of judging a stream at its checkpoint); and
"learnt-kept": the same as "learnt", but one
gateway kept through the whole sweep (the multiples in ascending order), so each run starts from the bounds the runs
before it left, as in a gateway that has been serving, where every other arm starts a fresh one per run.
Per run: goodput (requests that met their TTFT and ATGT targets, per second from the first send to the last answer),
attainment among the accepted (everything but the 429s), their TTFT, the 429s and how fast they came back, and the
most requests the client had in flight at once (whether the bound was reached at all).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, Literal, get_args

import httpx
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from serving.bench.fleet import (
    FleetBenchConfig,
    gateway_args,
    replay_jobs,
    request_settings,
    running_gateway,
    wait_idle,
    wrong_or_lost,
)
from serving.bench.load.run import Fleet, calibrated_fleet, calibration_record, error_kind, meets_slo, pct, trace_jobs
from serving.bench.load.servedrate import served_rate
from serving.bench.replay import Result
from serving.launch.process import free_port
from serving.perf.slo import SLO

MULTIPLES = (0.5, 1.0, 1.5, 2.0, 3.0)
Arm = Literal["bounded", "learnt", "learnt-at-end", "learnt-kept", "unbounded"]
ARMS: tuple[str, ...] = get_args(Arm)
UNBOUNDED = 1_000_000  # --max-outstanding and --max-outstanding-per-engine of the "unbounded" gateway
KEPT_GOODPUT = 0.8     # the claim holds when, past saturation, bounded goodput stays at least this share of its peak...
ACCEPTED_ATTAINMENT = 0.9  # ...and at least this share of the accepted requests meets the SLO


class OverloadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    multiples: list[float] = Field(default_factory=lambda: list(MULTIPLES))
    placement: str = "jsq"
    arms: list[Arm] = Field(default_factory=lambda: ["bounded", "unbounded"])
    max_outstanding: int | None = Field(None, ge=1, description="the bounded gateway's --max-outstanding (default: its own)")
    max_outstanding_per_engine: int | None = Field(None, ge=1, description="the bounded gateway's per-engine bound")
    rate_from: Literal["served", "simulator"] = Field("served", description="R without --rate: measured through an "
                                                      "unbounded gateway (servedrate) or the calibrated simulator's")
    probe_requests: int = Field(60, ge=4, description="requests per probe when R is measured (the CLI: the runs' own "
                                "--max-requests, since a shorter probe ends before the queues a run builds)")
    fleet: FleetBenchConfig


def run_summary(results: list[Result], slo: SLO) -> dict[str, Any]:
    """One run's row: what was offered, accepted and refused, and how the accepted fared.

    Accepted: every request not answered 429 (one that failed after the gateway took it counts as a miss). Goodput:
    requests that met their SLO per second from the first send to the last answer, so a run that leaves a backlog
    to drain is charged for the drain."""
    n = len(results)
    refused = [r for r in results if r.status == 429]
    accepted = [r for r in results if r.status != 429]
    missed = miss_kinds(accepted, slo)
    met = len(accepted) - sum(missed.values())
    start = min((r.sent for r in results), default=0.0)
    end = max((r.sent + (r.jct or 0.0) for r in results), default=0.0)
    last_send = max((r.sent for r in results), default=0.0)
    ttft = [r.ttft for r in accepted if r.ok and r.ttft is not None]
    return {
        "requests": n, "offered_rps": (n - 1) / (last_send - start) if n > 1 and last_send > start else None,
        "accepted": len(accepted), "rejected_429": len(refused),
        "completed": sum(1 for r in results if r.ok),
        "errors": dict(sorted(Counter(error_kind(r) for r in accepted if not r.ok).items())),
        "met_slo": met, "missed": missed, "duration_s": end - start,
        "goodput_rps": met / (end - start) if end > start else 0.0,
        "attainment_accepted": met / len(accepted) if accepted else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "slowest_429_s": max((r.jct for r in refused if r.jct is not None), default=None),
        "peak_in_flight": peak_in_flight(accepted),
        "wrong_length": sum(1 for r in accepted if r.ok and r.output_tokens != r.trace_output_tokens),
        # enough of each failure to tell a request refused on arrival (no status) from a stream cut part-way
        "failures": [{"index": r.index, "status": r.status, "error": r.error, "sent_s": round(r.sent, 3),
                      "after_s": None if r.jct is None else round(r.jct, 3), "output_tokens": r.output_tokens}
                     for r in accepted if not r.ok][:5],
    }


def miss_kinds(accepted: list[Result], slo: SLO) -> dict[str, int]:
    """Why the accepted requests that missed their SLO missed it: "failed" (no complete answer), "ttft" (the first token
    late), "atgt" (first token in time, the later ones slower than the target on average). A bound on requests in
    flight acts on the two differently (a newcomer's wait for a place against the pace of a fuller batch), so the
    sweep's misses are only readable split this way."""
    out = {"failed": 0, "ttft": 0, "atgt": 0}
    for r in accepted:
        if meets_slo(r, slo):
            continue
        out["failed" if not r.ok or r.ttft is None or r.jct is None else "ttft" if r.ttft > slo.ttft_s else "atgt"] += 1
    return out


def peak_in_flight(results: list[Result]) -> int:
    """The most requests open at once on the client (sent, answer not yet complete). An answer's end reaches the client
    after the gateway freed its slot, so this may pass the bound the gateway kept (``gateway_peak_in_flight``)."""
    events = sorted([(r.sent, 1) for r in results] + [(r.sent + (r.jct or 0.0), -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    peak = now = 0
    for _, d in events:
        now += d
        peak = max(peak, now)
    return peak


def verdict(runs: list[dict[str, Any]], rate: float) -> dict[str, Any]:
    """Does the claim hold? Past saturation (m > 1) bounded goodput keeps at least KEPT_GOODPUT of its peak at m <= 1, and
    at least ACCEPTED_ATTAINMENT of its accepted requests meet the SLO; the unbounded arm's kept share beside it."""
    out: dict[str, Any] = {"kept_goodput_threshold": KEPT_GOODPUT, "accepted_attainment_threshold": ACCEPTED_ATTAINMENT}
    for arm in sorted({r["arm"] for r in runs}, key=ARMS.index):
        mine = [r for r in runs if r["arm"] == arm]
        under = [r["goodput_rps"] for r in mine if r["multiple"] <= 1.0]
        past = [r for r in mine if r["multiple"] > 1.0]
        peak = max(under, default=0.0)
        out[arm] = {
            "peak_goodput_at_or_below_R": peak if under else None,
            "min_kept_goodput_past_R": min((r["goodput_rps"] / peak for r in past), default=None) if peak else None,
            "min_attainment_accepted_past_R": min((r["attainment_accepted"] for r in past
                                                   if r["attainment_accepted"] is not None), default=None),
            "rejected_429": sum(r["rejected_429"] for r in mine),
        }
    for arm in [a for a in ARMS if a in out and a != "unbounded"]:
        b = out[arm]
        if b["min_kept_goodput_past_R"] is None or b["min_attainment_accepted_past_R"] is None:
            b["holds"], b["why"] = None, "needs runs at or below R and past R"
        else:
            b["holds"] = (b["min_kept_goodput_past_R"] >= KEPT_GOODPUT
                          and b["min_attainment_accepted_past_R"] >= ACCEPTED_ATTAINMENT)
            b["why"] = (f"past {rate:.3g} req/s the {arm} gateway kept >= {b['min_kept_goodput_past_R']:.2f} of its peak "
                        f"goodput and >= {b['min_attainment_accepted_past_R']:.2f} attainment among the accepted")
    first = next((a for a in ARMS if a in out and a != "unbounded"), None)
    out["holds"], out["why"] = (None, "no bounded arm ran") if first is None else (out[first]["holds"], out[first]["why"])
    return out


def run_overload_bench(cfg: OverloadConfig, json_path: Path, console: Console) -> dict[str, Any]:
    """The sweep, the table, the JSON and the PNG; returns what it wrote."""
    runs: list[dict[str, Any]] = []
    measured: dict[str, Any] | None = None
    with calibrated_fleet(cfg.fleet, cfg.placement, console, "lengthwise-bench-overload-") as fleet, \
            contextlib.ExitStack() as stack:
        kept = _Kept(stack)
        if cfg.fleet.rate is None and cfg.rate_from == "served":
            measured = _served_rate(cfg, fleet, console)
            fleet = dataclasses.replace(fleet, rate=measured["rate_rps"])
            console.print(f"R = {fleet.rate:.3g} req/s, measured through the gateway")
        metrics_urls = [p.url + "/metrics" for p in fleet.procs]
        for m in sorted(cfg.multiples):
            for arm in sorted(cfg.arms, key=ARMS.index):
                not_idle = wait_idle(metrics_urls)
                if not_idle:
                    console.print(f"[yellow]warning[/]: {not_idle}; the run starts anyway (recorded as not_idle_at_start)")
                row = {"multiple": m, "arm": arm, "rate": m * fleet.rate, **_one_run(cfg, fleet, m, arm, console, kept),
                       "not_idle_at_start": not_idle}
                runs.append(row)
                console.print(f"  {m:g} x R {arm}: goodput {row['goodput_rps']:.3g} req/s, {row['rejected_429']} x 429, "
                              f"attainment among accepted {_f(row['attainment_accepted'])}")
        slo, rate, work, fcfg, calibration = fleet.cal.slo, fleet.rate, fleet.work, fleet.cfg, calibration_record(fleet)
    out = {"config": {**cfg.model_dump(exclude={"fleet"}), "fleet": fcfg.model_dump()}, "saturation_rate_rps": rate,
           "rate_from": ("--rate" if cfg.fleet.rate else f"measured through the gateway ({cfg.placement}, 90% TTFT+ATGT)"
                         if measured else f"calibrated simulator ({cfg.placement}, 90% TTFT+ATGT)"),
           "served_rate": measured,
           "slo": {"ttft_s": slo.ttft_s, "atgt_s": slo.tpot_s, "t_p_s": slo.t_p, "t_g_s": slo.t_g},
           "calibration": calibration, "runs": runs, "verdict": verdict(runs, rate), "work_dir": str(work)}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    png = json_path.with_suffix(".png")
    out["png"] = str(plot_overload(out, png))
    json_path.write_text(json.dumps(out, indent=1))
    print_overload(out, console)
    console.print(f"JSON: {json_path}\nPNG: {png}")
    return out


def _one_run(cfg: OverloadConfig, fleet: Fleet, m: float, arm: str, console: Console,
             kept: _Kept) -> dict[str, Any]:
    """The trace at m x R through a fresh gateway with the arm's bounds ("learnt-kept": the sweep's one, ``kept``)."""
    fc = fleet.cfg
    jobs = trace_jobs(fleet, m * fleet.rate)
    bounds = _bounds(cfg, arm)
    keep = arm == "learnt-kept"
    with contextlib.ExitStack() as fresh:
        url = kept.url if keep else None
        if url is None:
            port = free_port()
            args = gateway_args(fc, cfg.placement, port, fleet.cal, fleet.model, fleet.procs, [])
            for flag, value in zip(("--max-outstanding", "--max-outstanding-per-engine"), bounds):
                if value is not None:
                    args += [flag, str(value)]
            if arm.startswith("learnt"):
                args += ["--engine-bound", "slo"]
            if arm == "learnt-at-end":
                args += ["--engine-bound-checkpoint", "0"]
            name = f"gateway-{arm}.log" if keep else f"gateway-{m:g}x-{arm}.log"
            url, _ = (kept.stack if keep else fresh).enter_context(running_gateway(args, port, fleet.work / name))
            if keep:
                kept.url = url
        console.print(f"[bold]{m:g} x R = {m * fleet.rate:.3g} req/s, {arm}[/]: {len(jobs)} requests")
        sends = request_settings(url, fleet.model, jobs, [p.length for p in fleet.trace.preds])
        res, _wall = asyncio.run(replay_jobs(jobs, sends))
        health = httpx.get(url + "/health", timeout=10).json()
    row = run_summary(res, fleet.cal.slo)
    row["gateway_peak_in_flight"] = health.get("inflight_peak")
    row["learnt_bounds"] = {e["name"]: e["bound"] for e in health.get("engines", []) if "bound" in e} or None
    row["bounds"] = {"max_outstanding": bounds[0], "max_outstanding_per_engine": bounds[1],
                     "gateway_max_outstanding": health.get("max_outstanding")}
    row["lost_ids"] = [i for i in wrong_or_lost(res) if res[i].status != 429][:20]
    return row


@dataclasses.dataclass
class _Kept:
    """The learnt-kept arm's one gateway: started at its first run, stopped with the sweep. Its ``/health`` counts from
    its start, so that arm's gateway peak in flight and learnt-bound counters are the sweep's so far."""

    stack: contextlib.ExitStack
    url: str | None = None


def _served_rate(cfg: OverloadConfig, fleet: Fleet, console: Console) -> dict[str, Any]:
    """R measured through an unbounded gateway (the stack's own capacity, not the bound's); RuntimeError when even the
    ladder's last probe misses the target."""
    port = free_port()
    args = gateway_args(fleet.cfg, cfg.placement, port, fleet.cal, fleet.model, fleet.procs, [])
    args += ["--max-outstanding", str(UNBOUNDED), "--max-outstanding-per-engine", str(UNBOUNDED)]
    with running_gateway(args, port, fleet.work / "gateway-probe.log") as (url, _):
        return served_rate(fleet, url, cfg.probe_requests, console)


def _bounds(cfg: OverloadConfig, arm: str) -> tuple[int | None, int | None]:
    """The gateway's (--max-outstanding, --max-outstanding-per-engine) for an arm; None: the gateway's default. The learnt
    arm's per-engine bound is its ceiling."""
    if arm == "unbounded":
        return UNBOUNDED, UNBOUNDED
    return cfg.max_outstanding, cfg.max_outstanding_per_engine


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def print_overload(out: dict[str, Any], console: Console) -> None:
    t = Table(title=f"overload: R = {out['saturation_rate_rps']:.3g} req/s ({out['rate_from']}); SLO TTFT "
                    f"{out['slo']['ttft_s'] * 1e3:.0f} ms, ATGT {out['slo']['atgt_s'] * 1e3:.1f} ms")
    for c in ("m x R", "arm", "offered (req/s)", "requests", "accepted", "429", "other errors", "goodput (req/s)",
              "att. accepted", "missed: ttft/atgt/failed",
              "TTFT p50 (s)", "TTFT p99 (s)", "slowest 429 (ms)", "peak in flight: gateway", "client"):
        t.add_column(c, justify="left" if c in ("arm", "other errors") else "right")
    for r in out["runs"]:
        errs = " ".join(f"{k}:{v}" for k, v in r["errors"].items()) or "0"
        t.add_row(f"{r['multiple']:g}", r["arm"], _f(r["offered_rps"], ".3g"), str(r["requests"]), str(r["accepted"]),
                  str(r["rejected_429"]), errs, _f(r["goodput_rps"], ".3g"), _f(r["attainment_accepted"]),
                  "/".join(str(r["missed"][k]) for k in ("ttft", "atgt", "failed")),
                  _f(r["ttft_p50_s"], ".2f"), _f(r["ttft_p99_s"], ".2f"),
                  _f(None if r["slowest_429_s"] is None else r["slowest_429_s"] * 1e3, ".0f"),
                  str(r.get("gateway_peak_in_flight", "-")), str(r["peak_in_flight"]))
    Console(width=max(console.width, 170)).print(t)
    v = out["verdict"]
    words = {True: "[green]holds[/]", False: "[red]does not hold[/]", None: "[yellow]undecided[/]"}
    for arm in [a for a in ARMS if a in v and a != "unbounded"]:
        console.print(f"verdict ({arm}): the bound's claim {words[v[arm]['holds']]}: {v[arm]['why']}")


def plot_overload(out: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"bounded": {"marker": "o", "ls": "-"}, "learnt": {"marker": "^", "ls": "-."},
              "learnt-at-end": {"marker": "<", "ls": "-."}, "learnt-kept": {"marker": "v", "ls": ":"},
              "unbounded": {"marker": "s", "ls": "--"}}
    for arm, style in styles.items():
        rows = [r for r in out["runs"] if r["arm"] == arm]
        if not rows:
            continue
        x = [r["rate"] for r in rows]
        axes[0].plot(x, [r["goodput_rps"] for r in rows], label=arm, **style)
        axes[1].plot(x, [r["attainment_accepted"] if r["attainment_accepted"] is not None else float("nan") for r in rows],
                     label=arm, **style)
    for ax, title in zip(axes, ("goodput (req/s within TTFT+ATGT SLO)", "SLO attainment among accepted")):
        ax.axvline(out["saturation_rate_rps"], color="grey", lw=0.8, ls=":", label="R")
        ax.set_xlabel("offered rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].set_ylim(-0.02, 1.02)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
