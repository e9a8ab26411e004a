"""``lengthwise bench ray``: the same trace at the same rate through three serving paths over two engines.

Arms (``--arms``):

* ``http``: the HTTP gateway (``lengthwise serve``) attached to two vLLM engine processes, placing with ``--placement``;
* ``ray-power-of-two``: the Ray Serve application (:mod:`serving.ray.app`) with Ray Serve's default request router,
  power-of-two choice (:class:`~serving.ray.router.TimedPowerOfTwoRouter`: Ray's class, timed);
* ``ray-lengthwise``: the same application with :class:`~serving.ray.router.LengthwiseRequestRouter` deciding with
  ``--placement`` over the replicas' routing stats.

Everything else is ``bench fleet``'s, imported from :mod:`serving.bench.fleet`: the ShareGPT trace, the same
predictions for every arm in the header the gateway trusts, every request asking for the same ``max_tokens`` while the
engines' exact-length logits processor ends it at its true length (``wrong_or_lost`` counts those that failed or did
not), the calibration burst that fits the SLO and the default rate (the calibrated simulator's 90% point under JSQ), and
the replay. Every Ray arm deploys fresh engine replicas on a local Ray cluster, so no arm warms the next.

Per arm: JCT-SLO and TTFT+ATGT attainment, JCT p50/p99, requests per engine (replica), lost or wrong-length requests,
and for the Ray arms the router's own count of ``choose_replicas`` calls and the seconds spent in them (``/health``'s
``routers``), as microseconds per request. JSON, a table and a PNG.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field
from rich.console import Console
from rich.table import Table

from serving.bench import fleet
from serving.bench.fleet import FleetBenchConfig, _Calibration
from serving.gateway.settings import DEFAULT_T_G_S, DEFAULT_T_P_S, GatewaySettings
from serving.launch.engines import stop_engines, wait_started
from serving.launch.models import bench_dtype, dummy_model
from serving.launch.process import free_port
from serving.launch.supervise import supervised
from serving.perf.slo import SLO
from serving.ray.local import local_ray
from serving.sim.metrics import summarize
from serving.sim.predictions import make_predictor
from serving.sim.scenarios import data_path

ARMS = ("http", "ray-power-of-two", "ray-lengthwise")  # in the order they run
ROUTER_OF_ARM = {"ray-power-of-two": "power-of-two", "ray-lengthwise": "lengthwise"}


class RayBenchConfig(FleetBenchConfig):
    """``bench fleet``'s settings (the trace, the engines, the predictions, the calibration) and which arms run."""

    arms: list[str] = Field(default_factory=lambda: list(ARMS))
    placement: str = Field("lengthwise", description="the HTTP gateway's placement and the Ray router's policy")
    calibrate: bool = Field(True, description="fit the step model first; without, the gateway's default t_p/t_g and --rate")
    ray_start_timeout_s: float = Field(1800.0, gt=0, description="how long the Ray application may take to come up")


def run_ray_bench(cfg: RayBenchConfig, json_path: Path, console: Any) -> dict[str, Any]:
    """Calibrate (or not), replay the trace through each arm in turn, and write JSON, table and PNG; returns the JSON."""
    bad = [a for a in cfg.arms if a not in ARMS]
    if bad or not cfg.arms:
        raise ValueError(f"unknown arm(s) {', '.join(bad) or '(none)'}: choose from {', '.join(ARMS)}")
    if not cfg.calibrate and cfg.rate is None:
        raise ValueError("without calibration give --rate (the default rate is the calibrated simulator's)")
    reqs = fleet._trace(cfg)
    cfg = fleet._with_cap(cfg, reqs)
    work = Path(tempfile.mkdtemp(prefix="lengthwise-bench-ray-"))
    predictor = make_predictor(cfg.predictor, seed=cfg.seed)
    trace = fleet._Trace(reqs, predictor, predictor.predict(reqs))
    dtype = bench_dtype()
    cal = fleet._calibrate(cfg, trace, dtype, work, console) if cfg.calibrate else _default_calibration(cfg)
    rate = cfg.rate if cfg.rate is not None else fleet._default_rate(cfg, trace, cal, console)
    arrivals = fleet.poisson_arrivals(len(reqs), rate, cfg.seed)
    jobs = [fleet.ReplayJob(i, t, tuple(r.turns), r.prompt_tokens, r.output_tokens, cfg.max_tokens)
            for i, (r, t) in enumerate(zip(reqs, arrivals))]
    model = dummy_model(cfg.shape, cfg.max_model_len, work / "model", data_path(fleet.TOKENIZER))
    results: dict[str, Any] = {}
    for arm in cfg.arms:
        console.print(f"[bold]{arm}[/]: {len(jobs)} requests at {rate:.3g} req/s")
        if arm == "http":
            res, wall, health = _http_arm(cfg, cal, model, jobs, trace, rate, dtype, work, console)
        else:
            res, wall, health = _ray_arm(cfg, cal, model, jobs, trace, dtype, work, ROUTER_OF_ARM[arm], console)
        results[arm] = r = arm_result(arm, res, reqs, cal, wall, health)
        console.print(f"  {arm}: JCT SLO attainment {r['slo_attainment']:.3f}, p99 JCT {r['jct_p99_s']:.2f} s, "
                      f"lost {r['wrong_or_lost']}")
    out = {"config": cfg.model_dump(), "rate": rate, "requests": len(reqs), "arms": results,
           "slo": {"scale": cfg.slo_scale, "t_p_s": cal.slo.t_p, "t_g_s": cal.slo.t_g, "ttft_s": cal.slo.ttft_s,
                   "atgt_s": cal.slo.tpot_s, "calibrated": cfg.calibrate},
           "work_dir": str(work)}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    out["png"] = str(plot(out, json_path.with_suffix(".png")))
    json_path.write_text(json.dumps(out, indent=1, default=float))
    table(out, console)
    console.print(f"JSON: {json_path}\nPNG: {out['png']}")
    return out


def _default_calibration(cfg: RayBenchConfig) -> Any:
    """No calibration burst: the SLO from the gateway's default t_p and t_g, no latency profile."""
    slo = SLO(cfg.slo_scale, DEFAULT_T_P_S, DEFAULT_T_G_S, cfg.slo_scale * 5 * DEFAULT_T_P_S, cfg.slo_scale * DEFAULT_T_G_S)
    return _Calibration(None, None, slo, None, None)  # type: ignore[arg-type]


def _http_arm(cfg: RayBenchConfig, cal: Any, model: str, jobs: list, trace: Any, rate: float, dtype: str, work: Path,
              console: Any) -> tuple[list, float, dict]:
    """Two engine processes and the HTTP gateway on them, as ``bench fleet`` runs one placement."""
    _, _, procs = fleet._start_engines(cfg, dtype, work, console)
    try:
        wait_started(procs, 900)
        port = free_port()
        args = fleet.gateway_args(cfg, cfg.placement, port, cal, model, procs, [])
        if cal.profile is None and "--latency-profile" in args:
            i = args.index("--latency-profile")
            del args[i:i + 2]
        # an engine that dies is started again (this arm's gateway keeps its old address: the arm's results show it)
        with supervised(procs), fleet.running_gateway(args, port, work / "gateway.log") as (url, _):
            res, wall = asyncio.run(fleet.replay_jobs(jobs, fleet.request_settings(url, model, jobs,
                                                                               [p.length for p in trace.preds])))
            import httpx

            health = httpx.get(url + "/health", timeout=10).json()
    finally:
        stop_engines(procs)
    return res, wall, health


def _ray_arm(cfg: RayBenchConfig, cal: Any, model: str, jobs: list, trace: Any, dtype: str, work: Path, router: str,
             console: Any) -> tuple[list, float, dict]:
    """The Ray application with ``router`` on fresh engine replicas (the same engine arguments as the HTTP arm's)."""
    from ray import serve

    from serving.ray.app import run

    slo = cal.slo
    settings = GatewaySettings(model=model, engines=cfg.engines, policy=cfg.local_policy, placement=cfg.placement,
                               engine_args=fleet.bench_engine_args(cfg, dtype), trust_client_predictions=True,
                               t_p_s=slo.t_p, t_g_s=slo.t_g, slo_scale=cfg.slo_scale, slo_ttft_ms=slo.ttft_s * 1e3,
                               slo_tpot_ms=slo.tpot_s * 1e3, engine_max_num_seqs=cfg.max_num_seqs, log_level="warning")
    env = {"VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0")}  # the exact-length processor's runner
    with local_ray(cfg.engines + 1, env):
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        t0 = time.monotonic()
        with console.status(f"starting the Ray application ({cfg.engines} engine replicas, router {router})..."):
            run(settings, None, router=router)
        url = f"http://127.0.0.1:{port}"
        _wait_serving(url, cfg.ray_start_timeout_s - (time.monotonic() - t0))
        console.print(f"  Ray application up in {time.monotonic() - t0:.0f} s")
        sends = fleet.request_settings(url, model, jobs, [p.length for p in trace.preds])
        res, wall = asyncio.run(fleet.replay_jobs(jobs, sends))
        health = httpx.get(url + "/health", timeout=30).json()
    return res, wall, health


def _wait_serving(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + max(timeout_s, 1.0)
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    raise RuntimeError(f"the Ray application at {url} did not answer /health within {timeout_s:.0f} s")


def arm_result(arm: str, res: list, reqs: list, cal: Any, wall: float, health: dict) -> dict[str, Any]:
    """One arm's row of the JSON (see the module docstring)."""
    limits = [cal.slo.jct_limit(r.output_tokens) for r in reqs]
    m = summarize(policy=arm, records=fleet._records(res, reqs, limits), slo=cal.slo,
                  makespan=max((r.sent + (r.jct or 0) for r in res), default=wall), steps=0, kv_utilization=0, kv_allocated=0,
                  forward_size=0, batch_size=0, preemptions=0, pauses=0, hosted=0, sched_us_per_step=0, wall_s=wall, busy_s=0)
    lost = fleet.wrong_or_lost(res)
    return {**{k: getattr(m, k) for k in ("requests_total", "requests_completed", "slo_attainment", "ttft_tpot_attainment",
                                          "throughput_rps", "jct_p50_s", "jct_p99_s", "ttft_p50_s", "ttft_p99_s")},
            "per_replica_requests": fleet._per_engine(res), "wrong_or_lost": len(lost), "wrong_or_lost_ids": lost,
            "errors": sorted({r.error for r in res if r.error})[:5], "router": router_overhead(arm, health),
            "engine_retries": health.get("engine_retries"), "stream_errors": health.get("stream_errors")}


def router_overhead(arm: str, health: dict) -> dict[str, Any] | None:
    """The Ray router's own counters from the ingress's ``/health``: calls, seconds, microseconds per call, fallbacks.
    None for the HTTP arm (its placement runs inside the gateway's request path and is not timed apart)."""
    if arm not in ROUTER_OF_ARM:
        return None
    routers = health.get("routers") or {}
    name = "TimedPowerOfTwoRouter" if ROUTER_OF_ARM[arm] == "power-of-two" else "LengthwiseRequestRouter"
    t = routers.get(name) or {"decisions": 0, "choose_s": 0.0, "fallbacks": {}}
    n = t["decisions"]
    return {"class": name, "decisions": n, "choose_s": t["choose_s"], "us_per_decision": t["choose_s"] / n * 1e6 if n else None,
            "fallbacks": t["fallbacks"]}


def table(out: dict[str, Any], console: Any) -> None:
    t = Table(title=f"the same trace ({out['requests']} requests at {out['rate']:.3g} req/s) through the HTTP gateway and Ray "
                    "Serve (attainment: within the JCT SLO; lost: failed or not ended at its true length)")
    for c in ("arm", "completed", "JCT SLO att.", "TTFT+ATGT att.", "p50 JCT (s)", "p99 JCT (s)", "per replica", "lost",
              "router µs/decision", "fallbacks"):
        t.add_column(c, justify="left" if c == "arm" else "right")
    for arm, r in out["arms"].items():
        ro = r["router"] or {}
        us = ro.get("us_per_decision")
        t.add_row(arm, f"{r['requests_completed']}/{r['requests_total']}", f"{r['slo_attainment']:.3f}",
                  f"{r['ttft_tpot_attainment']:.3f}", f"{r['jct_p50_s']:.2f}", f"{r['jct_p99_s']:.2f}",
                  " ".join(str(v) for v in r["per_replica_requests"].values()), str(r["wrong_or_lost"]),
                  f"{us:.0f}" if us is not None else "-", str(sum((ro.get("fallbacks") or {}).values())) if ro else "-")
    Console(width=max(console.width, 170)).print(t)


def plot(out: dict[str, Any], png: Path) -> Path:
    """Attainment, JCT p50/p99 and router overhead per arm, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    arms = list(out["arms"])
    rs = [out["arms"][a] for a in arms]
    fig = Figure(figsize=(12, 3.6))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    ax1.bar(arms, [r["slo_attainment"] for r in rs], color="tab:blue")
    ax1.set_ylim(0, 1.05)
    ax1.set_title("JCT SLO attainment")
    x = range(len(arms))
    ax2.bar([i - 0.2 for i in x], [r["jct_p50_s"] for r in rs], width=0.4, label="p50")
    ax2.bar([i + 0.2 for i in x], [r["jct_p99_s"] for r in rs], width=0.4, label="p99")
    ax2.set_xticks(list(x), arms)
    ax2.set_title("JCT (s)")
    ax2.legend()
    ax3.bar(arms, [((r["router"] or {}).get("us_per_decision") or 0.0) for r in rs], color="tab:gray")
    ax3.set_title("router µs per decision (Ray arms)")
    for ax in (ax1, ax2, ax3):
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{out['requests']} requests at {out['rate']:.3g} req/s, same trace and predictions")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return png
