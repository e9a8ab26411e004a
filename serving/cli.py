"""``lengthwise``: the operator's command line: the serving endpoint, simulation, benchmarks, registry tools."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from pydantic import ValidationError

from predictor.common import quiet_libraries
from registry import cli as registry_cli
from registry.cli import add_parser as add_registry
from serving.argtypes import OneLineParser
from serving.bench.engine.cli import add_parser as add_bench_engine
from serving.bench.load.cli import add_overload_parser, add_soak_parser
from serving.bench.placement.cli import add_fleet_parser, add_scale_parser
from serving.bench.placement.cli import add_parser as add_bench_placement
from serving.bench.ray.cli import add_parser as add_bench_ray
from serving.gateway.cli import add_parser as add_serve
from serving.gateway.cli import run as run_serve
from serving.perf.hardware import HardwareError
from serving.policy.base import PolicyError
from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy, policy_help
from serving.progress import waiting
from serving.ray.cli import serve_ray


def _bench_predictor(a: argparse.Namespace) -> int:
    from serving.bench.predictor.train import run_bench

    quiet_libraries(a.verbose)
    run_bench(a.json, a.max_samples or None, a.epochs, a.work_dir, a.base_model, a.max_prompt_tokens, a.bucket_width,
              a.first_turn_only, a.threads)
    return 0


def _knobs(pairs: list[str]) -> dict:
    """``--set padding=0.2`` pairs into PolicyConfig overrides (validated by pydantic later)."""
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE (e.g. padding=0.2), got {pair!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def _floats(text: str, flag: str) -> list[float]:
    """``0,0.5,1`` into numbers, each >= 0; anything else a one-line error naming the flag."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} expects comma-separated numbers, e.g. 0,0.5,1; got {text!r}") from None
    if any(v < 0 for v in values):
        raise ValueError(f"{flag}: a noise level is a standard deviation, never negative; got {text!r}")
    return values


def _setup(a: argparse.Namespace, scenario_name: str):
    from serving.sim.scenarios import SCENARIOS, build_setup

    if scenario_name not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario_name!r}; choose one of: {', '.join(SCENARIOS)}")
    if a.length_noise < 0:
        raise ValueError(f"--length-noise is a standard deviation, never negative; got {a.length_noise:g}")
    if getattr(a, "rate", None) is not None and not a.rate > 0:
        raise ValueError(f"--rate must be a positive number of requests per second, got {a.rate}")
    if a.max_requests is not None and a.max_requests < 1:
        raise ValueError(f"--max-requests must be at least 1, got {a.max_requests}")
    hw = {k: v for k, v in (("model", a.model), ("gpu", a.gpu), ("kv_blocks", a.kv_blocks), ("block_size", a.block_size),
                            ("max_model_len", a.max_model_len),
                            ("kv_bytes", a.kv_gb * 1e9 if a.kv_gb else None)) if v is not None}
    if getattr(a, "rate", None) is not None and getattr(a, "arrival", None) != "trace":
        hw["start_rate"] = a.rate
    if getattr(a, "arrival", None) == "trace" and a.arrivals.strip() != "poisson":
        raise ValueError(f"--arrival trace keeps the workload's own timestamps; --arrivals {a.arrivals} draws others: "
                         "give one of the two")
    from rich.console import Console

    with waiting(Console(stderr=True), "loading workload and pricing requests..."):
        setup = build_setup(SCENARIOS[scenario_name], workload=a.workload, predictor=a.predictor,
                            max_requests=a.max_requests, latency=a.latency_model, seed=a.seed,
                            arrival=getattr(a, "arrival", None), tokenizer=a.tokenizer,
                            overrides={**_knobs(a.set), **({"slo_kind": a.slo_kind} if a.slo_kind else {})},
                            length_noise=a.length_noise, arrivals=a.arrivals, **hw)
    if getattr(a, "refine", None):
        from serving.sim.refinement import RefinedNoise, RefinementQuality

        try:
            quality = RefinementQuality.from_file(Path(a.refine))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"--refine {a.refine}: not a table of python -m serving.bench.predictor.remaining --out "
                             f"({type(exc).__name__}: {exc})") from None
        setup.refinements = RefinedNoise(quality, setup.requests, a.seed)
    return setup


def _simulate(a: argparse.Namespace) -> int:
    from rich.console import Console

    from serving.bench.sim import simulate_once

    make_policy(a.policy, PolicyConfig(), 64)  # an unknown name fails now, not after loading the workload
    setup = _setup(a, a.scenario)
    simulate_once(setup, a.policy, a.rate, a.json, Console())
    return 0


def _bench_sim(a: argparse.Namespace) -> int:
    from rich.console import Console

    from serving.bench.sim import bench_sim
    from serving.sim.scenarios import SCENARIOS

    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    for p in policies:  # fail before minutes of work, not after
        make_policy(p.removesuffix("+refined").removesuffix("+oracle"), PolicyConfig(), 64)
    if any(p.endswith("+refined") for p in policies) != bool(a.refine):
        raise ValueError("POLICY+refined and --refine QUALITY.json go together: the refinements' quality is measured "
                         "(python -m serving.bench.predictor.remaining --out QUALITY.json), never assumed")
    names = list(SCENARIOS) if a.scenario == "all" else [a.scenario]
    out_dir = Path(a.out_dir)
    if a.length_noises:
        from serving.bench.sim import bench_length_noise

        sigmas = _floats(a.length_noises, "--length-noises")
        if a.scenario == "all" or len(sigmas) < 2:
            raise ValueError("--length-noises needs one --scenario and at least two values, e.g. 0,1,4")
        setups = _setups_by(a, names[0], "length_noise", sigmas)
        json_path = Path(a.json) if a.json else out_dir / f"bench_length_noise_{names[0]}.json"
        bench_length_noise(setups, policies, json_path, json_path.with_suffix(".png"), Console())
        return 0
    if a.predictors:
        from serving.bench.sim import bench_quality

        specs = [s.strip() for s in a.predictors.split(",") if s.strip()]
        if a.scenario == "all" or len(specs) < 2:
            raise ValueError("--predictors needs one --scenario and at least two predictor specs, "
                             "e.g. oracle,noise:0.7,noise:0.5")
        setups = _setups_by(a, names[0], "predictor", specs)
        json_path = Path(a.json) if a.json else out_dir / f"bench_quality_{names[0]}.json"
        bench_quality(setups, policies, json_path, json_path.with_suffix(".png"), Console())
        return 0
    if a.seeds:
        from serving.bench.seeds import bench_seeds

        seeds = sorted({int(x) for x in _floats(a.seeds, "--seeds")})
        if a.scenario == "all" or len(seeds) < 2:
            raise ValueError("--seeds needs one --scenario and at least two seeds, e.g. 0,1,2")
        setups = _setups_by(a, names[0], "seed", seeds)
        judge = a.slo_kind or "jct"
        baselines = [b.strip() for b in a.baselines.split(",") if b.strip()]
        json_path = Path(a.json) if a.json else out_dir / f"bench_seeds_{names[0]}_{judge.replace('+', '_')}.json"
        bench_seeds(setups, policies, judge, baselines, json_path, Console())
        return 0
    for name in names:
        setup = _setup(a, name)
        json_path = Path(a.json) if a.json and len(names) == 1 else out_dir / f"bench_sim_{name}.json"
        bench_sim(setup, policies, json_path, json_path.with_suffix(".png"), Console())
    return 0


def _setups_by(a: argparse.Namespace, scenario: str, option: str, values: list) -> dict:
    """One setup of ``scenario`` per value of the sim option ``option`` (the rest as the flags say), by value."""
    setups = {}
    for v in values:
        setattr(a, option, v)
        setups[v] = _setup(a, scenario)
    return setups


def _add_sim_options(p: argparse.ArgumentParser, workload_required: bool) -> None:
    from serving.sim.scenarios import SCENARIOS

    g = p.add_argument_group("workload and hardware (defaults come from the scenario)")
    g.add_argument("--workload", required=workload_required, metavar="PATH",
                   help="Azure CSV, Mooncake JSONL, ShareGPT JSON(.xz), AlpacaEval JSONL(.xz) or a length-only CSV; "
                        "the format is detected from the file")
    g.add_argument("--max-requests", type=int, metavar="N", help="replay the first N usable requests")
    g.add_argument("--predictor", metavar="SPEC",
                   help="oracle | noise:ACC (log-normal noise giving top-1 accuracy ACC at 200-token buckets) | gauss:SIGMA "
                        "| models:/NAME@ALIAS or a predictor package dir (the real ONNX model; needs prompt text)")
    g.add_argument("--latency-model", metavar="SPEC", help="roofline | blis | linear:b0,b1,b2[,b3] (us) | fitted:PROFILE.csv")
    g.add_argument("--model", help="model config for roofline/BLIS/KV size, e.g. opt-13b, llama-3.1-8b, smollm2-135m")
    g.add_argument("--gpu", help="a100-80gb | h100 | h200")
    g.add_argument("--kv-gb", type=float, help="KV cache memory in GB (10^9 bytes)")
    g.add_argument("--kv-blocks", type=int, help="KV cache size in blocks (overrides --kv-gb)")
    g.add_argument("--block-size", type=int, help="KV block size in tokens")
    g.add_argument("--max-model-len", type=int, help="context limit; longer requests are skipped and counted")
    g.add_argument("--tokenizer", metavar="PATH", help="tokenizer for text workloads (tokenizer.json, tokenizer.model, HF dir)")
    g.add_argument("--arrivals", default="poisson", metavar="SPEC",
                   help="arrival process at every rate: poisson | gamma:CV (Gamma renewal gaps with coefficient of "
                        "variation CV at the same mean rate, e.g. gamma:3 for bursts) | trace-times:PATH_OR_NAME (a real "
                        "trace's gaps, scaled to the rate and repeated when it runs out; names: azure-code, "
                        "mooncake-conversation), e.g. --arrivals trace-times:azure-code (default: %(default)s; a "
                        "scenario or --arrival trace that replays the workload's own timestamps keeps them under poisson)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for Poisson and Gamma arrivals and prediction noise (default: 0)")
    g.add_argument("--length-noise", type=float, default=0.0, metavar="SIGMA",
                   help="move every output length by Gaussian noise of std SIGMA x the length after predictions are made "
                        "(SeaLLM's figure 13: what neither a predictor nor a service's profile can know; default: 0)")
    g.add_argument("--slo-kind", choices=["jct", "ttft+tpot", "normalised"],
                   help="the SLO the operator sets, which the posterior policies optimise and the max-rate search judges "
                        "by: jct (EcoServe's deadline), ttft+tpot (DistServe's per-token targets) or normalised (SeaLLM's "
                        "latency per token, judged by its deadline of a multiple of each request's execution time); "
                        "every table reports all three (default: the scenario's, jct)")
    g.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="policy knob, repeatable: padding, reserve, buffer, tfs, slo_scale, deadline_bin_s, max_num_seqs, ...")
    p.add_argument("--scenario", default="ecoserve-paper", choices=list(SCENARIOS) + (["all"] if not workload_required else []),
                   help="hardware, limits and workload defaults (default: %(default)s)")


def _registry(a: argparse.Namespace) -> int:
    return registry_cli.dispatch(a)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="lengthwise", description="Response-length-aware LLM serving: the serving endpoint, simulation, "
                                                     "benchmarks and registry tools.")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
    _add_bench_predictor(bsub)
    _add_bench_sim(bsub)
    _add_bench_hotpath(bsub)
    from serving.bench.predictor.sidecar import add_parser as add_bench_sidecar
    from serving.bench.predictor.variants import add_parser as add_bench_variants

    add_bench_sidecar(bsub)
    add_bench_variants(bsub)
    from serving.bench.predictor.models import add_parser as add_bench_model_lengths

    add_bench_model_lengths(bsub)
    add_bench_engine(bsub)
    add_bench_placement(bsub)
    add_fleet_parser(bsub)
    from serving.bench.models.cli import add_parser as add_bench_models

    add_bench_models(bsub)

    add_overload_parser(bsub)
    add_soak_parser(bsub)
    from serving.bench.loop import add_parser as add_bench_loop

    add_bench_loop(bsub)

    add_bench_ray(bsub)

    _add_simulate(sub)
    add_scale_parser(sub)
    _add_convert_gguf(sub)
    from serving.relabel.agreement import add_parser as add_relabel_agreement
    from serving.relabel.ceiling import add_parser as add_relabel_ceiling
    from serving.relabel.run import add_parser as add_relabel

    add_relabel(sub)
    from serving.launch.adapters import add_parser as add_train_adapter

    add_train_adapter(sub)
    add_relabel_agreement(sub)
    add_relabel_ceiling(sub)

    add_serve(sub).set_defaults(func=functools.partial(run_serve, backends={"ray": _serve_ray}))
    from serving.bench.replay import add_parser as add_replay

    add_replay(sub)
    from serving.demo import add_parser as add_demo

    add_demo(sub)
    from serving.calibrate import add_parser as add_calibrate

    add_calibrate(sub)
    from serving.datafetch import add_parser as add_data

    add_data(sub)

    add_registry(sub).set_defaults(func=_registry)
    from training.retrain import add_parser as add_retrain

    add_retrain(sub)
    return p


def _add_bench_predictor(bsub) -> None:
    """``lengthwise bench predictor``: the predictor trained, evaluated against the baselines and timed."""
    bp = bsub.add_parser("predictor", help="train on ShareGPT, compare with baselines, time ONNX inference",
                         description="Train the length predictor on the ShareGPT slice in $LENGTHWISE_DATA, evaluate it "
                         "against the baselines on a held-out split, register and promote it, and time onnxruntime "
                         "inference at batch 1 and 32.")
    bp.add_argument("--json", help="write the report here (default: bench-results/predictor/bench_predictor.json)")
    bp.add_argument("--max-samples", type=int, default=30000, help="training examples cap (default: %(default)s; 0 = all)")
    bp.add_argument("--epochs", type=int, default=3)
    bp.add_argument("--bucket-width", type=int, default=200)
    bp.add_argument("--max-prompt-tokens", type=int, default=128)
    bp.add_argument("--base-model", help="local HF model dir (default: all-MiniLM-L6-v2)")
    bp.add_argument("--first-turn-only", action="store_true")
    bp.add_argument("--threads", type=int, help="onnxruntime threads for the latency test")
    bp.add_argument("--work-dir")
    bp.add_argument("-v", "--verbose", action="store_true")
    bp.set_defaults(func=_bench_predictor)


def _bench_hotpath(a: argparse.Namespace) -> int:
    from rich.console import Console

    from serving.bench.hotpath import bench_hotpath

    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    for p in policies:
        make_policy(p, PolicyConfig(), 64)
    if a.steps < 10 or a.rounds < 1:
        raise ValueError("--steps must be at least 10 and --rounds at least 1")
    bench_hotpath(policies, a.steps, a.rounds, Path(a.json), Console())
    return 0


def _add_bench_hotpath(bsub) -> None:
    """``lengthwise bench hotpath``: a policy's decision time per step at 256 running and 1,000 waiting requests."""
    bh = bsub.add_parser(
        "hotpath", help="microseconds a policy adds to each engine step at 256 running and 1,000 waiting requests",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Drive each policy as a host does (add, schedule, update) with 256 requests running, at least 1,000 "
                    "waiting and each finished request replaced, after 1,200 finishes (learnt priors settled); the "
                    "policies interleaved round by round. Prints the table, writes JSON.",
        epilog="example:\n  lengthwise bench hotpath --policies lengthwise,lengthwise-posterior,sarathi")
    bh.add_argument("--policies", default="lengthwise,lengthwise-posterior,sarathi",
                    help="comma-separated policy names; ratios are to the first (default: %(default)s)")
    bh.add_argument("--steps", type=int, default=500, help="timed steps per policy and round (default: %(default)s)")
    bh.add_argument("--rounds", type=int, default=3, help="rounds, the order reversed every other (default: %(default)s)")
    bh.add_argument("--json", default="bench-results/hotpath.json", help="(default: %(default)s)")
    bh.set_defaults(func=_bench_hotpath)


def _add_bench_sim(bsub) -> None:
    """``lengthwise bench sim``: every scheduling policy's max rate at >= 90% SLO in the simulator."""
    bs = bsub.add_parser(
        "sim", help="rate sweep of every scheduling policy in the simulator",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="For each policy, find the highest request rate sustained at >= 90% JCT SLO attainment (EcoServe's "
                    "SLO: slo_scale x (t_p + t_g x RL)), and draw normalized latency and attainment against rate.",
        epilog="scenarios:\n" + "\n".join(f"  {k}: {v.description}" for k, v in __import__(
            "serving.sim.scenarios", fromlist=["SCENARIOS"]).SCENARIOS.items()) +
        "\n\nexamples:\n  lengthwise bench sim\n  lengthwise bench sim --scenario all --max-requests 800\n"
        "  lengthwise bench sim --policies vllm,ecoserve,oracle --predictor noise:0.8\n"
        "  lengthwise bench sim --arrivals gamma:3 --seed 1   # bursty arrivals (Gamma gaps, CV 3)\n"
        "  lengthwise bench sim --arrivals trace-times:azure-code   # the Azure code trace's gaps, scaled to each rate\n"
        "  lengthwise bench sim --policies vllm,sjf,ecoserve,lengthwise --predictors oracle,noise:0.85,noise:0.55,noise:0.4")
    bs.add_argument("--policies", default=",".join(__import__("serving.sim.sweep", fromlist=["BENCH_POLICIES"]).BENCH_POLICIES),
                    help="comma-separated policy names (default: %(default)s)")
    bs.add_argument("--json", help="write results here (default: OUT_DIR/bench_sim_<scenario>.json; PNG beside it)")
    bs.add_argument("--out-dir", default="bench-results/sim")
    bs.add_argument("--predictors", metavar="SPEC,SPEC,...",
                    help="chart benefit against prediction quality instead: max rate of each policy under each predictor "
                         "(e.g. oracle,noise:0.85,noise:0.7,noise:0.55,noise:0.4); writes bench_quality_<scenario>.json/.png")
    bs.add_argument("--length-noises", metavar="SIGMA,SIGMA,...",
                    help="SeaLLM's figure 13 instead: max rate of each policy with every output length moved by Gaussian "
                         "noise of each std (x the length; see --length-noise), e.g. 0,0.5,1,2; writes "
                         "bench_length_noise_<scenario>.json/.png")
    bs.add_argument("--seeds", metavar="SEED,SEED,...",
                    help="sweep every policy on each seed (arrivals and prediction noise redrawn) and report the mean "
                         "and spread of each max rate and of its ratio to --baselines, seed by seed; e.g. 0,1,2")
    bs.add_argument("--refine", metavar="QUALITY.json",
                    help="predictions refined as answers are written, as well as measured: the table python -m "
                         "serving.bench.predictor.remaining --out writes (Kendall tau of the remaining length at each "
                         "k); run POLICY+refined beside POLICY, e.g. --policies vllm,sarathi,lengthwise,lengthwise+refined")
    bs.add_argument("--baselines", default="vllm,sarathi,seallm",
                    help="with --seeds: the policies every ratio is taken against (default: %(default)s)")
    _add_sim_options(bs, workload_required=False)
    bs.set_defaults(func=_bench_sim)


def _add_simulate(sub) -> None:
    """``lengthwise simulate``: one workload through one policy in the discrete-event simulator."""
    sm = sub.add_parser(
        "simulate", help="replay a workload through one scheduling policy in the discrete-event simulator",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay a trace (or prompts with Poisson arrivals) through one policy on a simulated engine and "
                    "report EcoServe's metrics: SLO attainment, normalized latency, JCT/TTFT/TBT, KV use, preemptions.",
        epilog=f"policies: {policy_help()}; oracle is ecoserve fed true lengths\n\nexamples:\n"
               "  lengthwise simulate --workload $LENGTHWISE_DATA/traces/AzureLLMInferenceTrace_code_2023.csv --policy vllm "
               "--arrival trace --model llama-3.1-8b --gpu a100-80gb --latency-model blis --kv-blocks 29205 --block-size 16 "
               "--max-model-len 8192 --predictor noise:0.6\n"
               "  lengthwise simulate --workload "
               "$LENGTHWISE_DATA/prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz "
               "--policy ecoserve --rate 2 --max-requests 1000 --json run.json\n"
               "  lengthwise simulate --workload "
               "$LENGTHWISE_DATA/prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz "
               "--policy lengthwise --rate 2 --arrivals gamma:3   # bursts at the same mean rate")
    sm.add_argument("--policy", required=True, help="scheduling policy name (see below)")
    sm.add_argument("--arrival", choices=["trace", "poisson"],
                    help="file timestamps (rescaled to --rate if given) or Poisson at --rate")
    sm.add_argument("--rate", type=float, help="requests per second")
    sm.add_argument("--json", help="write the run's metrics here")
    _add_sim_options(sm, workload_required=True)
    sm.set_defaults(func=_simulate)


def _add_convert_gguf(sub) -> None:
    """``lengthwise convert-gguf``: a GGUF checkpoint to a Hugging Face directory vLLM can load."""
    cv = sub.add_parser("convert-gguf",
                        help="convert a GGUF checkpoint (e.g. SmolLM2) to a HF directory for vLLM and --base-model")
    cv.add_argument("gguf")
    cv.add_argument("out")
    cv.set_defaults(func=lambda a: __import__("predictor.convert", fromlist=["main"]).main([a.gguf, a.out]))


def _user_errors() -> tuple[type[BaseException], ...]:
    from serving.perf.latency import LatencyError
    from serving.sim.predictions import PredictorSpecError
    from serving.sim.workload import WorkloadError

    return (WorkloadError, PredictorSpecError, PolicyError, LatencyError, HardwareError, ValidationError, ValueError,
            FileNotFoundError)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, ValidationError):
        e = exc.errors()[0]
        return f"policy setting {'.'.join(map(str, e['loc']))}: {e['msg']}"
    return " ".join(str(exc).split())


def _serve_ray(settings, a: argparse.Namespace) -> int:
    """``lengthwise serve --backend ray``: the Ray Serve application (serving/ray), imported only when asked for."""
    return serve_ray(settings, a.ray_address, a.ray_predictor_model)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, one line on stderr): a code, for callers of main()
        return exc.code if isinstance(exc.code, int) else 2
    bench = getattr(args, "bench", None)
    # the simulator's errors are the user's (a policy setting, a trace); the other commands say their own
    user_errors = _user_errors() if args.command == "simulate" or bench in ("sim", "hotpath") else ()
    try:
        return int(args.func(args) or 0)
    except user_errors as exc:
        print(f"lengthwise: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what the command started was stopped on the way out (its context managers)
        print(f"{' '.join(filter(None, ('lengthwise', args.command, bench)))}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
