"""``lengthwise bench engine``: stock vLLM scheduling against ours on the real engine, same trace, one run.

Steps, each in its own engine process:

1. **Calibrate**: a burst of the trace's requests through stock vLLM, every step recorded
   (:mod:`serving.engine.profile`); the simulator's linear latency model is fitted to those steps. The
   fit gives the SLO its per-token times (EcoServe's t_p, t_g of a request running alone) and lets the
   simulator predict where stock vLLM saturates, which picks the default rates.
2. **Replay** the trace at each rate through stock vLLM and through the plug-in (same arrivals, same
   predictions), both engines at once, each on its own core, so background load on a shared machine hits
   both alike; then again with the cores swapped (``swap_cores``, the default), because two cores' step
   times can part by over 10% for a whole replay, and each figure is the two replays' mean. Every
   request asks for the same ``max_tokens`` (the bench's cap), so neither scheduler learns a length
   from the request. With random weights a logits processor in the sampler ends each
   request at exactly its trace length (:mod:`serving.bench.engine.exactlen`); with a real model
   (:mod:`serving.bench.engine.realmodel`) the model ends it, sampled with a seed per request, and the
   calibration run doubles as the seeded relabel that measures the served lengths. Each further arm (a
   policy of ``ablation``, a predictor of ``compare_predictors``) is replayed beside a stock run of its own,
   so every ratio is measured side by side and the stock runs' spread shows the machine's noise.
3. **Compare** with the simulator: the same trace, policy and rate simulated with the fitted model and
   the same cap (each request's ``max_tokens``, predictions clamped to it as the plug-in clamps them);
   the relative error in JCT and throughput is the simulator's calibration error (Vidur reports < 9%).

KV pressure comes from ``num_gpu_blocks_override``, which vLLM honours on the CPU backend and on CUDA.

With ``sequential`` (one GPU; :mod:`serving.bench.engine.sessions`) the engines run one after another instead, each
kept for every job it can run, and each rate has one stock replay that every arm is set beside.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from rich.console import Console
from rich.table import Table

from predictor.common import usable_cores
from serving.bench.engine import plan
from serving.bench.engine.realmodel import predictor_quality, request_seed, served_lengths
from serving.bench.engine.services import (
    FOLDS,
    ServicesError,
    ServicesTrace,
    check_variant,
    parse_services,
)
from serving.bench.engine.sessions import SessionError, Sessions
from serving.launch.adapters import LORA_RANK
from serving.launch.cores import parse_cores, pin_to
from serving.launch.engines import is_cpu_build
from serving.launch.malloc import engine_malloc, with_tcmalloc
from serving.launch.models import Sampling, chat_prompt_ids, resolve_model
from serving.perf.latency import FittedLatency, LatencyModel, StepShape, make_latency_model
from serving.perf.slo import SLO, derive_slo
from serving.policy.config import PolicyConfig, SloKind
from serving.policy.request import Prediction
from serving.progress import waiting
from serving.sim.arrivals import parse_arrivals
from serving.sim.engine import simulate
from serving.sim.metrics import RequestRecord, RunMetrics, summarize
from serving.sim.predictions import GivenPredictions, LengthOracle, PredictorSpecError, check_spec, make_predictor
from serving.sim.scenarios import SHAREGPT, Scenario, Setup, data_path, saturating_forward_size
from serving.sim.sweep import sweep_policy
from serving.sim.workload import TraceRequest, Workload, load_workload

SLO_TARGET = 0.9  # the attainment a deployment must keep (EcoServe's and this bench's capacity threshold)
DEFAULT_RATE_FACTORS = (1.0, 1.25, 1.5, 2.0)  # x the rate the calibrated simulator says stock sustains at 90%
MAX_TOKENS_STEP = 256  # the default cap: the trace's longest response rounded up to a multiple of this
REAL_MAX_TOKENS = 512  # the default cap with a real model, whose lengths are not known before it runs
MATCHED_NOISE = "noise:matched"  # noise at the main predictor's measured top-1 accuracy on this trace
TAU_NOISE = "noise-tau:"  # noise-tau:T, noise whose Kendall tau on this trace comes closest to T


def trace_max_tokens(lengths: list[int], step: int = MAX_TOKENS_STEP) -> int:
    """The default ``max_tokens`` of every request: the trace's longest response rounded up to a multiple of ``step``.

    Not a fixed 1024: ShareGPT answers run longer (2 of the default 200 requests, 11 of 1,000, above 1,024 GPT-2 tokens)
    and a cap below a true length would cut that request, so the bench would no longer replay the trace. One value for
    all requests, it tells a scheduler nothing about any one of them.
    """
    return step * max(1, -(-max(lengths) // step))


def trace_cap(lengths: list[int], given: int | None) -> int:
    """The cap every request of a replayed trace asks for: ``given``, checked to cut no request (a cap below a true
    length would end that request early, and the bench would no longer replay the trace), or :func:`trace_max_tokens`."""
    if given is None:
        return trace_max_tokens(lengths)
    if given < max(lengths):
        raise ValueError(f"--max-tokens {given} is below the trace's longest response ({max(lengths)} tokens); every "
                         f"request must end at its own length: raise it or leave it out")
    return given


class EngineBenchConfig(BaseModel):
    """Everything that defines one benchmark run; written into the JSON so a result says how it was made."""

    model_config = ConfigDict(extra="forbid")

    workload: str = Field(SHAREGPT, description="trace or prompt file (format detected); default ShareGPT first turns")
    max_requests: int = Field(200, ge=4)
    policy: str = Field("lengthwise", description="the plug-in's policy compared with stock vLLM")
    predictor: str = Field("noise:0.55", description="noise:ACC, gauss:SIGMA, oracle or models:/NAME@ALIAS")
    shape: str = Field("tiny", description="dummy-weight model shape: micro, tiny (4 layers, hidden 256), smollm2 or "
                                           "llama3-8b")
    kv_blocks: int = Field(128, ge=8, description="KV pool in blocks (num_gpu_blocks_override): the memory pressure")
    block_size: int = Field(32, ge=32, description="the CPU backend needs a multiple of 32")
    max_model_len: int = Field(2048, ge=128)
    max_num_batched_tokens: int = Field(2048, ge=64)
    max_num_seqs: int = Field(256, ge=1)
    threads: int = Field(1, ge=1, description="torch threads of the engine; more than the idle cores makes every step "
                                               "wait for a descheduled thread")
    rates: list[float] | None = Field(None, description="req/s; default: 1.0x, 1.25x, 1.5x and 2x the rate stock vLLM sustains "
                                                        "at 90% SLO, as the calibrated simulator predicts")
    rate_factors: list[float] = Field(list(DEFAULT_RATE_FACTORS), description="the default rates: these multiples of "
                                      "the rate the calibrated simulator says stock sustains at 90% SLO")
    arrivals: str = Field("poisson", description="the arrival process of every rate, the replays' and the simulator's "
                                                 "alike: poisson, gamma:CV or trace-times:PATH_OR_NAME "
                                                 "(serving/sim/arrivals.py)")
    slo_scale: float | None = Field(None, gt=0, description="EcoServe's SLO scale; default PolicyConfig's")
    slo_kind: SloKind = Field("jct", description="the SLO the plug-in's posterior policies optimise (PolicyConfig.slo_kind, "
                                                 "with the TTFT target the bench derives); every arm reports all three")
    calibration_requests: int = Field(96, ge=8)
    max_tokens: int | None = Field(None, ge=1, description="every request's max_tokens, stock and plug-in alike; default "
                                                           "the trace's longest response rounded up to a multiple of 256")
    seed: int = 0
    seeds: list[int] = Field(default_factory=list, description="with sequential: replay every arm and rate on each of "
                             "these seeds (arrivals and noise drawn from each; the calibration is shared); default [seed]")
    stock_again: bool = Field(False, description="with sequential: replay stock a second time, in a second engine process "
                              "after the arms, at every rate and seed: the noise between two stock runs, measured")
    budget_s: float | None = Field(None, gt=0, description="with sequential: the bench's time in seconds; the replays "
                                   "that fit it are chosen in order of value (serving/bench/engine/plan.py), the rest "
                                   "left out and named")
    engine_start_s: float = Field(60.0, gt=0, description="what the plan charges an engine's start when no start has "
                                  "been measured yet (an 8B engine with CUDA graphs on one H200: about 60 s)")
    calibration_profile: str | None = Field(None, description="a step profile (CSV) from an earlier calibration of the "
                                            "same engine shape on the same machine: no calibration burst is run")
    tokenizer: str | None = None
    model: str | None = Field(None, description="real weights: a Hugging Face model directory or a GGUF (converted once "
                                                "into bench-results/models); default random weights of --shape")
    sampling: Sampling = Field(default_factory=Sampling, description="the real model's served sampling settings")
    ablation: list[str] = Field(default_factory=list, description="more plug-in policies, each replayed beside its own "
                                                                 "stock run, with the main predictor")
    swap_cores: bool = Field(True, description="replay each pair twice, the second time with the two engines' cores "
                                               "swapped, and report the two replays' mean: a core that runs slower for "
                                               "a replay then slows each scheduler once")
    compare_predictors: list[str] = Field(default_factory=list,
                                          description=f"more predictors for the main policy, each beside its own stock "
                                                      f"run; {MATCHED_NOISE} is noise at the main predictor's measured "
                                                      f"top-1 accuracy")
    sequential: bool = Field(False, description="engines one after another (one GPU), each kept for every rate it "
                                                "replays, and one stock replay per rate shared by every arm")
    async_scheduling: bool | None = Field(None, description="vLLM's async scheduling for every engine, stock and plug-in "
                                                            "alike; default vLLM's choice (on for CUDA, off on CPU)")
    gpu_memory_utilization: float = Field(0.2, gt=0, le=1, description="vLLM's share of the GPU per engine (weights, "
                                                                      "activations; the KV pool is kv_blocks)")
    cuda_graphs: bool = Field(False, description="vLLM's default compiled model and CUDA graphs instead of eager mode: "
                                                 "an eager 8B engine on an H200 measured about 28 ms a step, host-bound")
    services: str | None = Field(None, description="several services in one engine: 'smollm2' (SmolLM2 and its two "
                                 "committed adapters) or NAME=LABELS,... (the first the base, the others its adapters), "
                                 "each request for one service with that service's own relabelled length; random "
                                 "weights and a random rank-8 adapter per service")
    service_adapters: dict[str, str] = Field(default_factory=dict, description="set by the bench: where each adapter "
                                             "service's random LoRA was written")

    @model_validator(mode="after")
    def _plan(self) -> EngineBenchConfig:
        """Seeds, stock again and a budget are a plan of one engine at a time; side by side has its own pairs. With
        ``seeds``, the first is the seed (its setup picks the rates) unless ``seed`` is among them."""
        if self.seeds and self.seed not in self.seeds:
            self.seed = self.seeds[0]
        if not self.sequential and (self.seeds or self.stock_again or self.budget_s):
            raise ValueError("--seeds, --stock-again and --budget-s plan engines run one after another: add --sequential")
        if self.calibration_profile and self.model:
            raise ValueError("--calibration-profile applies to random weights: a real model's calibration is also its "
                             "relabel, which measures every request's length")
        if self.calibration_profile and not Path(self.calibration_profile).is_file():
            raise ValueError(f"--calibration-profile {self.calibration_profile}: no such file")
        return self

    @model_validator(mode="after")
    def _services(self) -> EngineBenchConfig:
        folds = [s for s in [self.predictor, *self.compare_predictors] if s.startswith(FOLDS)]
        if folds and not self.services:
            raise ValueError(f"predictor {folds[0]!r}: out-of-fold predictions are made from --services' labels; "
                             "give --services")
        if self.services and self.model:
            raise ValueError("--services replays the services' relabelled lengths on random weights: leave out --model")
        if self.services:
            parse_services(self.services)  # a malformed spec is refused before anything starts
        return self

    @model_validator(mode="after")
    def _pool_holds_a_request(self) -> EngineBenchConfig:
        need = -(-self.max_model_len // self.block_size) + 1  # vLLM keeps one block of the pool as its null block
        if self.kv_blocks < need:
            raise ValueError(f"kv_blocks: {self.kv_blocks} blocks of {self.block_size} tokens cannot hold one "
                             f"{self.max_model_len}-token request (vLLM refuses to start); use at least {need}")
        return self

    @field_validator("predictor", "compare_predictors")
    @classmethod
    def _specs(cls, v: str | list[str]) -> str | list[str]:
        """A malformed spec is refused here, not after minutes of calibration."""
        for spec in [v] if isinstance(v, str) else v:
            if spec.startswith(FOLDS):
                try:
                    check_variant(spec)
                except ServicesError as exc:
                    raise ValueError(str(exc)) from None
            elif spec.startswith(TAU_NOISE):
                _tau_target(spec)
            elif spec != MATCHED_NOISE:
                try:
                    check_spec(spec)
                except PredictorSpecError as exc:
                    raise ValueError(str(exc)) from None
        return v

    @field_validator("arrivals")
    @classmethod
    def _arrivals(cls, v: str) -> str:
        """A bad spec (or an unreadable trace) is refused here, before the calibration."""
        return parse_arrivals(v).spec

    @field_validator("rates", "rate_factors")
    @classmethod
    def _positive(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or any(not r > 0 or math.isinf(r) for r in v)):
            raise ValueError("rates must be positive numbers of requests per second")
        return v


def _tau_target(spec: str) -> float:
    """The T of ``noise-tau:T``, a Kendall tau in (0, 1)."""
    try:
        t = float(spec[len(TAU_NOISE):])
    except ValueError:
        t = float("nan")
    if not 0 < t < 1:
        raise ValueError(f"{spec!r}: {TAU_NOISE}T needs a Kendall tau T between 0 and 1, e.g. {TAU_NOISE}0.372")
    return t


class EngineBenchError(RuntimeError):
    """An engine run failed; the message carries the tail of its log."""


def _scenario(cfg: EngineBenchConfig, start_rate: float = 1.0) -> Scenario:
    what = f"model {cfg.model}" if cfg.model else f"dummy {cfg.shape} model"
    where = "vLLM-CPU engine" if is_cpu_build() else "vLLM CUDA engine"
    return Scenario(name="real-engine", description=f"{where}, {what}", workload=cfg.workload,
                    arrival="poisson", model="smollm2-135m", gpu="a100-80gb", latency="fitted", block_size=cfg.block_size,
                    max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                    max_num_seqs=cfg.max_num_seqs, start_rate=start_rate, kv_blocks=cfg.kv_blocks,
                    predictor=cfg.predictor, max_requests=cfg.max_requests)


def _engine_args(cfg: EngineBenchConfig) -> dict[str, Any]:
    args = {"shape": cfg.shape, "max_model_len": cfg.max_model_len, "block_size": cfg.block_size,
            "max_num_seqs": cfg.max_num_seqs, "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "kv_blocks": cfg.kv_blocks, "threads": cfg.threads, "model": cfg.model}
    if cfg.service_adapters:
        args.update(loras=dict(cfg.service_adapters), max_lora_rank=LORA_RANK)  # random_adapters' rank
    if not is_cpu_build():  # the CPU build keeps its jobs as they were; these only matter on a GPU
        args.update(async_scheduling=cfg.async_scheduling, gpu_memory_utilization=cfg.gpu_memory_utilization,
                    cuda_graphs=cfg.cuda_graphs)
    return args


def merge_csv(parts: list[Path], path: Path) -> Path:
    """One CSV of several engines' step profiles (each part's cycles were measured on its own engine)."""
    lines = parts[0].read_text().splitlines()
    for p in parts[1:]:
        lines += p.read_text().splitlines()[1:]
    path.write_text("\n".join(lines) + "\n")
    return path


def _core_sets(n: int, threads: int) -> list[str | None]:
    """Disjoint cores per engine (``VLLM_CPU_OMP_THREADS_BIND``) when the machine has enough, else None."""
    cores = usable_cores()
    if len(cores) < n * threads:
        return [None] * n
    return [",".join(str(c) for c in cores[i * threads:(i + 1) * threads]) for i in range(n)]


def run_engines(jobs: list[dict[str, Any]], work: Path, console: Console) -> list[dict[str, Any]]:
    """Run the jobs' engines side by side, each on its own cores; their progress lines are shown.

    Side by side rather than one after the other: whatever else the machine runs meanwhile slows both
    schedulers alike, so their ratio survives a shared machine. On the CPU build both run on the system's tcmalloc
    where it is installed, as the engines ``lengthwise serve`` starts (:mod:`serving.launch.malloc`).
    """
    malloc = engine_malloc(is_cpu_build(), "tcmalloc", logging.getLogger("serving.bench.engine"))
    if malloc is not None:
        console.print(f"engines preload {malloc}")
    binds = _core_sets(len(jobs), jobs[0]["engine"]["threads"])
    procs = []
    for job, bind in zip(jobs, binds):
        tag = f"{job['scheduler']}-{job.get('tag', 'run')}"
        jp, op, lp = work / f"{tag}.job.json", work / f"{tag}.out.json", work / f"{tag}.log"
        jp.write_text(json.dumps(job))
        env = with_tcmalloc({**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(job["engine"]["threads"])},
                            malloc)
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        log = lp.open("w")
        # pinned whole: the engine core's busy wait stays on this engine's cores (serving/launch/cores.py)
        proc = subprocess.Popen([sys.executable, "-m", "serving.bench.engine.replay", str(jp), str(op)], stdout=log,
                                stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).resolve().parents[3],
                                preexec_fn=pin_to(parse_cores(bind) if bind else None))  # noqa: PLW1509

        def pump(proc=proc, log=log) -> None:
            for line in proc.stderr:
                log.write(line)
                if line.startswith("  ["):
                    console.print(line.rstrip(), highlight=False)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        procs.append((tag, proc, t, log, op, lp))
    outs = []
    for tag, proc, t, log, op, lp in procs:
        proc.wait()
        t.join()
        log.close()
        if proc.returncode != 0 or not op.exists():
            for _, other, *_ in procs:
                if other.poll() is None:
                    other.kill()
            tail = "".join(lp.read_text().splitlines(True)[-15:])
            raise EngineBenchError(f"engine run {tag} failed (exit {proc.returncode}); log {lp}:\n{tail}")
        outs.append(json.loads(op.read_text()))
    return outs


def profile_to_csv(rows: list[dict[str, float]], path: Path) -> Path:
    """Write the step profile with ``step_s`` as the busy engine's cycle: this step's start to the next's.

    What the simulator prices is a whole engine iteration (scheduling, forward, output handling); when the
    engine went idle between two steps the cycle is the recorded step plus the median loop overhead.
    """
    starts = np.array([r["start_s"] for r in rows])
    steps = np.array([r["step_s"] for r in rows])
    gaps = starts[1:] - (starts[:-1] + steps[:-1]) if len(rows) > 1 else np.array([])
    busy = gaps < 0.02
    overhead = float(np.median(gaps[busy])) if busy.any() else 0.0
    cycle = steps + overhead
    cycle[:-1][busy] = (starts[1:] - starts[:-1])[busy]
    cols = ("prefill_tokens", "decode_tokens", "kv_read_tokens", "num_seqs", "prefill_seqs", "sched_s")
    with path.open("w") as f:
        f.write(",".join((*cols, "engine_step_s", "step_s")) + "\n")
        for r, c in zip(rows, cycle):
            f.write(",".join([*(f"{r[k]:g}" for k in cols), f"{r['step_s']:.6f}", f"{c:.6f}"]) + "\n")
    return path


def _records(out: dict[str, Any], reqs: list[TraceRequest], slo, served: bool) -> list[RequestRecord]:
    """Each request's record, its SLO judged on its true length: the trace's, or with a real model (``served``) the
    length the model produced in this very run."""
    by_id = {r.rid: r for r in reqs}
    recs = []
    for x in out["records"]:
        tr = by_id[x["id"]]
        n = max(1, int(x["tokens"])) if served else tr.output_tokens
        rec = RequestRecord(tr.rid, tr.arrival, tr.prompt_tokens, n, slo.jct_limit(n), service=tr.service,
                            first_token=x["first"], last_token=x["finished"], finished=x["finished"], tokens=x["tokens"])
        recs.append(rec)
    return recs


def summarize_run(out: dict[str, Any], reqs: list[TraceRequest], slo, label: str, served: bool = False) -> RunMetrics:
    """One engine run's metrics; ``served``: a real model's run, where a request's length is what it produced."""
    rows = out["profile"]
    recs = _records(out, reqs, slo, served)
    n = max(len(rows), 1)
    end = max((r.finished for r in recs if r.finished is not None), default=0.0)
    m = summarize(policy=label, records=recs, slo=slo, makespan=end, steps=len(rows), kv_utilization=float("nan"),
                  kv_allocated=float("nan"),
                  forward_size=sum(r["prefill_tokens"] + r["decode_tokens"] for r in rows) / n,
                  batch_size=sum(r["num_seqs"] for r in rows) / n, preemptions=out["preemptions"],
                  pauses=int(out["plugin_stats"].get("pauses", 0)), hosted=int(out["plugin_stats"].get("hosted", 0)),
                  sched_us_per_step=sum(r["sched_s"] for r in rows) / n * 1e6, wall_s=out["wall_s"],
                  busy_s=sum(r["step_s"] for r in rows))
    lost = [r.rid for r in recs if r.finished is None or r.tokens != r.output_tokens]
    m.extra.update({"wrong_or_lost": len(lost), "plugin": out["plugin_stats"]})
    if served:  # how many ended at another length than the seeded relabel (batching's floating-point effects)
        trace = {r.rid: r.output_tokens for r in reqs}
        m.extra["relabel_mismatch"] = sum(x["tokens"] != trace[x["id"]] for x in out["records"])
    return m


def _job(scheduler: str, cfg: EngineBenchConfig, reqs: list[TraceRequest], preds, slo, tag: str, tfs: int,
         prompts: dict[int, list[int]] | None) -> dict[str, Any]:
    """One engine's replay; with a real model (``prompts``: each request's chat-template token ids) every request also
    carries its prompt and its sampling seed."""
    items = []
    for r, p in zip(reqs, preds):
        xargs = {"pred_len": float(p.length)}
        if p.hi is not None:
            xargs["pred_hi"] = float(p.hi)
        if p.bucket is not None:
            xargs["pred_bucket"] = int(p.bucket)
        if p.edges and p.probs:  # the bucket distribution, as the gateway forwards the sidecar's
            xargs["pred_edges"] = [int(e) for e in p.edges]
            xargs["pred_probs"] = [float(q) for q in p.probs]
        items.append({"id": r.rid, "arrival": r.arrival, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                      "extra_args": xargs, "slo_s": slo.jct_limit(max(1.0, min(p.length, cfg.max_tokens))),
                      **_real_fields(cfg, r, prompts), **_service_fields(cfg, r)})
    return {"scheduler": scheduler, "tag": tag, "engine": _engine_args(cfg), "max_tokens": cfg.max_tokens, "requests": items,
            "plugin": {"tfs": tfs, "knobs": {"slo_kind": cfg.slo_kind, "ttft_s": slo.ttft_s}},
            "sampling": cfg.sampling.model_dump()}


def _real_fields(cfg: EngineBenchConfig, r: TraceRequest, prompts: dict[int, list[int]] | None) -> dict[str, Any]:
    return {} if prompts is None else {"prompt_ids": prompts[r.rid], "seed": request_seed(cfg.seed, r.rid)}


def _service_fields(cfg: EngineBenchConfig, r: TraceRequest) -> dict[str, Any]:
    """A request of an adapter service names its adapter (the base's requests none)."""
    return {"lora": r.service} if r.service in cfg.service_adapters else {}


@dataclasses.dataclass
class Arm:
    """One thing compared with stock vLLM: the plug-in with ``policy`` and the predictions of ``predictor``."""

    label: str
    policy: str
    predictor: LengthOracle
    predictions: list[Prediction]
    quality: dict[str, float] | None = None  # against the real model's served lengths


def run_bench(cfg: EngineBenchConfig, json_path: Path | None, png_path: Path | None, console: Console) -> dict[str, Any]:
    """The module's three steps on ``cfg``'s trace, then the result (written to ``json_path`` and plotted to
    ``png_path`` when given; with ``sequential``, every request's record beside the JSON as ``.records.json.gz``);
    the engines' jobs, outputs and logs stay in a fresh work dir the result names. A run cut before any replay
    finished still writes the JSON, saying where it was cut."""
    t0 = time.monotonic()
    deadline = t0 + cfg.budget_s if cfg.budget_s else None
    work = Path(tempfile.mkdtemp(prefix="lengthwise-bench-engine-"))
    console.print(f"work dir {work} (every engine's job, output and log)")
    if cfg.model:
        cfg = _real_model(cfg, Path("bench-results/models"))
    services = None
    if cfg.services:
        wl, services, cfg = _services(cfg, work, console)
        prompts = None
    else:
        wl, prompts = _trace(cfg, console)
    cfg = _with_cap(cfg, wl)
    sessions = Sessions(work, console) if cfg.sequential else None
    info: dict[str, Any] = {}
    runs: list[tuple[plan.Slot, dict[str, Any]]] = []
    phase = "calibration"
    try:
        run = ((lambda jobs: [sessions.run(j, f"{j['scheduler']}-{j['tag']}") for j in jobs]) if sessions
               else (lambda jobs: run_engines(jobs, work, console)))
        if cfg.calibration_profile:
            csv_path, relabel = Path(cfg.calibration_profile), None
            console.print(f"calibration: the step profile {csv_path} (no burst run)")
        else:
            wl, csv_path, relabel = _calibrate(cfg, wl, prompts, work, console, run)
        phase = "the rate search"
        setup, arms = _setup(cfg, wl, FittedLatency.from_csv(csv_path), console, services)
        rates, sim_cap = _rates(cfg, setup, console)
        phase = "the replays"
        if sessions:
            setups = _seed_setups(cfg, wl, (setup, arms), console, services)
            start_s = max(sessions.startups, default=cfg.engine_start_s)
            points, info, runs = _replay_sequential(cfg, setups, prompts, rates, run, console, deadline, start_s)
            if points:
                _table([p for p in points if p.get("seed", cfg.seed) == cfg.seed], console)
        else:
            points = []
            for rate in rates:
                points.append(_replay_at(cfg, setup, arms, prompts, rate, work, console))
                _table(points, console)
    except KeyboardInterrupt:
        _write({"config": cfg.model_dump(), "device": _device(), "cut": f"KeyboardInterrupt during {phase}",
                "points": [], "work_dir": str(work), "elapsed_s": time.monotonic() - t0}, json_path, None, console)
        raise EngineBenchError(f"cut during {phase}, before any replay finished; what finished is in {work}") from None
    finally:
        if sessions:
            sessions.close()
    if not points:
        _write({"config": cfg.model_dump(), "device": _device(), "cut": info.get("cut") or "no rate has both a stock "
                f"and a {cfg.policy} replay", "points": [], "work_dir": str(work), "elapsed_s": time.monotonic() - t0,
                **({"plan": info} if info else {})}, json_path, None, console)
        raise EngineBenchError(f"no rate has both a stock and a {cfg.policy} replay (cut short); what finished is in {work}")
    first = [p for p in points if p.get("seed", cfg.seed) == cfg.seed] or points
    result = _result(cfg, setup, arms, csv_path, sim_cap, first, relabel, work, console)
    if info:
        _with_plan(result, points, info, runs, setups, json_path, console)
    if services is not None:
        result["services"] = services.summary
        _service_table(points, console)
    result["elapsed_s"] = time.monotonic() - t0
    _write(result, json_path, png_path, console)
    return result


def _with_plan(result: dict[str, Any], points: list[dict[str, Any]], info: dict[str, Any],
               runs: list[tuple[plan.Slot, dict[str, Any]]], setups: dict[int, tuple[Setup, list[Arm]]],
               json_path: Path | None, console: Console) -> None:
    """A plan's run added to ``result``: every point of every seed, the arm × rate × seed table on every SLO kind, stock
    against stock again, the plan itself, and the records file (every request of every replay, every arm's
    predictions)."""
    rows = plan.table_rows(points)
    plan.print_table(rows, console)
    result.update(points_all_seeds=points, table=rows, stock_spread=plan.spread(rows), plan=info)
    if json_path:
        preds: dict[str, dict[str, Any]] = {}
        for seed, (setup, arms) in setups.items():
            for a in arms:
                preds.setdefault(a.label, {})[str(seed)] = plan.prediction_rows(setup.requests, a.predictions)
        setup, arms = next(iter(setups.values()))
        slo = {k: getattr(setup.slo, k) for k in ("scale", "t_p", "t_g", "ttft_s", "tpot_s")}
        labels = {a.label: (a.policy, result["arms"][a.label]["predictor"]) for a in arms}
        path = plan.write_records(json_path.with_name(json_path.stem + ".records.json.gz"), runs, preds, slo, labels)
        result["records_file"] = path.name
        console.print(f"wrote {path}")


def _services(cfg: EngineBenchConfig, work: Path, console: Console) -> tuple[Workload, ServicesTrace, EngineBenchConfig]:
    """``--services``: the trace (each request a service's own length), every variant's out-of-fold predictions, and
    ``cfg`` with a random LoRA adapter written for each adapter service."""
    from serving.bench.engine.services import load_services
    from serving.launch.adapters import random_adapters
    from serving.launch.models import dummy_model

    try:
        files = parse_services(cfg.services or "")
        with waiting(console, "the services' lengths, and each labelled prompt predicted out of fold (TF-IDF)..."):
            svc = load_services(files, data_path(cfg.workload), cfg.max_requests, cfg.seed, cfg.max_model_len,
                                cfg.max_tokens)
    except ServicesError as exc:
        raise EngineBenchError(str(exc)) from None
    adapters = [n for n in files if n != svc.base]
    made = random_adapters(Path(dummy_model(cfg.shape, cfg.max_model_len)), adapters, work / "adapters")
    cfg = cfg.model_copy(update={"service_adapters": {n: str(p) for n, p in made.items()}})
    for name, row in svc.summary.items():
        role = "base" if name == svc.base else "adapter"
        console.print(f"service {name} ({role}): {row['requests']} requests, mean {row['mean_tokens']:.0f} tokens "
                      f"({row['labelled_prompts']} prompts labelled)")
    wl = Workload("services", "relabelled", svc.requests, has_timestamps=False, arrival="poisson", source=cfg.services or "")
    return wl, svc, cfg


SERVICE_KINDS = (("slo_attainment", "JCT SLO att.", ".2f"), ("ttft_tpot_attainment", "TTFT+TPOT att.", ".2f"),
                 ("normalized_latency_s", "norm. lat. s/tok", ".4f"))
"""The three SLO kinds the services' table shows, each arm's beside its stock run's (:func:`serving.sim.metrics.slo_kinds`)."""


def _service_table(points: list[dict], console: Console) -> None:
    """Each arm's three SLO kinds per service beside its stock run's, at every rate (SeaLLM reports per service: a
    policy that serves one service by starving another shows here, not in the totals)."""
    t = Table(title="SLO kinds per service (stock -> arm)")
    t.add_column("rate")
    t.add_column("arm")
    t.add_column("SLO kind")
    names = sorted({n for p in points for a in p["arms"].values() for n in a["run"].get("extra", {}).get("per_service", {})})
    for n in names:
        t.add_column(n or "base", justify="right")
    nan = float("nan")
    for p in points:
        for label, a in p["arms"].items():
            mine = a["run"].get("extra", {}).get("per_service", {})
            theirs = a["stock"].get("extra", {}).get("per_service", {})
            for key, kind, fmt in SERVICE_KINDS:
                t.add_row(f"{p['rate']:g}", label, kind, *(f"{theirs.get(n, {}).get(key, nan):{fmt}} -> "
                                                         f"{mine.get(n, {}).get(key, nan):{fmt}}" for n in names))
    console.print(t)


def predict(cfg: EngineBenchConfig, latency: str, model: str, gpu: str, json_path: Path | None,
            console: Console) -> dict[str, Any]:
    """The simulator's prediction of the run ``cfg`` describes, made before any engine runs: the same trace, pool,
    arms, predictions and rate rule, with the step model ``latency`` (e.g. ``roofline``) of ``model`` on ``gpu``
    in place of the calibration. Each rate's arms are simulated beside a simulated stock run; written to
    ``json_path`` in the bench's own layout (``"prediction": true``), so a later engine run compares point for
    point."""
    if cfg.model:
        raise EngineBenchError("a prediction replays a length-only trace: leave out --model")
    if cfg.services:
        raise EngineBenchError("a prediction does not take --services yet: run the services on the engine")
    wl, _ = _trace(cfg, console)
    cfg = _with_cap(cfg, wl)
    lat = make_latency_model(latency, model=model, gpu=gpu)
    setup, arms = _setup(cfg, wl, lat, console)
    rates, sim_cap = _rates(cfg, setup, console)
    setups = _seed_setups(cfg, wl, (setup, arms), console)
    points = []
    for rate in rates:
        for seed, (seed_setup, seed_arms) in setups.items():
            at = seed_setup.at_rate(rate)
            point: dict[str, Any] = {"rate": rate, "seed": seed, "arms": {}}
            for arm in seed_arms:
                arm_setup = dataclasses.replace(seed_setup, predictor=arm.predictor, predictions=arm.predictions)
                stock, run = (_simulated(at, arm_setup, name, label, cfg.max_tokens)
                              for name, label in (("vllm", "stock"), (arm.policy, arm.label)))
                point["arms"][arm.label] = _pair(rate, arm, stock, run, cfg.predictor)
            points.append(_point(point, seed_arms))
    first = [p for p in points if p["seed"] == cfg.seed]
    _table(first, console, title="PREDICTION (simulator, no engine ran): stock vLLM vs the plug-in, same trace")
    rows = plan.table_rows(points)
    if len(setups) > 1:
        plan.print_table(rows, console)
    expected_plan = _expected_plan(cfg, setups, arms, rates, console) if cfg.sequential and cfg.budget_s else None
    # the main arm's capacity is the one _rates swept already (same setup, same predictions)
    capacity = {a.label: sim_cap[a.policy] if a is arms[0] else
                sweep_policy(dataclasses.replace(setup, predictor=a.predictor, predictions=a.predictions),
                             a.policy)["max_rate_at_90_slo"] for a in arms}
    result = {"prediction": True, "config": cfg.model_dump(), "latency_model": lat.describe(), "rates": rates,
              "sim_max_rate_at_90_slo": {"stock": sim_cap.get("vllm"), **capacity}, "points": first,
              "points_all_seeds": points, "table": rows,
              "arms": {a.label: {"policy": a.policy, "predictor": getattr(a.predictor, "spec", None),
                                 "quality": a.quality} for a in arms},
              "slo": {"scale": setup.config.slo_scale, "t_p_s": setup.slo.t_p, "t_g_s": setup.slo.t_g},
              "tfs": setup.config.tfs, "plan": expected_plan}
    console.print("simulated max rate at 90% SLO: " + ", ".join(f"{k} {v:.3g} req/s"
                                                                for k, v in result["sim_max_rate_at_90_slo"].items()))
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2, default=float))
        console.print(f"wrote {json_path}")
    return result


def _expected_plan(cfg: EngineBenchConfig, setups: dict[int, tuple[Setup, list[Arm]]], arms: list[Arm],
                   rates: list[float], console: Console) -> dict[str, Any]:
    """The replays a run of ``cfg`` would choose within ``budget_s`` (the whole budget, as if calibration took no
    time), each replay's time estimated by this prediction's step model and each engine start charged
    ``engine_start_s``: what a GPU run of this plan will hold, known before it starts."""
    times = plan.ReplayTimes({s: setup for s, (setup, _) in setups.items()}, cfg.max_tokens)
    p = plan.make_plan([a.label for a in arms], [a.policy for a in arms], rates, list(setups), cfg.stock_again,
                       cfg.budget_s, cfg.engine_start_s, times)
    console.print(f"plan within {cfg.budget_s:.0f} s (engine starts of {cfg.engine_start_s:.0f} s): {len(p.order)} of "
                  f"{len(p.slots)} replays, about {p.total_s:.0f} s: {', '.join(x.name for x in p.order)}")
    return {"budget_s": cfg.budget_s, "engine_start_s": cfg.engine_start_s, "estimated_s": p.total_s,
            "chosen": [x.name for x in p.order], "left_out": [x.name for x in p.left], "estimates_s": times.to_dict()}


def _simulated(at: list[TraceRequest], setup: Setup, policy: str, label: str, max_tokens: int | None) -> dict[str, Any]:
    """One simulated run as the table shows an engine run: no simulator error (it is the simulator), nothing lost."""
    m = simulate(at, setup.predictions, policy, setup.config, setup.kv_blocks, setup.latency, setup.slo,
                 repredict=setup.predictor.repredict, max_tokens=max_tokens)
    m.policy = label
    d = m.to_dict()
    d.setdefault("extra", {}).update(sim_error=dict.fromkeys(("jct_mean_s", "jct_p50_s", "throughput_rps"), 0.0),
                                     wrong_or_lost=0)
    return d


def _trace(cfg: EngineBenchConfig, console: Console) -> tuple[Workload, dict[int, list[int]] | None]:
    """The trace (its arrivals are made again for each rate, as ``cfg.arrivals`` says: :meth:`Setup.at_rate`) and,
    with a real model, each request's prompt as token ids in the model's chat template (requests whose prompt leaves no
    room for ``max_tokens`` are skipped)."""
    tok = cfg.tokenizer or (str(Path(cfg.model) / "tokenizer.json") if cfg.model
                            else str(data_path("tokenizers/gpt2/tokenizer.json")))
    with waiting(console, "loading the trace..."):
        if not cfg.model:
            wl = load_workload(data_path(cfg.workload), arrival="poisson", rate=1.0, max_requests=cfg.max_requests,
                               seed=cfg.seed, max_prompt_tokens=cfg.max_model_len, tokenizer=tok)
            return wl, None
        # the file's answer lengths are another model's: the relabel replaces them, so they filter nothing here
        wl = load_workload(data_path(cfg.workload), arrival="poisson", rate=1.0, max_requests=2 * cfg.max_requests,
                           seed=cfg.seed, tokenizer=tok)
        room = cfg.max_model_len - cfg.max_tokens
        ids = chat_prompt_ids(Path(cfg.model), wl.requests)
        keep = [dataclasses.replace(r, prompt_tokens=len(ids[r.rid])) for r in wl.requests if len(ids[r.rid]) <= room]
        wl = dataclasses.replace(wl, requests=keep[:cfg.max_requests])
    return wl, {r.rid: ids[r.rid] for r in wl.requests}


def _with_cap(cfg: EngineBenchConfig, wl: Workload) -> EngineBenchConfig:
    """``cfg`` with its ``max_tokens`` set: the given cap, checked to cut no request, or :func:`trace_max_tokens`
    (a real model's cap is set with the model, in :func:`run_bench`: there are no lengths to check it against)."""
    if cfg.model:
        return cfg
    return cfg.model_copy(update={"max_tokens": trace_cap([r.output_tokens for r in wl.requests], cfg.max_tokens)})


def _calibrate(cfg: EngineBenchConfig, wl: Workload, prompts: dict[int, list[int]] | None, work: Path,
               console: Console, run) -> tuple[Workload, Path, dict[str, Any] | None]:
    """1. Calibrate: a burst of the trace through stock vLLM, every step recorded, to fit the simulator's step model
    (which then sets the SLO's t_p and t_g and the TFS, so every later run is judged against what this machine does).
    With random weights the burst is the trace's first ``calibration_requests``; with a real model it is the whole
    trace, split over two engines side by side, and doubles as the seeded relabel: the lengths it measures replace
    the file's. ``run`` replays a list of jobs (side by side, or one engine at a time). Returns the workload (with
    served lengths), the profile CSV and the relabel's summary."""
    reqs = wl.requests
    k = len(reqs) if prompts else min(cfg.calibration_requests, len(reqs))
    burst = [dataclasses.replace(r, arrival=0.05 * i) for i, r in enumerate(reqs[:k])]
    parts = [burst[0::2], burst[1::2]] if prompts else [burst]
    what = "the seeded relabel of every request" if prompts else f"{k} requests"
    console.print(f"[bold]calibrating[/]: {what} through stock vLLM ({cfg.model or cfg.shape + ' model'}, {cfg.kv_blocks} "
                  f"KV blocks, max_tokens {cfg.max_tokens})")
    jobs = []
    for i, part in enumerate(parts):
        items = [{"id": r.rid, "arrival": r.arrival, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                  **_real_fields(cfg, r, prompts), **_service_fields(cfg, r)} for r in part]
        jobs.append({"scheduler": "stock", "tag": f"calibration{i}", "engine": _engine_args(cfg), "max_tokens": cfg.max_tokens,
                     "requests": items, "sampling": cfg.sampling.model_dump()})
    outs = run(jobs)
    csv_path = merge_csv([profile_to_csv(o["profile"], work / f"step_profile-{i}.csv") for i, o in enumerate(outs)],
                         work / "step_profile.csv")
    if not prompts:
        return wl, csv_path, None
    lengths, relabel = served_lengths(outs, cfg.max_tokens)
    console.print(f"served lengths (seeded relabel): mean {relabel['mean']:.0f}, median {relabel['median']:.0f}, p90 "
                  f"{relabel['p90']:.0f} tokens; {relabel['capped']} of {relabel['requests']} ran to max_tokens "
                  f"({relabel['capped_share']:.0%}, censored)")
    served = [dataclasses.replace(r, output_tokens=max(1, lengths[r.rid])) for r in reqs]
    return dataclasses.replace(wl, requests=served), csv_path, relabel


def _real_model(cfg: EngineBenchConfig, model_cache: Path) -> EngineBenchConfig:
    """``cfg`` with its model resolved to an absolute directory (the engine processes run from the repository root, not
    necessarily from here) and its cap set: a real model's lengths are unknown until it runs, so the cap is the one
    given or REAL_MAX_TOKENS."""
    return cfg.model_copy(update={"model": str(resolve_model(cfg.model, model_cache).resolve()),
                                  "max_tokens": cfg.max_tokens or REAL_MAX_TOKENS})


def _slo_of(lat: LatencyModel, wl: Workload, scale: float) -> SLO:
    """t_p and t_g of a request running alone under ``lat``, over the workload's own prompts and answers."""
    return derive_slo(lat, [r.prompt_tokens for r in wl.requests], [r.output_tokens for r in wl.requests], scale)


@dataclasses.dataclass(frozen=True)
class ModelCalibration:
    """Step 1 alone on a real model (``lengthwise calibrate --model``): the step model and the SLO times it gives."""

    config: EngineBenchConfig  # the model resolved to a directory, the cap set
    profile: Path  # step_profile.csv: what `lengthwise serve --latency-profile` and `--latency-model fitted:CSV` read
    latency: FittedLatency
    slo: SLO  # t_p and t_g of a request running alone, derived from the step model on the burst's own requests
    served: dict[str, Any]  # the burst's own lengths: requests, mean, median, p90, capped


def calibrate_model(cfg: EngineBenchConfig, work: Path, console: Console, model_cache: Path,
                    slo_scale: float) -> ModelCalibration:
    """:func:`_calibrate` on ``cfg.model`` with nothing after it: the trace's prompts in the model's chat template, as one
    burst through stock vLLM on one engine at a time (the one-GPU layout, :class:`Sessions`), every step recorded; the
    step model fitted to it, and t_p and t_g derived from that model over the burst's prompts and answers."""
    if not cfg.model:
        raise ValueError("calibrate_model needs a real model: cfg.model")
    cfg = _real_model(cfg, model_cache)
    wl, prompts = _trace(cfg, console)
    if len(wl.requests) < 2:
        raise EngineBenchError(f"{cfg.workload}: {len(wl.requests)} prompts leave room for {cfg.max_tokens} output tokens "
                               f"in a {cfg.max_model_len}-token context; raise --max-model-len or lower --max-tokens")
    sessions = Sessions(work, console)
    try:
        wl, csv_path, served = _calibrate(cfg, wl, prompts, work, console,
                                          lambda jobs: [sessions.run(j, f"{j['scheduler']}-{j['tag']}") for j in jobs])
    except SessionError as exc:
        raise EngineBenchError(str(exc)) from None
    finally:
        sessions.close()
    lat = FittedLatency.from_csv(csv_path)
    return ModelCalibration(cfg, csv_path, lat, _slo_of(lat, wl, slo_scale), served or {})


def _setup(cfg: EngineBenchConfig, wl: Workload, lat: LatencyModel, console: Console,
           services: ServicesTrace | None = None) -> tuple[Setup, list[Arm]]:
    """The step model (fitted to the calibration, or a prediction's), the SLO and TFS it gives, and every arm's
    predictions (made after the relabel, so that the oracle and the noise are the served model's)."""
    reqs = wl.requests
    pc = PolicyConfig(block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                      max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len)
    scale = cfg.slo_scale or pc.slo_scale
    slo = _slo_of(lat, wl, scale)
    tfs = saturating_forward_size(lat, cfg.max_num_batched_tokens)
    pc = pc.model_copy(update={"tfs": tfs, "slo_scale": scale, "slo_kind": cfg.slo_kind, "ttft_s": slo.ttft_s})
    what = (f"fitted step model: {lat.c0 * 1e3:.2f} ms + {lat.c1 * 1e6:.1f} µs/prefill token + "
            f"{lat.c2 * 1e6:.1f} µs/decode token + {lat.c3 * 1e9:.1f} ns/KV token (R² {lat.r2:.3f}, "
            f"MAPE {lat.mape:.1%}, {lat.n_rows} steps)" if isinstance(lat, FittedLatency) else f"step model {lat.name}")
    console.print(f"{what}; SLO t_p {slo.t_p * 1e3:.1f} ms, t_g {slo.t_g * 1e3:.2f} ms, scale {scale}; TFS {tfs}")
    arms = _arms(cfg, reqs, console, services)
    main = arms[0]
    setup = Setup(_scenario(cfg, alone_rate(lat, reqs)), wl, lat, cfg.kv_blocks - 1, pc, slo, main.predictor,
                  main.predictions, cfg.seed, cfg.arrivals)  # at_rate: one set of arrivals for replays and simulations
    return setup, arms


def _seed_setups(cfg: EngineBenchConfig, wl: Workload, first: tuple[Setup, list[Arm]], console: Console,
                 services: ServicesTrace | None = None) -> dict[int, tuple[Setup, list[Arm]]]:
    """``first`` (``cfg.seed``'s setup and arms) and one more per other seed of ``cfg.seeds``: its arrivals and noise
    drawn from that seed, on the same step model."""
    setups = {cfg.seed: first}
    for seed in cfg.seeds:
        if seed not in setups:
            console.print(f"seed {seed}:")
            setups[seed] = _setup(cfg.model_copy(update={"seed": seed}), wl, first[0].latency, console, services)
    return setups


def alone_rate(lat: LatencyModel, reqs: list[TraceRequest]) -> float:
    """The rate at which the engine would serve the trace one request at a time (prefill, then one decode step per
    token): where the simulator's search for stock's knee starts, so that it starts within reach on any machine, a
    fast GPU or a slow CPU, rather than at a fixed 1 req/s."""
    def alone(r: TraceRequest) -> float:
        decode = lat.step_time(StepShape.of([], [r.prompt_tokens + r.output_tokens // 2]))
        return lat.step_time(StepShape.of([(0, r.prompt_tokens)])) + r.output_tokens * decode

    mean = float(np.mean([alone(r) for r in reqs]))
    return float(f"{1.0 / mean:.3g}") if mean > 0 else 1.0


def _matched_noise(top1: float, reqs: list[TraceRequest], cfg: EngineBenchConfig, key: str = "top1",
                   spec: str = MATCHED_NOISE) -> tuple[LengthOracle, list[Prediction]]:
    """``noise:ACC`` whose top-1 accuracy, scored as the main predictor's is (clamped to ``max_tokens``), comes closest to
    ``top1``. Clamping makes every prediction at or above the cap right for a capped answer, so the accuracy the noise
    is calibrated to (unclamped) would overshoot on a trace with many capped answers; a grid over ACC finds the match.
    ``key="kendall_tau"`` matches the ranking instead (``noise-tau:T``)."""
    truth = [r.output_tokens for r in reqs]
    best: tuple[float, LengthOracle, list[Prediction]] | None = None
    for acc in np.linspace(0.02, 1.0, 50):
        try:
            p = make_predictor(f"noise:{acc:.4f}", seed=cfg.seed)
            preds = p.predict(reqs)
        except PredictorSpecError:  # that accuracy is out of reach on this trace
            continue
        miss = abs(predictor_quality(preds, truth, cfg.max_tokens)[key] - top1)
        if best is None or miss < best[0]:
            best = (miss, p, preds)
    if best is None:
        raise PredictorSpecError(f"{spec}: no noise level reaches a {key} of {top1:.3f} on this trace")
    return best[1], best[2]


def _arms(cfg: EngineBenchConfig, reqs: list[TraceRequest], console: Console,
          services: ServicesTrace | None = None) -> list[Arm]:
    """The main arm (``policy`` with ``predictor``), one per ``ablation`` policy (same predictor) and one per
    ``compare_predictors`` spec (same policy). Every predictor is scored against the trace's lengths (with a real
    model, the served ones, clamped to ``max_tokens`` as the plug-in clamps them)."""
    truth = [r.output_tokens for r in reqs]
    made: dict[str, tuple[LengthOracle, list[Prediction]]] = {}

    def predictions(spec: str) -> tuple[LengthOracle, list[Prediction]]:
        if spec not in made:
            if spec == MATCHED_NOISE:
                made[spec] = _matched_noise(predictor_quality(made[cfg.predictor][1], truth, cfg.max_tokens)["top1"],
                                            reqs, cfg)
            elif spec.startswith(TAU_NOISE):
                made[spec] = _matched_noise(_tau_target(spec), reqs, cfg, "kendall_tau", spec)
            elif spec.startswith(FOLDS) and services is not None:
                given = services.predictions[check_variant(spec)]
                p = GivenPredictions(spec, {r.rid: q for r, q in zip(services.requests, given)})
                made[spec] = (p, p.predict(reqs))
            else:
                p = make_predictor(spec, seed=cfg.seed)
                made[spec] = (p, p.predict(reqs))
        return made[spec]

    specs = [("lengthwise", cfg.policy, cfg.predictor)]
    if cfg.policy != "lengthwise" and "lengthwise" in cfg.ablation:  # the main arm's label: one would hide the other
        raise EngineBenchError("the main arm is reported as 'lengthwise'; to compare the lengthwise policy with "
                               f"--policy {cfg.policy}, name it lengthwise-point in --ablation")
    specs += [(pol, pol, cfg.predictor) for pol in cfg.ablation]
    specs += [(f"{cfg.policy}+{spec}", cfg.policy, spec) for spec in cfg.compare_predictors]
    arms = []
    for label, policy, spec in specs:
        p, preds = predictions(spec)
        q = predictor_quality(preds, truth, cfg.max_tokens)
        arms.append(Arm(label, policy, p, preds, q))
        console.print(f"arm {label}: policy {policy}, predictor {getattr(p, 'spec', spec)}: Kendall tau "
                      f"{q['kendall_tau']:.3f}, top-1 {q['top1']:.1%}, MAE {q['mae']:.0f} tokens")
    return arms


def _rates(cfg: EngineBenchConfig, setup: Setup, console: Console) -> tuple[list[float], dict[str, float]]:
    """The rates to replay at: ``cfg.rates``, else factors of the rate the calibrated simulator says stock vLLM sustains
    at 90% SLO, so that the sweep straddles where scheduling starts to matter on this machine. Returns them and the
    simulated capacities (none when the rates were given)."""
    sim_cap: dict[str, float] = {}
    if cfg.rates is None:
        start = setup.scenario.start_rate
        with waiting(console, f"simulating the saturation point of stock vLLM and of the plug-in (from {start:g} req/s, "
                            "the rate of serving one request at a time)..."):
            for name in ("vllm", cfg.policy):
                sim_cap[name] = sweep_policy(setup, name)["max_rate_at_90_slo"]
        console.print(f"simulated max rate at 90% SLO: stock {sim_cap['vllm']:.3g} req/s, {cfg.policy} "
                      f"{sim_cap[cfg.policy]:.3g} req/s")
        if not sim_cap["vllm"] > 0:
            raise EngineBenchError(
                f"the calibrated simulator finds no rate at which stock vLLM meets {SLO_TARGET:.0%} of SLOs on this "
                f"engine (searched down from {start:g} req/s, the rate of serving one request at a time): its SLOs "
                f"(scale {setup.config.slo_scale}) are out of reach here; raise --slo-scale, or give --rates")
    rates = cfg.rates or [float(f"{sim_cap['vllm'] * f:.3g}") for f in cfg.rate_factors]
    console.print(f"replaying at {', '.join(f'{r:g}' for r in rates)} req/s")
    return rates, sim_cap


def _replay_at(cfg: EngineBenchConfig, setup: Setup, arms: list[Arm], prompts: dict[int, list[int]] | None, rate: float,
               work: Path, console: Console) -> dict[str, Any]:
    """2. Replay at one rate: each arm side by side with a stock run of its own (same arrivals; same predictions for
    the arm's plug-in), each run then set beside its simulation (:func:`_compared`). With ``swap_cores`` the pair is
    replayed a second time with the engines' cores swapped and each figure is the two replays' mean (losses summed);
    ``replays`` keeps each replay's pair and ratio. The point's ``stock`` and ``lengthwise`` are the main arm's pair;
    ``arms`` holds every pair and its goodput ratio."""
    at = setup.at_rate(rate)
    point: dict[str, Any] = {"rate": rate, "arms": {}}
    served = prompts is not None
    for i, arm in enumerate(arms):
        arm_setup = dataclasses.replace(setup, predictor=arm.predictor, predictions=arm.predictions)
        replays = []
        for swapped in (False, True) if cfg.swap_cores else (False,):
            where = ", cores swapped" if swapped else ""
            console.print(f"[bold]stock and {arm.label}[/], side by side{where}, at {rate:g} req/s ({len(at)} requests each)")
            tag = f"r{rate:g}-{i}" + ("-swapped" if swapped else "")
            stock_job = _job("stock", cfg, at, arm.predictions, setup.slo, tag, setup.config.tfs, prompts)
            arm_job = _job(arm.policy, cfg, at, arm.predictions, setup.slo, tag, setup.config.tfs, prompts)
            if swapped:  # run_engines gives the first job the first cores
                out_arm, out_stock = run_engines([arm_job, stock_job], work, console)
            else:
                out_stock, out_arm = run_engines([stock_job, arm_job], work, console)
            stock = _compared(out_stock, at, arm_setup, "stock", "vllm", cfg.max_tokens, served).to_dict()
            run = _compared(out_arm, at, arm_setup, arm.label, arm.policy, cfg.max_tokens, served).to_dict()
            replays.append({"stock": stock, "run": run, "stock_first_cores": not swapped,
                            "goodput_ratio": _ratio(run["goodput_rps"], stock["goodput_rps"])})
        point["arms"][arm.label] = _pair(rate, arm, mean_metrics([r["stock"] for r in replays]),
                                         mean_metrics([r["run"] for r in replays]), cfg.predictor, replays=replays)
    return _point(point, arms)


def _pair(rate: float, arm: Arm, stock: dict[str, Any], run: dict[str, Any], default_spec: str,
          **extra: Any) -> dict[str, Any]:
    """One arm at one rate beside its stock run, as every point of the JSON holds it (``extra``: how it was replayed)."""
    return {"stock": {"rate": rate, **stock}, "run": {"rate": rate, **run}, "policy": arm.policy,
            "predictor": getattr(arm.predictor, "spec", default_spec), **extra,
            "goodput_ratio": _ratio(run["goodput_rps"], stock["goodput_rps"])}


def _point(point: dict[str, Any], arms: list[Arm]) -> dict[str, Any]:
    """``point`` with the main arm's pair at its top level, where the headline and the plot read it."""
    main = point["arms"][arms[0].label]
    return {**point, "stock": main["stock"], "lengthwise": main["run"], "goodput_ratio": main["goodput_ratio"]}


def _replay_sequential(cfg: EngineBenchConfig, setups: dict[int, tuple[Setup, list[Arm]]],
                       prompts: dict[int, list[int]] | None, rates: list[float], run, console: Console,
                       deadline: float | None,
                       start_s: float) -> tuple[list[dict[str, Any]], dict[str, Any], list[tuple[plan.Slot, dict]]]:
    """2. Replay, one engine at a time (``sequential``), as a plan (:mod:`serving.bench.engine.plan`): the replays of
    every arm, rate and seed that fit the time left before ``deadline`` in order of value, run engine by engine (stock on
    the engine that calibrated), every arm of a rate and seed set beside that rate and seed's one stock replay, whose
    deadlines are the main arm's. A run cut short (Ctrl-C, a time limit's SIGINT, an engine that died) keeps every
    replay that finished: the points hold the arms measured at each rate and seed, and the first point says what was
    cut. Returns the points as :func:`_replay_at` does (each with its ``seed``, and ``stock_again`` when replayed), the
    plan (what was chosen, left out and skipped, and what cut the run) and each finished replay's output, for the
    records."""
    served = prompts is not None
    seeds = list(setups)
    arms0 = setups[seeds[0]][1]
    labels = [a.label for a in arms0]
    ats = {(rate, s): setups[s][0].at_rate(rate) for rate in rates for s in seeds}
    replay_s = plan.ReplayTimes({s: setup for s, (setup, _) in setups.items()}, cfg.max_tokens)

    def tag(slot: plan.Slot, i: int | None) -> str:
        seed = f"-s{slot.seed}" if len(seeds) > 1 else ""
        return f"r{slot.rate:g}" + ("" if i is None else f"-{i}") + seed + ("-again" if slot.arm == plan.STOCK_AGAIN else "")

    def job_of(slot: plan.Slot) -> dict[str, Any]:
        setup, arms = setups[slot.seed]
        arm = arms[slot.index if slot.index is not None else 0]
        job = _job("stock" if slot.index is None else arm.policy, cfg, ats[(slot.rate, slot.seed)], arm.predictions,
                   setup.slo, tag(slot, slot.index), setup.config.tfs, prompts)
        if slot.arm == plan.STOCK_AGAIN:
            job["process"] = "again"
        return job

    budget = None if deadline is None else deadline - time.monotonic()
    chosen = plan.make_plan(labels, [a.policy for a in arms0], rates, seeds, cfg.stock_again, budget, start_s, replay_s)
    if budget is not None:
        console.print(f"plan: {len(chosen.order)} of {len(chosen.slots)} replays fit {budget:.0f} s (about "
                      f"{chosen.total_s:.0f} s, engine starts of {start_s:.0f} s included); left out: "
                      f"{', '.join(s.name for s in chosen.left) or 'none'}")
    outs, skipped, cut = plan.execute(chosen.order, job_of, run, console, deadline, start_s, replay_s)
    points = []
    for rate in rates:
        for seed in seeds:
            stock_slot, main_slot = plan.Slot(plan.STOCK, None, rate, seed), plan.Slot(labels[0], 0, rate, seed)
            if stock_slot not in outs or main_slot not in outs:
                continue
            setup, arms = setups[seed]
            at = ats[(rate, seed)]
            point: dict[str, Any] = {"rate": rate, "seed": seed, "arms": {}}
            if cut and not points:
                point["cut"] = cut
            for i, arm in enumerate(arms):
                out = outs.get(plan.Slot(arm.label, i, rate, seed))
                if out is None:
                    continue
                arm_setup = dataclasses.replace(setup, predictor=arm.predictor, predictions=arm.predictions)
                stock = _compared(outs[stock_slot], at, arm_setup, "stock", "vllm", cfg.max_tokens, served).to_dict()
                r = _compared(out, at, arm_setup, arm.label, arm.policy, cfg.max_tokens, served).to_dict()
                replay = {"stock": stock, "run": r, "stock_first_cores": None,
                          "goodput_ratio": _ratio(r["goodput_rps"], stock["goodput_rps"])}
                point["arms"][arm.label] = _pair(rate, arm, stock, r, cfg.predictor, shared_stock=True, replays=[replay])
            again = outs.get(plan.Slot(plan.STOCK_AGAIN, None, rate, seed))
            if again is not None:
                point["stock_again"] = {"rate": rate, **_compared(again, at, setup, plan.STOCK_AGAIN, "vllm", cfg.max_tokens,
                                                                  served).to_dict()}
            points.append(_point(point, arms))
    info = {"budget_s": budget, "engine_start_s": start_s, "seeds": seeds, "stock_again": cfg.stock_again,
            "chosen": [s.name for s in chosen.order], "left_out": [s.name for s in chosen.left], "skipped": skipped,
            "estimates_s": replay_s.to_dict(), **({"cut": cut} if cut else {})}
    return points, info, [(slot, outs[slot]) for slot in chosen.order if slot in outs]


_SUMMED = frozenset({"wrong_or_lost", "relabel_mismatch"})  # losses are added up over replays, never averaged away


def mean_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's metrics (:meth:`RunMetrics.to_dict`) from several replays of the same trace: each number the replays'
    mean (so a percentile is the mean of the replays' percentiles, not a percentile of their pooled requests), the
    counts of lost or mismatched requests summed, nested dicts merged the same way, anything else the first
    replay's. One replay is returned as it is."""
    if len(runs) == 1:
        return runs[0]
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        vals = [r.get(key) for r in runs]
        if isinstance(first, dict) and all(isinstance(v, dict) for v in vals):
            out[key] = mean_metrics(vals)
        elif isinstance(first, (int, float)) and not isinstance(first, bool) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            out[key] = sum(vals) if key in _SUMMED else float(np.mean(vals))
        else:
            out[key] = first
    return out


def _compared(out: dict[str, Any], at: list[TraceRequest], setup: Setup, label: str, sim_policy: str,
              max_tokens: int | None, served: bool = False) -> RunMetrics:
    """3. Compare one engine run with the simulator on the same trace, policy, rate and ``max_tokens``: the relative
    error in JCT and throughput is the simulator's calibration error, which says how far its sweeps can be trusted."""
    m = summarize_run(out, at, setup.slo, label, served)
    s = simulate(at, setup.predictions, sim_policy, setup.config, setup.kv_blocks, setup.latency, setup.slo,
                 repredict=setup.predictor.repredict, max_tokens=max_tokens)
    m.extra["sim"] = {k: getattr(s, k) for k in ("jct_mean_s", "jct_p50_s", "jct_p99_s", "throughput_rps", "slo_attainment",
                                                  "ttft_tpot_attainment", "normalized_latency_s", "goodput_rps",
                                                  "preemptions")}
    m.extra["sim_error"] = {k: _rel(getattr(s, k), getattr(m, k)) for k in ("jct_mean_s", "jct_p50_s", "throughput_rps")}
    return m


def _rel(sim: float, real: float) -> float:
    return (sim - real) / real if real else float("nan")


def _result(cfg: EngineBenchConfig, setup: Setup, arms: list[Arm], csv_path: Path, sim_cap: dict[str, float],
            points: list[dict], relabel: dict[str, Any] | None, work: Path, console: Console) -> dict[str, Any]:
    """The result: the headline point (:func:`headline`, chosen by stock's attainment alone), each scheduler's max rate
    at the SLO target, every point, and how the calibration was made, so that a result says how it was obtained."""
    head, rule = headline(points)
    capacity = {lab: max_rate_at(points, lab) for lab in ("stock", "lengthwise")}
    cap_ratio = (capacity["lengthwise"]["rate"] / capacity["stock"]["rate"]
                 if capacity["stock"]["rate"] and capacity["lengthwise"]["rate"] is not None else None)
    console.print(f"headline: {rule}: {head['rate']:g} req/s, goodput ratio "
                  f"{'n/a' if head['goodput_ratio'] is None else format(head['goodput_ratio'], '.2f') + 'x'}; "
                  f"max rate at >= {SLO_TARGET:.0%} SLO: stock {_cap_text(capacity['stock'])}, "
                  f"{cfg.policy} {_cap_text(capacity['lengthwise'])}")
    return {
        "config": cfg.model_dump(), "device": _device(), "stock": head["stock"], "lengthwise": head["lengthwise"],
        "goodput_ratio": head["goodput_ratio"], "rate": head["rate"], "headline_rule": rule, "points": points,
        "capacity": {**capacity, "ratio": cap_ratio, "target_attainment": SLO_TARGET},
        "arms": {a.label: {"policy": a.policy, "predictor": getattr(a.predictor, "spec", None), "quality": a.quality}
                 for a in arms},
        "relabel": relabel, "cut": next((p["cut"] for p in points if "cut" in p), None),
        "calibration": {"latency_model": setup.latency.describe(), "profile_csv": str(csv_path), "tfs": setup.config.tfs,
                        "slo": {"scale": setup.config.slo_scale, "t_p_s": setup.slo.t_p, "t_g_s": setup.slo.t_g},
                        "sim_max_rate_at_90_slo": sim_cap,
                        "sim_error": {lab: {f"rate_{p['rate']:g}": p[lab]["extra"]["sim_error"] for p in points}
                                      for lab in ("stock", "lengthwise")}},
        "work_dir": str(work),
    }


def _device() -> str:
    """Where the engines ran: ``cpu``, or the GPU's name as torch reports it."""
    if is_cpu_build():
        return "cpu"
    import torch

    return f"cuda: {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "cuda"


def _write(result: dict[str, Any], json_path: Path | None, png_path: Path | None, console: Console) -> None:
    """The result where asked for: the JSON keeps every point and how the run was made; the plot shows goodput, SLO
    attainment and p99 JCT against the rate, real beside simulated."""
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=2, default=float))
        console.print(f"wrote {json_path}")
    if png_path:
        plot_engine(result, png_path)
        console.print(f"wrote {png_path}")


def headline(points: list[dict]) -> tuple[dict, str]:
    """The point the top-level result reports: the lowest rate at which stock vLLM misses its SLO for more than
    10% of requests, where a deployment starts to lose requests and scheduling decides how many. Chosen by stock's
    result alone, never by ours; without such a point, the highest rate."""
    for p in sorted(points, key=lambda p: p["rate"]):
        if p["stock"]["slo_attainment"] < SLO_TARGET:
            return p, f"lowest rate where stock attains < {SLO_TARGET:.0%} of SLOs"
    return max(points, key=lambda p: p["rate"]), f"highest rate (stock attains >= {SLO_TARGET:.0%} at every rate)"


def max_rate_at(points: list[dict], label: str, target: float = SLO_TARGET) -> dict[str, Any]:
    """The highest rate at which ``label`` attains ``target``, interpolated linearly between the measured rates.

    ``bound`` says how far to trust it: ``interpolated`` between two measured rates; ``at least`` when it met the
    target at every rate (the sweep did not reach its limit); ``below`` when it missed at the lowest rate.
    """
    pts = sorted((p["rate"], p[label]["slo_attainment"]) for p in points)
    if pts[0][1] < target:
        return {"rate": None, "bound": f"below {pts[0][0]:g}"}
    for (r0, a0), (r1, a1) in itertools.pairwise(pts):
        if a1 < target:
            return {"rate": r0 + (r1 - r0) * (a0 - target) / (a0 - a1), "bound": "interpolated"}
    return {"rate": pts[-1][0], "bound": "at least"}


def _cap_text(c: dict) -> str:
    return c["bound"] if c["rate"] is None else f"{'>= ' if c['bound'] == 'at least' else ''}{c['rate']:.2f} req/s"


def _ratio(a: float, b: float) -> float | None:
    """ours / stock; None when stock met no SLO at all (no finite ratio; the JSON says null)."""
    return a / b if b > 0 else None


def _table(points: list[dict], console: Console,
           title: str = "real engine: stock vLLM vs the plug-in (each arm beside its own stock run, same trace)") -> None:
    """Every arm beside its stock run; the three SLO kinds side by side: EcoServe's JCT attainment, DistServe's
    TTFT+TPOT attainment and SeaLLM's normalised latency (:func:`serving.sim.metrics.slo_kinds`)."""
    t = Table(title=title)
    for col in ("rate", "arm", "scheduler", "goodput r/s", "thru r/s", "JCT SLO att.", "TTFT+TPOT att.", "norm. lat. s/tok",
                "JCT p50 s", "JCT p99 s", "TTFT p50 s", "TBT p50 ms", "preempt", "sched µs/step", "lost", "sim JCT err",
                "sim thru err"):
        t.add_column(col, justify="right", overflow="fold")
    for p in points:
        for label, pair in p["arms"].items():
            for lab in ("stock", "run"):
                m = pair[lab]
                e = m["extra"]["sim_error"]
                t.add_row(f"{p['rate']:g}", label, "stock" if lab == "stock" else pair["policy"], f"{m['goodput_rps']:.3f}",
                          f"{m['throughput_rps']:.3f}", f"{m['slo_attainment']:.1%}", f"{m['ttft_tpot_attainment']:.1%}",
                          f"{m['normalized_latency_s']:.4f}", f"{m['jct_p50_s']:.2f}",
                          f"{m['jct_p99_s']:.2f}", f"{m['ttft_p50_s']:.2f}", f"{m['tbt_p50_s'] * 1e3:.1f}",
                          f"{m['preemptions']:g}", f"{m['sched_us_per_step']:.0f}", str(m["extra"]["wrong_or_lost"]),
                          f"{e['jct_mean_s']:+.1%}", f"{e['throughput_rps']:+.1%}")
            t.add_row("", label, "ratio", _ratio_text(pair), *[""] * 13)
    console.print(t)


def _ratio_text(pair: dict[str, Any]) -> str:
    """The pair's goodput ratio and, over swapped replays, each replay's: ``1.04x (0.98x, 1.10x)``."""
    def fmt(r: float | None) -> str:
        return "n/a" if r is None else f"{r:.2f}x"

    each = [r["goodput_ratio"] for r in pair.get("replays", [])]
    return fmt(pair["goodput_ratio"]) + (f" ({', '.join(fmt(r) for r in each)})" if len(each) > 1 else "")


def plot_engine(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    rates = [p["rate"] for p in pts]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for lab, style in (("stock", {"marker": "o", "ls": "--"}), ("lengthwise", {"marker": "s", "ls": "-"})):
        axes[0].plot(rates, [p[lab]["goodput_rps"] for p in pts], label=f"{lab} (real)", **style)
        axes[0].plot(rates, [p[lab]["extra"]["sim"]["goodput_rps"] for p in pts], label=f"{lab} (simulated)", alpha=0.5,
                     **style)
        axes[1].plot(rates, [p[lab]["slo_attainment"] for p in pts], label=lab, **style)
        axes[2].plot(rates, [p[lab]["jct_p99_s"] for p in pts], label=f"{lab} (real)", **style)
        axes[2].plot(rates, [p[lab]["extra"]["sim"]["jct_p99_s"] for p in pts], label=f"{lab} (simulated)", alpha=0.5,
                     **style)
    for ax, title in zip(axes, ("goodput (req/s within SLO)", "SLO attainment", "JCT p99 (s)")):
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
