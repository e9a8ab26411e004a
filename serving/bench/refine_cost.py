"""What refinements cost on the way: the gateway's CPU per request, the sidecar's extra work, and how late an update
reaches its engine, under load, beside the same load without refinements.

Real parts: one vLLM engine (dummy weights, the scheduler plug-in, the exact-length logits processor that ends each
request at its trace length), the prediction sidecar serving a remaining-length package, and a ``lengthwise serve``
gateway attached to both, started afresh for each arm. The same ShareGPT trace is replayed through a gateway without
refinements (``off``) and one with ``--refine-at`` (``on``), in the order off, on, on, off for each round, so a drift
of the machine during the bench falls on both arms alike.

Measured per arm: the gateway's and the sidecar's CPU seconds over the replay (their processes' user + system time,
from psutil), divided by the requests; every refinement's outcome (delivered, late, busy, gone, ...) and the delay from
an answer reaching a point to its engine queuing the update (the gateway's histogram); the updates the plug-in took;
and the requests lost or not ended at their true length. The engine's answers are the dummy model's tokens, not the
trace's text, so this measures the cost of refinements and not what they are worth: ``python -m
serving.bench.predictor.remaining`` measures their quality, and ``lengthwise bench sim --refine`` what that quality
buys.

``python -m serving.bench.refine_cost --package DIR [--requests N --rate R --rounds K ...] --json OUT.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.console import Console
from rich.table import Table

from serving.bench.fleet import (
    TOKENIZER,
    bench_engine_args,
    replay_jobs,
    request_settings,
    running_gateway,
    service_process,
    v1_model_runner,
    wait_idle,
    wrong_or_lost,
)
from serving.bench.replay import Job, poisson_arrivals
from serving.gateway.settings import GatewaySettings
from serving.launch.engines import start_engines, stop_engines, wait_started
from serving.launch.models import bench_dtype, dummy_model
from serving.launch.process import free_port, wait_http
from serving.sim.scenarios import SHAREGPT, data_path
from serving.sim.workload import load_workload

OUTCOMES = ("delivered", "late", "busy", "refused", "sidecar_error", "gone", "engine_error", "no_port")


class RefineCostConfig(BaseModel):
    """The bench's settings; each is a flag of the same name."""

    model_config = ConfigDict(extra="forbid")

    package: Path = Field(description="the sidecar's remaining-length package (trained on answers so far: python -m "
                                      "serving.bench.predictor.remaining --package)")
    refine_at: list[int] = Field(default_factory=lambda: [16, 64, 192], description="the gateway's --refine-at")
    refine_timeout_ms: float = Field(200.0, gt=0, description="the gateway's --refine-timeout-ms")
    requests: int = Field(160, ge=8, description="requests per replay (ShareGPT first turns)")
    rate: float = Field(3.0, gt=0, description="Poisson arrivals, req/s")
    rounds: int = Field(1, ge=1, description="rounds of the four replays off, on, on, off")
    policy: str = Field("lengthwise-posterior", description="the plug-in's policy")
    shape: str = Field("tiny", description="the dummy model's shape")
    max_model_len: int = 2048
    kv_blocks: int = Field(400, ge=66, description="KV blocks of 32 tokens in the engine")
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    seed: int = 0
    work_dir: Path | None = Field(None, description="engine, sidecar and gateway logs (default: a new temporary "
                                  "directory)")


def _jobs(cfg: RefineCostConfig) -> list[Job]:
    wl = load_workload(data_path(SHAREGPT), arrival="poisson", rate=1.0, max_requests=cfg.requests, seed=cfg.seed,
                       max_prompt_tokens=cfg.max_model_len // 2, tokenizer=str(data_path(TOKENIZER)))
    reqs = [r for r in wl.requests if r.prompt_tokens + r.output_tokens + 16 <= cfg.max_model_len]
    cap = max(r.output_tokens for r in reqs)
    arrivals = poisson_arrivals(len(reqs), cfg.rate, cfg.seed)
    return [Job(i, t, tuple(r.turns), r.prompt_tokens, r.output_tokens, cap) for i, (r, t) in enumerate(zip(reqs, arrivals))]


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _counter(fams: dict[str, list], name: str, **labels: str) -> float:
    return sum(s.value for s in fams.get(name, ()) if s.name.endswith("_total") and
               all(s.labels.get(k) == v for k, v in labels.items()))


def _delay_quantiles(fams: dict[str, list]) -> dict[str, float | None]:
    """p50 and p95 of the refinement delay (s), read off the histogram's buckets (linear within a bucket)."""
    buckets = sorted((float(s.labels["le"]), s.value) for s in fams.get("lengthwise_gateway_refinement_delay_seconds", ())
                     if s.name.endswith("_bucket"))
    total = buckets[-1][1] if buckets else 0
    out: dict[str, float | None] = {}
    for q in (0.5, 0.95):
        out[f"p{int(q * 100)}"] = None
        lo, below = 0.0, 0.0
        for le, n in buckets:
            if total and n >= q * total:
                out[f"p{int(q * 100)}"] = (lo + (le - lo) * (q * total - below) / (n - below) if n > below and le != float("inf")
                                          else lo)
                break
            lo, below = le, n
    return out


def _settled(url: str, timeout_s: float = 30.0) -> dict[str, list]:
    """The gateway's metrics once its refinements stopped moving (none in flight: two reads 1 s apart agree)."""
    last = None
    deadline = time.monotonic() + timeout_s
    while True:
        fams = _families(httpx.get(url + "/metrics", timeout=10).text)
        now = sum(_counter(fams, "lengthwise_gateway_refinements", outcome=o) for o in OUTCOMES)
        if now == last or time.monotonic() > deadline:
            return fams
        last = now
        time.sleep(1.0)


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _arm(cfg: RefineCostConfig, on: bool, model: str, served: str, engine, sidecar_url: str, sidecar: psutil.Process,
         jobs: list[Job], work: Path, tag: str, console: Console) -> dict[str, Any]:
    """One replay through a gateway of its own: ``model`` is the engine's directory (the gateway's tokenizer),
    ``served`` the name requests ask for."""
    port = free_port()
    args = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), "--model", model, "--engine-url",
            engine.url, "--engine-metrics-url", engine.metrics_url, "--predictor-url", sidecar_url,
            "--allow-predictor-for-other-model", "--predictor-timeout-ms", "1000", "--log-level", "warning"]
    if on:
        args += ["--refine-at", ",".join(map(str, cfg.refine_at)), "--refine-timeout-ms", f"{cfg.refine_timeout_ms:g}"]
    plugin = engine.metrics_url
    with running_gateway(args, port, work / f"gateway-{tag}.log") as (url, proc):
        asyncio.run(replay_jobs(jobs[:2], request_settings(url, served, jobs[:2], None)))  # warm: tokenizer, connections
        if (why := wait_idle([engine.url + "/metrics"])) is not None:
            console.print(f"[yellow]warning[/]: {why}")
        gw = psutil.Process(proc.pid)
        applied0 = _counter(_families(httpx.get(plugin, timeout=10).text), "lengthwise_scheduler_refinements_applied")
        cpu0, side0, t0 = _cpu(gw), _cpu(sidecar), time.perf_counter()
        results, wall = asyncio.run(replay_jobs(jobs, request_settings(url, served, jobs, None)))
        fams = _settled(url)
        cpu1, side1 = _cpu(gw), _cpu(sidecar)
        elapsed = time.perf_counter() - t0
    applied = _counter(_families(httpx.get(plugin, timeout=10).text), "lengthwise_scheduler_refinements_applied") - applied0
    n = len(jobs)
    outcomes = {o: int(v) for o in OUTCOMES if (v := _counter(fams, "lengthwise_gateway_refinements", outcome=o))}
    jcts = [r.jct for r in results if r.ok and r.jct is not None]
    return {"arm": "on" if on else "off", "tag": tag, "requests": n, "lost_or_wrong": len(wrong_or_lost(results)),
            "wall_s": wall, "measured_s": elapsed, "gateway_cpu_ms_per_request": (cpu1 - cpu0) * 1e3 / n,
            "sidecar_cpu_ms_per_request": (side1 - side0) * 1e3 / n, "refinements": outcomes,
            "refinements_applied": int(applied), "delay_s": _delay_quantiles(fams),
            "mean_jct_s": statistics.fmean(jcts) if jcts else None}


def run_refine_cost(cfg: RefineCostConfig, json_path: Path, console: Console) -> dict[str, Any]:
    """Start the engine and the sidecar once, replay each arm through its own gateway, and write the JSON."""
    work = cfg.work_dir or Path(tempfile.mkdtemp(prefix="lengthwise-refine-cost-"))
    work.mkdir(parents=True, exist_ok=True)
    jobs = _jobs(cfg)
    dtype = bench_dtype()
    model = dummy_model(cfg.shape, cfg.max_model_len, work / "model", data_path(TOKENIZER))
    # a package conditioned on the model answers only for the models it learned: the engine takes the first one's name
    learned = json.loads((cfg.package / "meta.json").read_text()).get("conditioned_on_model") or []
    named = [f"--served-model-name {learned[0]}"] if learned else []
    served = learned[0] if learned else model
    es = GatewaySettings(model=model, engines=1, policy=cfg.policy, engine_args=[*bench_engine_args(cfg, dtype), *named],
                         engine_log_dir=work / "engines")
    side_port = free_port()
    side_cmd = [sys.executable, "-m", "predictor.sidecar", "--model", str(cfg.package), "--port", str(side_port),
                "--reload-interval", "0"]
    console.print(f"[bold]refinement cost[/]: {len(jobs)} requests at {cfg.rate:g} req/s, points {cfg.refine_at}, "
                  f"{cfg.rounds} round(s) of off/on/on/off; work in {work}")
    with v1_model_runner():
        procs = start_engines(es, work / "engines")
    arms: list[dict[str, Any]] = []
    try:
        with service_process(side_cmd, work / "sidecar.log") as side:
            sidecar_url = f"http://127.0.0.1:{side_port}"
            wait_http(sidecar_url + "/ready", 300, "ready", side, "the sidecar")
            wait_started(procs, 900)
            for r in range(cfg.rounds):
                for i, on in enumerate((False, True, True, False)):
                    tag = f"r{r}-{i}-{'on' if on else 'off'}"
                    arm = _arm(cfg, on, model, served, procs[0], sidecar_url, psutil.Process(side.pid), jobs, work, tag,
                               console)
                    console.print(f"  {tag}: gateway {arm['gateway_cpu_ms_per_request']:.2f} ms CPU/request, sidecar "
                                  f"{arm['sidecar_cpu_ms_per_request']:.2f}, refinements {arm['refinements']}")
                    arms.append(arm)
    finally:
        stop_engines(procs)
    out = {"config": json.loads(cfg.model_dump_json()), "arms": arms, "summary": summarize(arms),
           "command": "python -m serving.bench.refine_cost " + " ".join(sys.argv[1:])}
    json_path.write_text(json.dumps(out, indent=1))
    _table(out, console)
    console.print(f"JSON: {json_path}")
    return out


def summarize(arms: list[dict[str, Any]]) -> dict[str, Any]:
    """Means per arm, and on/off ratios of the CPU per request (each on-arm beside the mean of the off-arms)."""
    def mean(arm: str, key: str) -> float:
        return statistics.fmean(a[key] for a in arms if a["arm"] == arm)

    gw_on, gw_off = mean("on", "gateway_cpu_ms_per_request"), mean("off", "gateway_cpu_ms_per_request")
    side_on, side_off = mean("on", "sidecar_cpu_ms_per_request"), mean("off", "sidecar_cpu_ms_per_request")
    delivered = [a["refinements"].get("delivered", 0) for a in arms if a["arm"] == "on"]
    return {"gateway_cpu_ms_per_request": {"off": gw_off, "on": gw_on, "ratio": gw_on / gw_off if gw_off else None},
            "sidecar_cpu_ms_per_request": {"off": side_off, "on": side_on, "extra": side_on - side_off},
            "sidecar_cpu_ms_per_refinement": ((side_on - side_off) * arms[0]["requests"] / statistics.fmean(delivered)
                                              if delivered and statistics.fmean(delivered) else None),
            "lost_or_wrong": sum(a["lost_or_wrong"] for a in arms)}


def _table(out: dict[str, Any], console: Console) -> None:
    t = Table(title="refinements' cost (CPU per request over the replay; delay: point reached to update queued)")
    for c in ("replay", "gateway ms CPU/req", "sidecar ms CPU/req", "delivered", "skipped", "applied", "delay p50 (ms)",
              "delay p95 (ms)", "lost", "mean JCT (s)"):
        t.add_column(c, justify="left" if c == "replay" else "right")
    for a in out["arms"]:
        ref, d = a["refinements"], a["delay_s"]
        t.add_row(a["tag"], f"{a['gateway_cpu_ms_per_request']:.2f}", f"{a['sidecar_cpu_ms_per_request']:.2f}",
                  str(ref.get("delivered", 0)), str(sum(v for k, v in ref.items() if k != "delivered")),
                  str(a["refinements_applied"]), "" if d["p50"] is None else f"{d['p50'] * 1e3:.0f}",
                  "" if d["p95"] is None else f"{d['p95'] * 1e3:.0f}", str(a["lost_or_wrong"]),
                  "" if a["mean_jct_s"] is None else f"{a['mean_jct_s']:.2f}")
    console.print(t)
    s = out["summary"]["gateway_cpu_ms_per_request"]
    console.print(f"gateway CPU per request: on/off = {s['ratio']:.3f} ({s['on']:.2f} / {s['off']:.2f} ms)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m serving.bench.refine_cost", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for name, field in RefineCostConfig.model_fields.items():
        default = None if field.is_required() else field.get_default(call_default_factory=True)
        p.add_argument("--" + name.replace("_", "-"), dest=name, default=default, required=field.is_required(),
                       help=field.description or name)
    p.add_argument("--json", default="docs/results/refine_cost.json", help="where the results go")
    a = vars(p.parse_args(argv))
    json_path = Path(a.pop("json"))
    given = {k: v for k, v in a.items() if v is not None}
    if isinstance(given.get("refine_at"), str):
        given["refine_at"] = [s for s in given["refine_at"].split(",") if s]
    try:
        cfg = RefineCostConfig.model_validate(given)
    except ValidationError as exc:
        err = exc.errors()[0]
        print(f"python -m serving.bench.refine_cost: --{str(err['loc'][0]).replace('_', '-')}: {err['msg']}",
              file=sys.stderr)
        return 2
    if not (cfg.package / "meta.json").is_file():
        print(f"python -m serving.bench.refine_cost: --package {cfg.package}: no meta.json there (a package directory "
              "of train-predictor or python -m serving.bench.predictor.remaining)", file=sys.stderr)
        return 2
    json_path.parent.mkdir(parents=True, exist_ok=True)
    run_refine_cost(cfg, json_path, Console())
    return 0


if __name__ == "__main__":
    sys.exit(main())
