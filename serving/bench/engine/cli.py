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
        description="Replay one trace (ShareGPT prompts, their real response lengths, Poisson arrivals) through a real "
                    "vLLM engine twice per rate: stock scheduling, then the lengthwise plug-in, with a KV pool small "
                    "enough to create memory pressure. Random weights; every request asks for the same max_tokens "
                    "(--max-tokens), and a logits processor ends it at exactly its real length, out of both schedulers' "
                    "sight. A calibration run first fits the simulator's step-latency model to the engine; the same "
                    "trace is then simulated with the same cap and the simulator's error against the engine is reported. "
                    "Prints a table, writes JSON and a PNG.",
        epilog="examples:\n  lengthwise bench engine\n"
               "  lengthwise bench engine --max-requests 300 --rates 2,3 --kv-blocks 192 --json /tmp/engine.json\n"
               "  lengthwise bench engine --policy ecoserve --predictor models:/length-predictor@champion\n\n"
               "It runs for minutes: each rate replays the trace twice in real time (requests / rate seconds each).")
    p.add_argument("--policy", default="lengthwise", help="the plug-in's policy (default: %(default)s)")
    p.add_argument("--predictor", default="noise:0.55", metavar="SPEC",
                   help="predictions carried to the engine: noise:ACC | gauss:SIGMA | oracle | models:/NAME@ALIAS "
                        "(default: %(default)s, our trained predictor's top-1 accuracy)")
    p.add_argument("--workload", metavar="PATH", help="trace or prompt file (default: ShareGPT first turns in $LENGTHWISE_DATA)")
    p.add_argument("--max-requests", type=int, default=200, help="requests per replay (default: %(default)s)")
    p.add_argument("--rates", metavar="R,R,...", type=comma_list(float, "1.5,3"),
                   help="arrival rates in req/s (default: 1.0x, 1.25x, 1.5x and 2x the rate stock vLLM sustains at 90%% "
                        "SLO, as the calibrated simulator predicts). The JSON's top level reports the lowest rate at "
                        "which stock attains < 90%% of SLOs (else the highest), and each scheduler's max rate at >= 90%%")
    p.add_argument("--rate-factors", metavar="F,F,...", type=comma_list(float, "1,1.5"), default=[1.0, 1.25, 1.5, 2.0],
                   help="without --rates: replay at these multiples of the rate the calibrated simulator says stock vLLM "
                        "sustains at 90%% SLO (default: 1,1.25,1.5,2)")
    p.add_argument("--kv-blocks", type=int, default=128,
                   help="KV pool in blocks of 32 tokens (default: %(default)s: about 7 ShareGPT requests at once, so stock vLLM "
                        "preempts near its capacity)")
    p.add_argument("--shape", choices=["micro", "tiny", "smollm2"], default="tiny",
                   help="dummy-weight model: micro (2 layers, hidden 256: smoke runs), tiny (4 layers, hidden 256) or "
                        "SmolLM2-135M's shape (default: %(default)s)")
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
    arms = p.add_argument_group("more arms, each replayed beside a stock run of its own")
    arms.add_argument("--ablation", metavar="POLICY,...", type=comma_list(str, "sarathi,lengthwise-sjf"), default=[],
                      help="more plug-in policies with the main predictor (e.g. sarathi,lengthwise-fcfs,lengthwise-sjf)")
    arms.add_argument("--compare-predictors", metavar="SPEC,...", type=comma_list(str, "oracle,noise:matched"), default=[],
                      help="more predictors for --policy (e.g. oracle,noise:matched; noise:matched is noise at the main "
                           "predictor's measured top-1 accuracy on this trace)")
    p.add_argument("--no-swap-cores", dest="swap_cores", action="store_false",
                   help="replay each pair once (half the time) instead of twice with the engines' cores swapped; two "
                        "cores can differ by over 10%% for a whole replay, so one replay's ratio carries that")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write results here (default: bench-results/engine/bench_engine.json; PNG beside it)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(a: argparse.Namespace) -> int:
    from pydantic import ValidationError
    from rich.console import Console

    from serving.bench.engine.bench import EngineBenchConfig, EngineBenchError, run_bench
    from serving.perf.latency import LatencyError
    from serving.policy.base import PolicyError
    from serving.policy.config import PolicyConfig
    from serving.policy.registry import make_policy
    from serving.sim.predictions import PredictorSpecError
    from serving.sim.workload import WorkloadError

    try:
        for policy in (a.policy, *a.ablation):
            make_policy(policy, PolicyConfig(), 64)
        kw = {k: v for k, v in (("workload", a.workload), ("slo_scale", a.slo_scale), ("max_tokens", a.max_tokens),
                                ("model", a.model)) if v is not None}
        cfg = EngineBenchConfig(policy=a.policy, predictor=a.predictor, max_requests=a.max_requests, rates=a.rates,
                                kv_blocks=a.kv_blocks, shape=a.shape, max_num_batched_tokens=a.max_num_batched_tokens,
                                max_num_seqs=a.max_num_seqs, seed=a.seed, max_model_len=a.max_model_len, threads=a.threads,
                                calibration_requests=a.calibration_requests, ablation=a.ablation, rate_factors=a.rate_factors,
                                compare_predictors=a.compare_predictors, swap_cores=a.swap_cores,
                                sampling={"temperature": a.temperature, "top_p": a.top_p,
                                          "repetition_penalty": a.repetition_penalty}, **kw)
        json_path = Path(a.json or "bench-results/engine/bench_engine.json")
        console = Console()
        if not console.is_terminal:
            console = Console(width=170)  # the table has 14 columns; logs and pipes get them unsquashed
        run_bench(cfg, json_path, json_path.with_suffix(".png"), console)
    except ValidationError as exc:
        print(f"lengthwise: error: {flag_error(exc)}", file=sys.stderr)
        return 2
    except (PolicyError, PredictorSpecError, WorkloadError, LatencyError, EngineBenchError, ValueError, FileNotFoundError) as exc:
        print(f"lengthwise: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0
