"""``lengthwise bench engine``: argument parsing and one-line errors for the real-engine benchmark."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serving.argtypes import comma_list, flag_error


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register ``bench engine`` under the ``lengthwise bench`` group."""
    p = bench_sub.add_parser(
        "engine", help="stock vLLM scheduling vs the lengthwise plug-in on the real engine, same trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay one trace (ShareGPT prompts, their real response lengths, Poisson arrivals or --arrivals) "
                    "through a real vLLM engine twice per rate: stock scheduling, then the lengthwise plug-in, with a "
                    "KV pool small enough to create memory pressure. Random weights; every request asks for the same max_tokens "
                    "(--max-tokens), and a logits processor ends it at exactly its real length, out of both schedulers' "
                    "sight. A calibration run first fits the simulator's step-latency model to the engine; the same "
                    "trace is then simulated with the same cap and the simulator's error against the engine is reported. "
                    "Prints a table, writes JSON and a PNG.",
        epilog="examples:\n  lengthwise bench engine\n"
               "  lengthwise bench engine --max-requests 300 --rates 2,3 --kv-blocks 192 --json /tmp/engine.json\n"
               "  lengthwise bench engine --policy ecoserve --predictor models:/length-predictor@champion\n"
               "  lengthwise bench engine --preset cpu-smoke --max-requests 16\n"
               "  lengthwise bench engine --arrivals gamma:3 --seed 1   # bursty arrivals at the same mean rates\n"
               "  lengthwise bench engine --arrivals trace-times:azure-code   # the Azure code trace's gaps\n"
               "  lengthwise bench engine --preset h200-llama8b   # on one GPU, after make gpu-pack\n\n"
               "It runs for minutes: each rate replays the trace twice in real time (requests / rate seconds each).\n"
               "A preset sets the flags you leave out: h200-llama8b is EcoServe's KV-bound setting on a Llama-3-8B-shaped\n"
               "engine (458 KV blocks of 32, ShareGPT first turns in Llama-3 tokens, engines one after another, async\n"
               "scheduling for both arms; arms stock, lengthwise with noise as good as the trained predictor, the oracle,\n"
               "sarathi; rates 1x and 1.5x the simulated knee); cpu-smoke runs that path with a tiny model here.")
    from serving.bench.engine.presets import PRESETS
    from serving.launch.models import SHAPES

    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="named settings for the flags you leave out (see below)")
    p.add_argument("--policy", default="lengthwise", help="the plug-in's policy (default: %(default)s)")
    p.add_argument("--predictor", default="noise:0.55", metavar="SPEC",
                   help="predictions carried to the engine: noise:ACC | noise-tau:T (noise ranking the trace at Kendall "
                        "tau T) | gauss:SIGMA | oracle | models:/NAME@ALIAS (default: %(default)s, our trained "
                        "predictor's top-1 accuracy)")
    p.add_argument("--workload", metavar="PATH", help="trace or prompt file (default: ShareGPT first turns in $LENGTHWISE_DATA)")
    p.add_argument("--max-requests", type=int, default=200, help="requests per replay (default: %(default)s)")
    p.add_argument("--rates", metavar="R,R,...", type=comma_list(float, "1.5,3"),
                   help="arrival rates in req/s (default: 1.0x, 1.25x, 1.5x and 2x the rate stock vLLM sustains at 90%% "
                        "SLO, as the calibrated simulator predicts). The JSON's top level reports the lowest rate at "
                        "which stock attains < 90%% of SLOs (else the highest), and each scheduler's max rate at >= 90%%")
    p.add_argument("--arrivals", default="poisson", metavar="SPEC",
                   help="arrival process at every rate, the same for the replays and the simulator's predictions: "
                        "poisson | gamma:CV (Gamma gaps with coefficient of variation CV, e.g. gamma:3: bursts at the "
                        "same mean rate; the seed draws them) | trace-times:PATH_OR_NAME (a real trace's gaps scaled to "
                        "the rate, repeated when it runs out; names: azure-code, mooncake-conversation) "
                        "(default: %(default)s)")
    p.add_argument("--rate-factors", metavar="F,F,...", type=comma_list(float, "1,1.5"), default=[1.0, 1.25, 1.5, 2.0],
                   help="without --rates: replay at these multiples of the rate the calibrated simulator says stock vLLM "
                        "sustains at 90%% SLO (default: 1,1.25,1.5,2)")
    p.add_argument("--kv-blocks", type=int, default=128,
                   help="KV pool in blocks of 32 tokens (default: %(default)s: about 7 ShareGPT requests at once, so stock vLLM "
                        "preempts near its capacity)")
    p.add_argument("--shape", choices=list(SHAPES), default="tiny",
                   help="dummy-weight model: micro (2 layers, hidden 256: smoke runs), tiny (4 layers, hidden 256), "
                        "SmolLM2-135M's shape or Llama-3-8B's (a GPU's) (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="context limit; trace requests longer than this are skipped (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the engine (default: %(default)s; more only on cores nothing else uses)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="max_tokens of every request, the same for stock vLLM and the plug-in (which clamps predictions "
                        "to it); no request may need more (default: the trace's longest response rounded up to a multiple "
                        "of 256, e.g. 1536 for the default 200 ShareGPT requests: a fixed 1024 would cut ShareGPT's longer "
                        "answers). Each request's true length is enforced by a logits processor, never by max_tokens")
    p.add_argument("--calibration-requests", type=int, default=96,
                   help="requests in the calibration burst that fits the step model (default: %(default)s)")
    p.add_argument("--slo-scale", type=float, help="EcoServe's SLO scale (default: the policy config's)")
    p.add_argument("--slo-kind", choices=["jct", "ttft+tpot", "normalised"], default="jct",
                   help="the SLO the plug-in's posterior policies optimise (every arm reports all three kinds side by "
                        "side): jct, ttft+tpot or normalised (default: %(default)s)")
    from serving.launch.models import Sampling

    served = Sampling.model_fields
    real = p.add_argument_group("a real model instead of random weights")
    real.add_argument("--model", metavar="PATH",
                      help="serve real weights: a Hugging Face model directory, or a GGUF converted once into "
                           "bench-results/models (e.g. $LENGTHWISE_DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf). Requests "
                           "end where the model ends them (end of sequence or --max-tokens, default 512), sampled with a "
                           "seed per request; the calibration run is a seeded relabel that measures every request's "
                           "served length, which the oracle, the noise and the SLO judge use")
    real.add_argument("--temperature", type=float, default=served["temperature"].default,
                      help="sampling temperature (default: %(default)s)")
    real.add_argument("--top-p", type=float, default=served["top_p"].default, help="(default: %(default)s)")
    real.add_argument("--repetition-penalty", type=float, default=served["repetition_penalty"].default,
                      help="(default: %(default)s)")
    svc = p.add_argument_group("several services in one engine (a base and LoRA adapters of it)")
    svc.add_argument("--services", metavar="SPEC",
                     help="'smollm2' (SmolLM2-135M-Instruct and its two committed adapters, terse and detailed) or "
                          "NAME=LABELS,... (lengthwise relabel files; the first the base, the others its adapters): each "
                          "request is for one service, drawn uniformly, with one of that service's own relabelled "
                          "lengths; the engine runs random weights of --shape with a random rank-8 LoRA per adapter, "
                          "all in one batch and one KV pool. Predictors: folds:tfidf (TF-IDF per service, each prompt "
                          "predicted by folds that never saw it), folds:tfidf-pooled, folds:tfidf-conditioned, "
                          "folds:model-mean (the service's mean, SeaLLM's profile), or the noise specs")
    arms = p.add_argument_group("more arms, each replayed beside a stock run of its own")
    arms.add_argument("--ablation", metavar="POLICY,...", type=comma_list(str, "sarathi,lengthwise-sjf"), default=[],
                      help="more plug-in policies with the main predictor (e.g. sarathi,lengthwise-fcfs,lengthwise-sjf)")
    arms.add_argument("--compare-predictors", metavar="SPEC,...", type=comma_list(str, "oracle,noise:matched"), default=[],
                      help="more predictors for --policy (e.g. oracle,noise:matched; noise:matched is noise at the main "
                           "predictor's measured top-1 accuracy on this trace)")
    p.add_argument("--no-swap-cores", dest="swap_cores", action="store_false",
                   help="replay each pair once (half the time) instead of twice with the engines' cores swapped; two "
                        "cores can differ by over 10%% for a whole replay, so one replay's ratio carries that")
    p.add_argument("--sequential", action="store_true",
                   help="engines one after another, each kept for every rate, one stock replay per rate shared by every "
                        "arm (one GPU: two engines cannot share it fairly)")
    plan = p.add_argument_group("a plan for engines one after another (--sequential; serving/bench/engine/plan.py)")
    plan.add_argument("--seeds", metavar="S,S,...", type=comma_list(int, "1,2"), default=[],
                      help="replay every arm and rate on each seed (arrivals and noise drawn from it; one calibration "
                           "for all; default: --seed alone)")
    plan.add_argument("--stock-again", action="store_true",
                      help="replay stock a second time in a second engine process after the arms, at every rate and "
                           "seed: the noise between two stock runs of this machine, measured beside every ratio")
    plan.add_argument("--budget-s", type=float, metavar="S",
                      help="the bench's time: the replays that fit are chosen in order of value (rate by rate in the "
                           "order given and seed by seed: stock, the main arm, the prediction-free baselines, stock "
                           "again; then the other arms; the main policy's other predictors, e.g. the oracle, last) by "
                           "the calibrated simulator's estimate of each, the rest named and left out")
    plan.add_argument("--engine-start-s", type=float, default=60.0, metavar="S",
                      help="an engine start as the plan charges it until one is measured (default: %(default)s, an 8B "
                           "engine with CUDA graphs on one H200)")
    plan.add_argument("--calibration-profile", metavar="CSV",
                      help="the step profile of an earlier calibration of this engine shape on this kind of machine: "
                           "no calibration burst runs (e.g. docs/results/gpu/h200_llama8b_graphs_step_profile.csv)")
    p.add_argument("--async-scheduling", dest="async_scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="vLLM's async scheduling for every engine, stock and plug-in alike (default: vLLM's choice: on "
                        "with CUDA, off on CPU)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="vLLM's default compiled model and CUDA graphs instead of eager mode (a GPU; slower to start)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.2,
                   help="each engine's share of the GPU for weights and activations (default: %(default)s)")
    pred = p.add_argument_group("a prediction instead of a run")
    pred.add_argument("--predict", metavar="LATENCY",
                      help="run no engine: simulate this very setting (trace, pool, arms, rate rule) with the step model "
                           "LATENCY (roofline, blis, linear:...) of --sim-model on --sim-gpu, and write the table and JSON "
                           "a later engine run is compared with")
    pred.add_argument("--sim-model", default="llama-3.1-8b", help="model for --predict (default: %(default)s)")
    pred.add_argument("--sim-gpu", default="h200", help="GPU for --predict (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write results here (default: bench-results/engine/bench_engine.json; PNG beside it)")
    p.set_defaults(func=run_cli)
    p.set_defaults(flag_default=p.get_default)
    return p


def with_preset(a: argparse.Namespace, flag_default) -> argparse.Namespace:
    """``a`` with the preset's value for every flag left at its default (a flag given on the command line wins)."""
    from serving.bench.engine.presets import PRESETS

    if not a.preset:
        return a
    out = argparse.Namespace(**vars(a))
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key, None) == flag_default(key):
            setattr(out, key, value)
    return out


def run_cli(a: argparse.Namespace) -> int:
    from pydantic import ValidationError
    from rich.console import Console

    from serving.bench.engine.bench import EngineBenchConfig, EngineBenchError, predict, run_bench
    from serving.perf.latency import LatencyError
    from serving.policy.base import PolicyError
    from serving.policy.config import PolicyConfig
    from serving.policy.registry import make_policy
    from serving.sim.predictions import PredictorSpecError
    from serving.sim.workload import WorkloadError

    a = with_preset(a, a.flag_default)
    try:
        for policy in (a.policy, *a.ablation):
            make_policy(policy, PolicyConfig(), 64)
        kw = {k: v for k, v in (("workload", a.workload), ("slo_scale", a.slo_scale), ("max_tokens", a.max_tokens),
                                ("model", a.model), ("services", a.services)) if v is not None}
        cfg = EngineBenchConfig(policy=a.policy, predictor=a.predictor, max_requests=a.max_requests, rates=a.rates,
                                kv_blocks=a.kv_blocks, shape=a.shape, max_num_batched_tokens=a.max_num_batched_tokens,
                                max_num_seqs=a.max_num_seqs, seed=a.seed, max_model_len=a.max_model_len, threads=a.threads,
                                calibration_requests=a.calibration_requests, ablation=a.ablation, rate_factors=a.rate_factors,
                                arrivals=a.arrivals, slo_kind=a.slo_kind,
                                compare_predictors=a.compare_predictors, swap_cores=a.swap_cores,
                                sequential=a.sequential, async_scheduling=a.async_scheduling, seeds=a.seeds,
                                stock_again=a.stock_again, budget_s=a.budget_s, engine_start_s=a.engine_start_s,
                                calibration_profile=a.calibration_profile,
                                gpu_memory_utilization=a.gpu_memory_utilization, cuda_graphs=a.cuda_graphs,
                                sampling={"temperature": a.temperature, "top_p": a.top_p,
                                          "repetition_penalty": a.repetition_penalty}, **kw)
        json_path = Path(a.json or "bench-results/engine/bench_engine.json")
        console = Console()
        if not console.is_terminal:
            console = Console(width=200)  # the table has 17 columns; logs and pipes get them unsquashed
        if a.predict:
            predict(cfg, a.predict, a.sim_model, a.sim_gpu, json_path, console)
        else:
            run_bench(cfg, json_path, json_path.with_suffix(".png"), console)
    except ValidationError as exc:
        print(f"lengthwise: error: {flag_error(exc)}", file=sys.stderr)
        return 2
    except (PolicyError, PredictorSpecError, WorkloadError, LatencyError, EngineBenchError, ValueError, FileNotFoundError) as exc:
        print(f"lengthwise: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
