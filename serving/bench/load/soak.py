"""``lengthwise bench soak``: the whole stack under steady load for a while, watched for leaks and errors.

Gateway, two engines (``bench fleet``'s calibrated fleet, :mod:`serving.bench.load.run`) and the real
prediction sidecar with a registered predictor, all on loopback. The gateway predicts every request through the
sidecar (nothing in a header) and posts the actual lengths back to it, as in production. A real ShareGPT trace,
cycled, arrives as a Poisson process at ``--load`` x the calibrated saturation rate (or ``--rate``) for ``--duration``
seconds; the exact-length logits processor ends each request at its true length, and the bench counts afterwards the
requests that did not end there (or failed).

Every ``--sample-interval`` seconds each process's resident memory and open file descriptors are recorded (an
engine with its child processes, summed: vLLM's API server runs the engine core in a child); the requests are
counted per window of the same width (sent, completed, errors by kind, TTFT and JCT p50/p99). The verdict compares
each process at the end of warm-up (the first 20% of the run, when caches, pools and the allocator have filled) with
the end: growth in % and absolute. Steady state shows as ~0 growth past warm-up; a leak as growth that keeps going
with the run's length.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from predictor.common import quiet_libraries, silence_loggers
from serving.bench.fleet import (
    FleetBenchConfig,
    gateway_args,
    replay_jobs,
    request_settings,
    running_gateway,
    service_process,
    wrong_or_lost,
)
from serving.bench.load.run import calibrated_fleet, calibration_record, error_kind, pct
from serving.bench.load.servedrate import served_rate
from serving.bench.replay import Job, Result, poisson_arrivals
from serving.launch.process import free_port, wait_http

WARMUP_SHARE = 0.2  # the verdict's baseline: each process at the end of the first 20% of the run


class SoakConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    duration_s: float = Field(gt=0, description="seconds of arrivals")
    load: float = Field(0.8, gt=0, description="the arrival rate as a share of the calibrated saturation rate")
    sample_interval_s: float = Field(5.0, gt=0, description="seconds between samples, and the width of a window")
    model: str = "models:/length-predictor@champion"
    placement: str = "lengthwise"
    predictor_timeout_ms: float | None = Field(None, gt=0, description="the gateway's --predictor-timeout-ms (default: "
                                               "the gateway's own)")
    rate_from: Literal["served", "simulator"] = Field("served", description="R without --rate: measured through the "
                                                      "soak's own gateway and sidecar (servedrate) or the simulator's")
    probe_requests: int = Field(40, ge=4, description="requests per probe when R is measured")
    fleet: FleetBenchConfig


def registered(uri: str) -> str:
    """What ``uri`` resolves to (``name vN``), as the sidecar will resolve it; ValueError with one line when nothing
    answers to it, before anything starts."""
    from predictor.sidecar.cache import ModelResolveError, resolve

    quiet_libraries(False)
    try:
        if uri.startswith("models:/"):
            import mlflow  # noqa: F401 - imported here so that its loggers can be silenced before it logs

            silence_loggers()
        m = resolve(uri)
    except ModelResolveError as exc:
        raise ValueError(f"--model {uri}: {' '.join(str(exc).split())}; train one first (make demo, or "
                         "train-predictor --promote)") from None
    return f"{m.name} v{m.version}"


def soak_jobs(reqs: list, rate: float, duration_s: float, seed: int, max_tokens: int) -> list[Job]:
    """Poisson arrivals at ``rate`` for ``duration_s`` seconds, the trace's requests in turn (cycled)."""
    n = int(rate * duration_s * 1.5 + 10 * math.sqrt(rate * duration_s) + 10)
    times = [t for t in poisson_arrivals(n, rate, seed) if t < duration_s]
    return [Job(i, t, tuple(r.turns), r.prompt_tokens, r.output_tokens, max_tokens)
            for i, (t, r) in enumerate(zip(times, (reqs[i % len(reqs)] for i in range(len(times)))))]


def tree_sample(pid: int) -> dict[str, Any] | None:
    """One sample of a process and all its descendants, walked once; None once it is gone.

    ``rss_bytes`` and ``fds``: resident bytes and open file descriptors, summed (shared pages count once per process
    that maps them: a trend, not the machine's memory). What a growing total is made of: ``rss_by_process``, resident
    bytes per process name (summed over processes of the same name), and ``tcp``, the tree's TCP sockets by direction
    and state (``in:ESTABLISHED``, ``out:CLOSE_WAIT``...), inbound when the local port is one the tree listens on.
    Connections that pile up in one state (CLOSE_WAIT: the peer closed and this side did not) show here long before
    they exhaust anything."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    fds = 0
    rss: Counter = Counter()
    socks: list = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # a child that just exited
            rss[p.name()] += p.memory_info().rss
            fds += p.num_fds()
            socks += p.net_connections(kind="tcp")
    listening = {c.laddr.port for c in socks if c.status == psutil.CONN_LISTEN}
    tcp = Counter(f"{'in' if c.laddr.port in listening else 'out'}:{c.status}" for c in socks
                  if c.status != psutil.CONN_LISTEN)
    return {"rss_bytes": sum(rss.values()), "fds": fds, "rss_by_process": dict(rss), "tcp": dict(sorted(tcp.items()))}


def windows(results: list[Result], width_s: float, end_s: float) -> list[dict[str, Any]]:
    """The run cut into windows of ``width_s`` up to ``end_s`` (and on to the last answer): per window the requests sent
    in it, and those that ended in it: completed, errors by kind, TTFT and JCT p50/p99 of the completed."""
    last = max([end_s, *(r.sent + (r.jct or 0.0) for r in results)])
    n = max(1, math.ceil(last / width_s - 1e-9))
    sent = [0] * n
    done: list[list[Result]] = [[] for _ in range(n)]
    errs: list[Counter] = [Counter() for _ in range(n)]
    for r in results:
        sent[min(n - 1, int(r.sent // width_s))] += 1
        k = min(n - 1, int((r.sent + (r.jct or 0.0)) // width_s))
        if r.ok:
            done[k].append(r)
        else:
            errs[k][error_kind(r)] += 1
    out = []
    for k in range(n):
        ttft = [r.ttft for r in done[k] if r.ttft is not None]
        jct = [r.jct for r in done[k] if r.jct is not None]
        out.append({"t0_s": k * width_s, "t1_s": (k + 1) * width_s, "sent": sent[k], "completed": len(done[k]),
                    "errors": dict(sorted(errs[k].items())), "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                    "jct_p50_s": pct(jct, 50), "jct_p99_s": pct(jct, 99)})
    return out


def growth(samples: list[dict[str, float]], warmup_end_s: float) -> dict[str, Any]:
    """One process's RSS and fds at the end of warm-up (the last sample by ``warmup_end_s``, else the first) against its
    last sample: absolute and % growth."""
    live = [s for s in samples if s.get("rss_bytes") is not None]
    if not live:
        return {"samples": 0}
    warm = ([s for s in live if s["t_s"] <= warmup_end_s] or live[:1])[-1]
    end = live[-1]
    out: dict[str, Any] = {"samples": len(live), "warm_t_s": warm["t_s"], "end_t_s": end["t_s"]}
    for key in ("rss_bytes", "fds"):
        a, b = warm[key], end[key]
        out[key] = {"warm": a, "end": b, "growth": b - a, "growth_pct": 100.0 * (b - a) / a if a else None}
    if "tcp" in end:  # what the totals are made of (tree_sample), where the samples have it
        out["tcp"] = {"warm": warm.get("tcp", {}), "end": end["tcp"]}
        by = end.get("rss_by_process", {})
        out["rss_growth_by_process"] = {k: v - warm.get("rss_by_process", {}).get(k, 0) for k, v in by.items()}
    return out


async def _soak(jobs: list[Job], sends: list, pids: dict[str, int], interval_s: float, console: Console | None = None,
                duration_s: float = 0.0, report_every_s: float = 60.0
                ) -> tuple[list[Result], float, dict[str, list[dict[str, Any]]]]:
    """The replay with a sampler beside it: (results, wall seconds, samples per process), the last sample taken after
    the last answer. With ``console``, a line every ``report_every_s`` with the time and each process's memory, so a
    long soak shows it is alive and how it is doing."""
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in pids}
    finished = asyncio.Event()
    t0 = time.perf_counter()
    next_report = report_every_s

    def sample() -> None:
        nonlocal next_report
        t = time.perf_counter() - t0
        for name, pid in pids.items():
            samples[name].append({"t_s": t, **(tree_sample(pid) or {"rss_bytes": None, "fds": None})})
        if console is not None and t >= next_report:
            next_report += report_every_s
            mem = ", ".join(f"{name} {s[-1]['rss_bytes'] / 2**20:.0f} MiB/{s[-1]['fds']} fds"
                            for name, s in samples.items() if s[-1]["rss_bytes"] is not None)
            console.print(f"  t={t:5.0f}s of {duration_s:g}: {mem}")

    async def sampler() -> None:
        while not finished.is_set():
            sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(finished.wait(), interval_s)
        sample()

    task = asyncio.create_task(sampler())
    try:
        results, wall = await replay_jobs(jobs, sends)
    finally:
        finished.set()
        await task
    return results, wall, samples


@contextlib.contextmanager
def running_sidecar(uri: str, work: Path, timeout_s: float = 300.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """``predictor-sidecar`` with ``uri`` on a free loopback port, from ready to stopped: yields (its URL, the process).
    Its feedback store lives in ``work``, not the operator's."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "predictor.sidecar", "--model", uri, "--port", str(port), "--feedback-db",
            str(work / "feedback.db"), "--log-level", "warning"]
    with service_process(args, work / "sidecar.log", env={**os.environ}) as proc:
        wait_http(url + "/ready", timeout_s, "ready", proc, "the sidecar", work / "sidecar.log")
        yield url, proc


def run_soak_bench(cfg: SoakConfig, json_path: Path, console: Console) -> dict[str, Any]:
    """Start everything, soak, stop everything; the JSON, the PNG and the table. Returns what it wrote."""
    measured: dict[str, Any] | None = None
    with calibrated_fleet(cfg.fleet, cfg.placement, console, "lengthwise-bench-soak-") as fleet:
        fc = fleet.cfg
        with running_sidecar(cfg.model, fleet.work) as (sc_url, sc):
            port = free_port()
            args = gateway_args(fc, cfg.placement, port, fleet.cal, fleet.model, fleet.procs, [], predictor_url=sc_url)
            if cfg.predictor_timeout_ms is not None:
                args += ["--predictor-timeout-ms", f"{cfg.predictor_timeout_ms:g}"]
            with running_gateway(args, port, fleet.work / "gateway.log") as (url, gw):
                saturation = fleet.rate
                if cfg.fleet.rate is None and cfg.rate_from == "served":
                    measured = served_rate(fleet, url, cfg.probe_requests, console, headers=False)
                    saturation = measured["rate_rps"]
                rate = fc.rate if cfg.fleet.rate is not None else cfg.load * saturation
                jobs = soak_jobs(fleet.trace.reqs, rate, cfg.duration_s, fc.seed, fc.max_tokens)
                pids = {"gateway": gw.pid, "sidecar": sc.pid, **{p.name: p.proc.pid for p in fleet.procs}}
                console.print(f"[bold]soak[/]: {len(jobs)} requests at {rate:.3g} req/s for {cfg.duration_s:g} s "
                              f"({cfg.placement}, predictions from {cfg.model}); samples every {cfg.sample_interval_s:g} s")
                sends = request_settings(url, fleet.model, jobs, None)
                results, wall, samples = asyncio.run(_soak(jobs, sends, pids, cfg.sample_interval_s, console,
                                                            cfg.duration_s))
                health = httpx.get(url + "/health", timeout=10).json()
        out = _result(cfg, saturation, rate, results, wall, samples, health, fleet.cal.slo.ttft_s)
        out["served_rate"] = measured
        out["simulated_rate_rps"] = fleet.rate
        out["slo"] = {"ttft_s": fleet.cal.slo.ttft_s, "atgt_s": fleet.cal.slo.tpot_s}
        out["calibration"] = calibration_record(fleet)
        out["config"]["fleet"] = fc.model_dump()
        out["work_dir"] = str(fleet.work)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    out["png"] = str(plot_soak(out, json_path.with_suffix(".png")))
    json_path.write_text(json.dumps(out, indent=1))
    print_soak(out, console)
    console.print(f"JSON: {json_path}\nPNG: {out['png']}")
    return out


def overload_signs(results: list[Result], errors: Counter, ttft_slo_s: float | None) -> dict[str, Any]:
    """Whether the stack kept up with the offered rate: a soak measures leaks at a rate the stack sustains, and past it
    the errors and the growth are the backlog's, not a leak's. Signs: refusals at the gateway's bound (``http_429``),
    clients that could not even connect (``ConnectTimeout``/``ConnectError``), predictions that timed out (the CPU the
    sidecar shares is saturated), and the share of completed requests past the SLO's TTFT. ``kept_up`` is false when
    any request was refused or could not connect: the gateway refuses only past its bound on requests in flight, that
    is when a backlog has built up. The other two are context, not the verdict: on a small machine the SLO calibrated on
    the engines alone is missed by the gateway's own steps at any rate (a prediction may wait its whole timeout)."""
    done = [r for r in results if r.ok]
    late = sum(1 for r in done if ttft_slo_s and r.ttft is not None and r.ttft > ttft_slo_s)
    timed_out = sum(1 for r in results if r.status == 200 and (r.prediction or "").startswith("fallback:timeout"))
    refused, unreachable = errors.get("http_429", 0), errors.get("ConnectTimeout", 0) + errors.get("ConnectError", 0)
    late_share = late / len(done) if done else None
    return {"http_429": refused, "unreachable": unreachable,
            "prediction_timeouts_share": timed_out / len(done) if done else None, "ttft_over_slo_share": late_share,
            "kept_up": not refused and not unreachable}


def _result(cfg: SoakConfig, saturation: float, rate: float, results: list[Result], wall: float,
            samples: dict[str, list[dict[str, Any]]], health: dict[str, Any], ttft_slo_s: float | None = None
            ) -> dict[str, Any]:
    warm_end = WARMUP_SHARE * cfg.duration_s
    lost = wrong_or_lost(results)
    errors = Counter(error_kind(r) for r in results if not r.ok)
    return {
        "config": cfg.model_dump(exclude={"fleet"}), "saturation_rate_rps": saturation, "rate_rps": rate,
        "requests": len(results), "wall_s": wall,
        "windows": windows(results, cfg.sample_interval_s, cfg.duration_s), "samples": samples,
        "verdict": {
            "errors_total": sum(errors.values()), "errors_by_kind": dict(sorted(errors.items())),
            "completed": sum(1 for r in results if r.ok),
            "wrong_or_lost": len(lost), "wrong_or_lost_ids": lost[:20],
            "prediction_sources": dict(Counter(r.prediction or "(no header)" for r in results if r.status == 200)),
            "warmup_end_s": warm_end,
            "processes": {name: growth(s, warm_end) for name, s in samples.items()},
            "load": overload_signs(results, errors, ttft_slo_s),
        },
        "gateway_health": {k: health[k] for k in ("status", "reasons", "predictor", "predictor_target", "max_outstanding")
                           if k in health},
    }


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:.0f}"


def _pct_text(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def print_soak(out: dict[str, Any], console: Console) -> None:
    v = out["verdict"]
    t = Table(title=f"soak: {out['requests']} requests at {out['rate_rps']:.3g} req/s for {out['config']['duration_s']:g} s; "
                    f"warm-up ends at {v['warmup_end_s']:.0f} s")
    for c in ("process", "RSS warm (MiB)", "RSS end (MiB)", "RSS growth", "fds warm", "fds end", "fds growth"):
        t.add_column(c, justify="left" if c == "process" else "right")
    for name, g in v["processes"].items():
        if not g.get("samples"):
            t.add_row(name, "-", "-", "-", "-", "-", "-")
            continue
        r, f = g["rss_bytes"], g["fds"]
        t.add_row(name, _mib(r["warm"]), _mib(r["end"]), f"{_mib(r['growth'])} MiB ({_pct_text(r['growth_pct'])})",
                  str(f["warm"]), str(f["end"]), f"{f['growth']:+d} ({_pct_text(f['growth_pct'])})")
    Console(width=max(console.width, 140)).print(t)
    for name, g in v["processes"].items():
        if g.get("tcp") and g["tcp"]["warm"] != g["tcp"]["end"]:
            console.print(f"{name} TCP sockets, end of warm-up -> end: {g['tcp']['warm']} -> {g['tcp']['end']}")
    errs = " ".join(f"{k}:{n}" for k, n in v["errors_by_kind"].items()) or "none"
    console.print(f"completed {v['completed']}/{out['requests']}; errors: {errs}; not ended at their true length or "
                  f"failed: {v['wrong_or_lost']}; predictions: "
                  + (" ".join(f"{k}:{n}" for k, n in v["prediction_sources"].items()) or "-"))
    load = v.get("load") or {}
    if load and not load["kept_up"]:
        late = load["ttft_over_slo_share"]
        console.print(f"[bold red]the stack did not keep up with {out['rate_rps']:.3g} req/s[/]: {load['http_429']} refused "
                      f"at the gateway's bound, {load['unreachable']} could not connect"
                      + (f", {100 * late:.0f}% of completed requests past the SLO's TTFT" if late is not None else "")
                      + ". Errors and growth here are the backlog's, not a leak's: run again at a lower --load or --rate "
                        "(R from --rate-from simulator does not count the gateway's, the sidecar's and the client's CPU)")


def plot_soak(out: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True)
    (a_rss, a_fds), (a_lat, a_err) = axes
    for name, s in out["samples"].items():
        live = [x for x in s if x["rss_bytes"] is not None]
        a_rss.plot([x["t_s"] for x in live], [x["rss_bytes"] / 2**20 for x in live], label=name)
        a_fds.plot([x["t_s"] for x in live], [x["fds"] for x in live], label=name)
    w = out["windows"]
    mid = [(x["t0_s"] + x["t1_s"]) / 2 for x in w]
    nan = float("nan")
    for key, style in (("ttft_p50_s", "-"), ("ttft_p99_s", "--"), ("jct_p50_s", "-"), ("jct_p99_s", "--")):
        a_lat.plot(mid, [x[key] if x[key] is not None else nan for x in w], ls=style, marker=".", label=key[:-2])
    kinds = sorted({k for x in w for k in x["errors"]})
    a_err.plot(mid, [x["sent"] for x in w], label="sent", color="grey")
    a_err.plot(mid, [x["completed"] for x in w], label="completed", color="green")
    for k in kinds:
        a_err.plot(mid, [x["errors"].get(k, 0) for x in w], marker="x", label=f"error {k}")
    warm = out["verdict"]["warmup_end_s"]
    for ax, title in ((a_rss, "RSS (MiB, process tree)"), (a_fds, "open file descriptors"),
                      (a_lat, "latency per window (s)"), (a_err, "requests per window")):
        ax.axvline(warm, color="grey", lw=0.8, ls=":")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in (a_lat, a_err):
        ax.set_xlabel("time since the first arrival (s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
