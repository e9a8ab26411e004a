"""Our simulator against MuxServe's own measurements, before any placement of ours is compared with theirs.

Each arm simulates what MuxServe ran (``muxserve_placements.json``) on the workload it ran it on: per model, as many
Poisson arrivals at its rate as MuxServe's run sent it, lengths from :mod:`serving.bench.models.lengths`, and the
engine MuxServe's runs used, vLLM's first scheduler (``vllm-v0``: whole prompts first, no chunked prefill) with
the unit's ``max_num_seqs``, 16-token blocks and the KV share of the mesh. Step times come from the roofline model
of the LLaMA size on A100s at the unit's tensor-parallel size (communication not modelled). The figures compared
are MuxServe's: throughput (requests over the run's span), p90/p99 request latency, mean TTFT and mean TPOT.

``spatial`` gives each model a mesh of its own. The models of a mesh several share run together, each as its own
engine (:mod:`serving.sim.mesh`): ``flexsm`` (MuxServe) with the MPS percentages of its prefill and decode jobs, the
mesh's bandwidth shared between concurrent steps and its prefills one at a time; ``temporal`` one step at a time on
the whole mesh. Each model keeps a share of the KV pool by its expected demand (:func:`kv_shares`); ADBS's quota
moves as the load shifts are not modelled.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from serving.bench.models.lengths import alpaca_generators, sample_lengths
from serving.bench.models.muxserve import Level, Unit, load_placement
from serving.perf.hardware import get_gpu, get_model, kv_blocks
from serving.perf.latency import LatencyModel, RooflineLatency
from serving.perf.slo import SLO, derive_slo
from serving.policy.config import PolicyConfig
from serving.policy.request import Prediction
from serving.sim.engine import poisson_arrivals, simulate
from serving.sim.mesh import MeshModel, simulate_mesh
from serving.sim.metrics import RequestRecord, RunMetrics
from serving.sim.workload import TraceRequest

GPU = "a100-80gb"  # MuxServe §4.1: 4 nodes of 8 A100 (80GB)
BLOCK = 16  # vLLM's default block size
V0_BUDGET = 2048  # vLLM v0's max_num_batched_tokens for a 2,048-token context: max(max_model_len, 2048)
SLO_SCALE = 8.0  # MuxServe §4.3's SLO scale
COMPARED = ("throughput_rps", "jct_p90_s", "jct_p99_s", "ttft_mean_s", "tpot_mean_s")
# how the models of a shared mesh share it, per system (serving.sim.mesh): MuxServe's MPS percentages of its prefill
# and decode jobs, or temporal multiplexing's turns, one step at a time on the whole mesh
SHARING = {"flexsm": "mps", "temporal": "temporal", "spatial": "mps"}


@dataclass(frozen=True)
class Engine:
    """How fast MuxServe's engines run against the roofline: the achievable share of HBM bandwidth (``mbu``) and of
    peak FLOP/s (``mfu``), the per-step overhead, and what tensor parallelism adds to a step. The defaults are the
    roofline's own; :func:`calibrate` fits them to one level's measurements."""

    mbu: float = 0.8
    mfu: float = 0.6
    overhead_s: float = 1.5e-3
    tp_overhead_s: float = 0.0

    def latency(self, size: str, tp: int) -> RooflineLatency:
        gpu = get_gpu(GPU).model_copy(update={"mbu": self.mbu, "mfu": self.mfu})
        return RooflineLatency(get_model(size), gpu, tp, self.overhead_s, self.tp_overhead_s)


LENGTHS = ("per-model", "level-mean", "sharegpt", "alpaca-eval")


@dataclass(frozen=True)
class FidelityConfig:
    """``lengths``: ShareGPT's first turns scaled per model to its requests' mean tokens (``per-model``,
    :meth:`Level.tokens_per_request`, split as the level's average prompt and output), scaled to the level's average
    output (``level-mean``), as they are (``sharegpt``), or each model answering AlpacaEval's instructions as a
    different LLM does (``alpaca-eval``, :func:`~serving.bench.models.lengths.alpaca_generators`); ``seed``: arrivals
    and lengths; ``engine``: the step-time model."""

    lengths: str = "per-model"
    seed: int = 0
    policy: str = "vllm-v0"
    engine: Engine = Engine()
    lengths_limit: int | None = None  # draw lengths from the first this many ShareGPT first turns only (tests)
    replays: int = 3  # arrival and length draws per model, averaged: one draw of 100 arrivals spans +-10% by itself
    arrival_cv: float = 1.0  # the spread of the gaps between arrivals over their mean: 1 Poisson (MuxServe's), > 1 bursts


def unit_of(units: tuple[Unit, ...], model: str) -> Unit:
    return next(u for u in units if any(m.name == model for m in u.models))


def _scaled(x: np.ndarray, mean: float) -> np.ndarray:
    return np.maximum(1, np.rint(x * (mean / x.mean()))).astype(np.int64)


def requests_for(n: int, rate: float, cfg: FidelityConfig, salt: int, level: Level | None = None,
                 model: str | None = None) -> list[TraceRequest]:
    """``n`` Poisson arrivals at ``rate`` with sampled lengths (``salt`` keeps models' and replays' draws apart),
    scaled as ``cfg.lengths`` says for ``model`` of ``level``."""
    seed = cfg.seed * 100_000 + salt
    generator = None
    if cfg.lengths == "alpaca-eval" and level is not None and model is not None:
        names = [m.name for m in level.models]
        generator = alpaca_generators(len(names))[names.index(model)]
    prompt, out = sample_lengths(n, seed, limit=cfg.lengths_limit, generator=generator)
    if cfg.lengths == "level-mean" and level is not None:
        out = _scaled(out, level.avg_output_len)
    elif cfg.lengths == "per-model" and level is not None and model is not None:
        total = level.tokens_per_request(model)
        share = level.avg_output_len / (level.avg_output_len + level.avg_prompt_len)
        prompt, out = _scaled(prompt, total * (1 - share)), _scaled(out, total * share)
    times = poisson_arrivals(n, rate, seed, cfg.arrival_cv)
    return [TraceRequest(i, float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(times, prompt, out))]


def kv_shares(unit: Unit, level: Level) -> dict[str, float]:
    """Each model's share of a mesh's KV pool: its expected demand in bytes (rate x tokens per request x KV bytes a
    token), MuxServe's ADBS quota held where it would settle; one model alone takes all of it."""
    demand = {m.name: next(x.rate for x in level.models if x.name == m.name) * level.tokens_per_request(m.name)
              * get_model(m.size).kv_bytes_per_token() for m in unit.models}
    total = sum(demand.values())
    return {name: d / total for name, d in demand.items()}


def v0_config(size: str, max_num_seqs: int) -> PolicyConfig:
    """vLLM v0's scheduler settings on one of the fleet's models: 16-token blocks, its default token budget."""
    return PolicyConfig(block_size=BLOCK, max_num_seqs=max_num_seqs, max_num_batched_tokens=V0_BUDGET,
                        max_model_len=get_model(size).max_model_len, tfs=V0_BUDGET)


def blind(requests: list[TraceRequest]) -> list[Prediction]:
    """What vLLM's first scheduler is told of each request: nothing of its own length, the same prediction for all
    (the run's mean output)."""
    return [Prediction(length=float(np.mean([r.output_tokens for r in requests])))] * len(requests)


def run_blind(requests: list[TraceRequest], cfg: FidelityConfig, config: PolicyConfig, blocks: int,
              latency: LatencyModel, slo: SLO, records: dict[int, RequestRecord] | None = None) -> RunMetrics:
    """``requests`` through ``cfg.policy``, which reads no prediction (:func:`blind`)."""
    return simulate(requests, blind(requests), cfg.policy, config, blocks, latency, slo, records=records)


def mesh_model(unit: Unit, name: str, requests: list[TraceRequest], cfg: FidelityConfig, kv_share: float,
               slo_scale: float = SLO_SCALE, slo_latency: LatencyModel | None = None) -> MeshModel:
    """Model ``name`` of ``unit`` as its mesh runs it: its engine (vLLM v0 at the unit's ``max_num_seqs``, told
    nothing of lengths), its ``kv_share`` of the mesh's KV pool, its step model on the whole mesh and its MPS
    percentages. Its requests are judged by ``slo_scale`` times their execution alone on ``slo_latency`` (default:
    this mesh)."""
    m = next(x for x in unit.models if x.name == name)
    spec, gpu = get_model(m.size), get_gpu(GPU)
    latency = cfg.engine.latency(m.size, m.tp)
    blocks = kv_blocks(spec, kv_share * unit.kv_fraction * unit.gpus * gpu.mem_bytes, BLOCK)
    slo = derive_slo(slo_latency or latency, [r.prompt_tokens for r in requests], [r.output_tokens for r in requests],
                     slo_scale)
    return MeshModel(name, requests, blind(requests), cfg.policy, v0_config(m.size, m.max_num_seqs), blocks, latency,
                     slo, m.prefill_sm, m.decode_sm)


def simulate_unit(unit: Unit, level: Level, requests: dict[str, list[TraceRequest]], cfg: FidelityConfig,
                  sharing: str) -> dict[str, dict[str, float]]:
    """Every model of ``unit`` on its mesh together (:func:`~serving.sim.mesh.simulate_mesh`; alone for a unit of
    one), each with its requests: per model the compared figures and the run's facts."""
    shares = kv_shares(unit, level)
    models = [mesh_model(unit, m.name, requests[m.name], cfg, shares[m.name]) for m in unit.models]
    records: dict[int, RequestRecord] = {}
    runs = simulate_mesh(models, sharing, records=records)
    out = {}
    for m in models:
        run, reqs = runs[m.name], m.requests
        done = [r for r in records.values() if r.service == m.name and r.finished is not None]
        tpot = [(r.finished - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1]
        out[m.name] = {
            "throughput_rps": run.throughput_rps, "jct_p90_s": run.jct_p90_s, "jct_p99_s": run.jct_p99_s,
            "ttft_mean_s": float(np.mean([r.first_token - r.arrival for r in done])),
            "tpot_mean_s": float(np.mean(tpot)) if tpot else float("nan"), "slo_attainment": run.slo_attainment,
            "requests": len(reqs), "completed": run.requests_completed, "kv_blocks": m.kv_blocks,
            "preemptions": run.preemptions, "waited_for_mesh_s": run.extra["waited_for_mesh_s"],
            "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in reqs])),
            "mean_output_tokens": float(np.mean([r.output_tokens for r in reqs]))}
    return out


def fidelity(level: Level, system: str, cfg: FidelityConfig,
             on_model: Callable[[str], None] | None = None) -> dict[str, dict]:
    """Per model of ``level``: MuxServe's measured figures under ``system``, ours, and ours / theirs - 1. A unit's
    models run together on its mesh, shared as :data:`SHARING` says for ``system``."""
    units = load_placement(level.name, system)
    salts = {m.name: k for k, m in enumerate(level.models)}
    rate = {m.name: m.rate for m in level.models}
    sims: dict[str, list[dict[str, float]]] = {m.name: [] for m in level.models}
    for unit in units:
        for k in range(cfg.replays):
            requests = {m.name: requests_for(level.measured_row(system, m.name)["requests"], rate[m.name], cfg,
                                             salts[m.name] + 100 * k, level, m.name) for m in unit.models}
            for name, figures in simulate_unit(unit, level, requests, cfg, SHARING[system]).items():
                sims[name].append(figures)
    out: dict[str, dict] = {}
    for model in level.models:
        unit = unit_of(units, model.name)
        measured = level.measured_row(system, model.name)
        runs = sims[model.name]
        sim = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
        sim["throughput_replays"] = [r["throughput_rps"] for r in runs]
        out[model.name] = {
            "size": model.size, "rate": model.rate, "gpus": unit.gpus, "tp": unit.models[0].tp,
            "shares_mesh_with": [m.name for m in unit.models if m.name != model.name], "measured": measured,
            "simulated": sim,
            "error": {k: sim[k] / measured[k] - 1 if measured[k] else float("nan") for k in COMPARED},
            # what one draw of this many Poisson arrivals moves a span by, measured or simulated alike
            "arrival_noise": 1 / math.sqrt(measured["requests"])}
        if on_model is not None:
            on_model(model.name)
    return out


def summary(rows: dict[str, dict], within: float = 0.15) -> dict[str, dict[str, float]]:
    """Per compared figure: the median absolute error and the share of models within ``within``, over simulated
    models; for throughput also the share within twice the arrival noise where that is wider, and the level's total
    (the sum over its simulated models, where the draws' noise averages out)."""
    out: dict[str, dict[str, float]] = {}
    for k in COMPARED:
        errs = np.array([abs(r["error"][k]) for r in rows.values() if r.get("error") and np.isfinite(r["error"][k])])
        out[k] = {"median_abs_error": float(np.median(errs)) if errs.size else float("nan"),
                  "within": float(np.mean(errs <= within)) if errs.size else float("nan"), "models": int(errs.size)}
    sim = [r for r in rows.values() if r.get("error")]
    if sim:
        out["throughput_rps"]["within_noise"] = float(np.mean([
            abs(r["error"]["throughput_rps"]) <= max(within, 2 * r["arrival_noise"]) for r in sim]))
        total = sum(r["simulated"]["throughput_rps"] for r in sim) / sum(r["measured"]["throughput_rps"] for r in sim)
        out["throughput_rps"]["total_error"] = total - 1
    return out


FITTED = ("throughput_rps", "tpot_mean_s")  # what calibration matches: the capacity, and the step time under load


def fit_error(rows: dict[str, dict]) -> float:
    """Mean squared log ratio of ours to theirs over :data:`FITTED` and the simulated models."""
    errs = [math.log(r["simulated"][k] / r["measured"][k]) ** 2 for r in rows.values() if r.get("error")
            for k in FITTED if r["measured"][k] > 0 and r["simulated"][k] > 0]
    return float(np.mean(errs)) if errs else float("inf")


def calibrate(level: Level, cfg: FidelityConfig, grid: dict[str, Sequence[float]],
              on_try: Callable[[Engine, float], None] | None = None) -> tuple[Engine, float]:
    """The :class:`Engine` of ``grid`` (field -> values tried) whose spatial run of ``level`` errs least
    (:func:`fit_error`). Fitted on one level, judged on the others: the levels share the engines, not the loads."""
    best: tuple[Engine, float] | None = None
    keys = list(grid)
    for values in itertools.product(*(grid[k] for k in keys)):
        engine = dataclasses.replace(cfg.engine, **dict(zip(keys, values)))
        err = fit_error(fidelity(level, "spatial", dataclasses.replace(cfg, engine=engine)))
        if on_try is not None:
            on_try(engine, err)
        if best is None or err < best[1]:
            best = (engine, err)
    assert best is not None
    return best


DEFAULT_GRID = {"mbu": [0.8, 0.5, 0.35, 0.25], "overhead_s": [0.0015, 0.005, 0.01],
                "tp_overhead_s": [0.0, 0.01, 0.02, 0.04]}


def calibrated(levels: dict[str, Level], calibrate_on: str, config: Callable[[Level], FidelityConfig],
               progress: Any) -> tuple[dict[str, Engine], dict | None]:
    """``{"roofline": ..., "calibrated": ...}`` (the second fitted on spatial at ``calibrate_on``, unless 'none'), and
    the calibration's record for the JSON."""
    engines = {"roofline": Engine()}
    if calibrate_on == "none":
        return engines, None
    task = progress.add_task(f"calibrating on {calibrate_on}", total=math.prod(len(v) for v in DEFAULT_GRID.values()))
    tried = []

    def on_try(engine: Engine, err: float) -> None:
        tried.append({**dataclasses.asdict(engine), "fit_error": err})
        progress.advance(task)

    best, err = calibrate(levels[calibrate_on], config(levels[calibrate_on]), DEFAULT_GRID, on_try)
    engines["calibrated"] = best
    return engines, {"level": calibrate_on, "engine": dataclasses.asdict(best), "fit_error": err, "grid": DEFAULT_GRID,
                     "tried": tried}
