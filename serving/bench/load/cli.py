"""The command lines of the load benches: ``lengthwise bench overload`` and ``lengthwise bench soak``.

Every argument is checked before an engine starts; a bad one is one line on stderr and exit 2. What the benches
import (vLLM, MLflow, matplotlib) loads only when one runs, not at ``lengthwise --help``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serving.argtypes import comma_list

OVERLOAD_EPILOG = """\
examples:
  lengthwise bench overload                                   # 0.5,1,1.5,2,3 x R, bounded and unbounded (15-20 min)
  lengthwise bench overload --multiples 1,2,4 --rate 0.8 --max-requests 80
  lengthwise bench overload --max-outstanding 12              # the bounded gateway with a tighter bound
  lengthwise bench overload --arms bounded,learnt,unbounded    # and each engine's bound learnt from the SLO

R: the highest rate at which 90% of requests meet their TTFT and ATGT targets, measured through an unbounded gateway
on a ladder down from the calibrated simulator's 90% point (--rate-from simulator takes that point itself, which on a
small machine leaves out the CPU of the HTTP path), or --rate. Each run starts
its own gateway on the same two engines; "bounded" has the gateway's default bound (2 x --max-num-seqs per engine)
or --max-outstanding / --max-outstanding-per-engine, "unbounded" has both far above any run. The verdict holds
when past R the bounded goodput keeps at least 80% of its peak at or below R and at least 90% of the accepted
requests meet their SLO; compare the unbounded arm beside it. "peak in flight" below the bound means the run never
reached it: raise --max-requests or the multiples.
"""

SOAK_EPILOG = """\
examples:
  lengthwise bench soak --duration 600                        # ten minutes at 0.8 x the measured saturation rate R
  lengthwise bench soak --duration 3600 --load 0.6 --sample-interval 15
  lengthwise bench soak --duration 120 --rate 0.5 --model models:/length-predictor@challenger

R is measured first through the soak's own gateway and sidecar (--rate-from, --probe-requests), so the load is what
this stack sustains, not what the engines alone would.
needs: a registered predictor (make demo, or train-predictor --promote), vLLM (the cpu or gpu extra) and ShareGPT
prompts in $LENGTHWISE_DATA. Read the verdict: errors should be 0 and every request should end at its true length
(wrong_or_lost 0); RSS and fds per process from the end of warm-up (the first 20% of the run) to the end should stay
flat. Growth that keeps rising with --duration is a leak; a one-off step is a cache filling.
"""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _fleet_args(p: argparse.ArgumentParser, max_requests: int, max_num_seqs: int, requests_help: str,
                probe_default: str = "40") -> None:
    from serving.launch.models import SHAPES

    p.add_argument("--rate", type=float, help="req/s: R without measuring it")
    p.add_argument("--rate-from", choices=("served", "simulator"), default="served",
                   help="R without --rate: 'served' measures it through the bench's own gateway (the trace at the "
                        "simulator's rate, then x0.7 each probe, until 90%% of a probe's requests meet the SLO); "
                        "'simulator' takes the calibrated simulator's 90%% point, which leaves out the HTTP path's CPU "
                        "(default: %(default)s)")
    p.add_argument("--probe-requests", type=int, default=None, metavar="N",
                   help=f"requests per probe when R is measured (default: {probe_default})")
    p.add_argument("--max-requests", type=int, default=max_requests, help=f"{requests_help} (default: %(default)s)")
    p.add_argument("--shape", choices=list(SHAPES), default="tiny", help="the dummy model's shape (default: %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=160, help="KV blocks of 32 tokens per engine (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs, help="each engine's batch (default: %(default)s)")
    p.add_argument("--predictor", default="noise:0.55", metavar="SPEC",
                   help="the predictions the calibrated simulator plans with when it finds R: noise:ACC | gauss:SIGMA | "
                        "oracle (default: %(default)s)")
    p.add_argument("--calibration-requests", type=int, default=64, help="the calibration burst (default: %(default)s)")
    p.add_argument("--step-profile", metavar="CSV",
                   help="skip the calibration burst and fit an earlier one's step profile: step_profile.csv in a "
                        "fleet, soak or overload bench's work directory (its JSON names it, calibration.profile_csv), "
                        "measured on this machine with the same --shape and number of engines")
    p.add_argument("--seed", type=int, default=0)


def add_overload_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        "overload", help="goodput past saturation with the gateway's outstanding bound and without it, on real engines",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Calibrate two vLLM-CPU engines as `bench fleet` does, take the saturation rate R, and replay the same "
                    "ShareGPT trace at each multiple of R through a gateway with its outstanding bound (429 past it) and "
                    "through one without. Per run: offered rate, accepted, 429s, other errors, goodput (requests within "
                    "their TTFT and ATGT targets per second), attainment among the accepted, their TTFT p50/p99, the "
                    "slowest 429. Prints a table, writes JSON and a PNG.",
        epilog=OVERLOAD_EPILOG)
    p.add_argument("--multiples", type=comma_list(float, "0.5,1,2"), default=[0.5, 1.0, 1.5, 2.0, 3.0], metavar="M,M,...",
                   help="rates as multiples of R (default: 0.5,1,1.5,2,3)")
    p.add_argument("--placement", default="jsq", help="the gateways' placement (default: %(default)s)")
    p.add_argument("--arms", type=comma_list(str, "bounded,learnt,unbounded"), default=["bounded", "unbounded"],
                   metavar="ARM,...", help="the gateways compared at each rate: bounded (the fixed bound), learnt (the "
                   "same bound as a ceiling, each engine's own learnt from the SLO: --engine-bound slo; a fresh gateway "
                   "each run, as every arm), learnt-at-end (the same, each answer judged at its end: "
                   "--engine-bound-checkpoint 0), learnt-kept (the same, one gateway through the whole sweep, so each run "
                   "starts from the bounds the runs before left), unbounded (default: bounded,unbounded)")
    p.add_argument("--max-outstanding", type=int, metavar="N", help="the bounded gateway's bound on requests in flight "
                   "(default: the gateway's own, --max-outstanding-per-engine x engines)")
    p.add_argument("--max-outstanding-per-engine", type=int, metavar="N",
                   help="the bounded gateway's bound per engine (default: the gateway's own, 2 x --max-num-seqs)")
    _fleet_args(p, 60, 8, "requests per run, the same trace in every run",
                "--max-requests: a shorter probe ends before the queues a run builds, and overstates R")
    p.add_argument("--json", default="bench-results/overload/bench_overload.json", help="(default: %(default)s; the PNG "
                   "beside it)")
    p.set_defaults(func=run_overload_cli)
    return p


def add_soak_parser(bench_sub) -> argparse.ArgumentParser:
    p = bench_sub.add_parser(
        "soak", help="gateway, engines and the real sidecar under steady load: memory, fds, errors and latency over time",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start two vLLM-CPU engines (calibrated as `bench fleet` does), the prediction sidecar with a "
                    "registered predictor and a gateway that predicts through it, all on loopback; send a real "
                    "ShareGPT trace (cycled, Poisson arrivals) at --load x the saturation rate R (measured first) for --duration "
                    "seconds. Every --sample-interval seconds record each process's RSS and open fds, and per window the "
                    "requests sent, completed, errors by kind and TTFT/JCT p50/p99. Prints a table, writes JSON and a PNG.",
        epilog=SOAK_EPILOG)
    p.add_argument("--duration", type=float, default=600.0, metavar="S", help="seconds of arrivals (default: %(default)s)")
    p.add_argument("--load", type=float, default=0.8, help="share of the calibrated saturation rate (default: %(default)s)")
    p.add_argument("--sample-interval", type=float, default=5.0, metavar="S",
                   help="seconds between samples, and the width of a window (default: %(default)s)")
    p.add_argument("--model", default="models:/length-predictor@champion", metavar="URI",
                   help="the sidecar's predictor: models:/NAME@ALIAS, models:/NAME/VERSION or a package directory "
                        "(default: %(default)s)")
    p.add_argument("--placement", default="lengthwise", help="the gateway's placement (default: %(default)s)")
    p.add_argument("--predictor-timeout-ms", type=float, metavar="MS",
                   help="the gateway's prediction timeout, past which a request runs on the fallback length (default: "
                        "the gateway's own); the JSON counts the fallbacks either way")
    _fleet_args(p, 160, 64, "distinct prompts of the trace, cycled")
    p.add_argument("--json", default="bench-results/soak/bench_soak.json", help="(default: %(default)s; the PNG beside it)")
    p.set_defaults(func=run_soak_cli)
    return p


def _fleet_config(a: argparse.Namespace, placements: list[str]):
    """The fleet's settings from the shared flags (pydantic checks the ranges), and the trace checked to fit."""
    from serving.bench.fleet import FleetBenchConfig, check_step_profile, profile_settings
    from serving.bench.load.run import prepared
    from serving.launch.models import bench_dtype
    from serving.placement import make_placement
    from serving.placement.limits import Limits
    from serving.sim.predictions import make_predictor

    for name in placements:
        make_placement(name, Limits(kv_tokens=1024))
    if a.predictor.startswith("models:"):
        raise ValueError("--predictor names the simulator's predictions (noise:ACC, gauss:SIGMA or oracle)")
    make_predictor(a.predictor)
    if a.rate is not None and not a.rate > 0:
        raise ValueError(f"--rate must be positive, got {a.rate:g}")
    cfg = FleetBenchConfig(placements=placements, max_requests=a.max_requests, rate=a.rate, kv_blocks=a.kv_blocks,
                           shape=a.shape, max_num_seqs=a.max_num_seqs, predictor=a.predictor,
                           calibration_requests=a.calibration_requests, step_profile=a.step_profile, seed=a.seed)
    prepared(cfg)  # a trace that does not fit fails now
    if cfg.step_profile is not None:  # a profile of other settings fails now, not after the engines started
        check_step_profile(cfg.step_profile, profile_settings(cfg, bench_dtype()))
    return cfg


def _run(a: argparse.Namespace, build, run) -> int:
    """Check (exit 2 on bad input, one line), then run (exit 1 when a process failed, with its reason)."""
    from pydantic import ValidationError
    from rich.console import Console

    from serving.bench.engine.bench import EngineBenchError
    from serving.launch.engines import EngineStartError
    from serving.placement import PlacementError
    from serving.sim.predictions import PredictorSpecError
    from serving.sim.workload import WorkloadError

    try:
        cfg = build(a)
    except ValidationError as exc:
        e = exc.errors()[0]
        loc = str(e["loc"][-1]) if e["loc"] else "input"
        print(f"lengthwise: error: --{loc.replace('_', '-').removesuffix('-s')}: {e['msg']}", file=sys.stderr)
        return 2
    except (PlacementError, PredictorSpecError, WorkloadError, ValueError, FileNotFoundError) as exc:
        print(f"lengthwise: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    try:
        run(cfg, Path(a.json), Console())
        return 0
    except (EngineStartError, EngineBenchError, RuntimeError, ValueError) as exc:
        print(f"lengthwise: error: {exc}", file=sys.stderr)
        return 1


def _overload_config(a: argparse.Namespace):
    from serving.bench.load.overload import ARMS, OverloadConfig

    bad = [m for m in a.multiples if not m > 0]
    if bad:
        raise ValueError(f"--multiples must be positive, got {bad[0]:g}")
    unknown = [x for x in a.arms if x not in ARMS]
    if unknown:
        raise ValueError(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(ARMS)}")
    for flag, value in (("--max-outstanding", a.max_outstanding), ("--max-outstanding-per-engine", a.max_outstanding_per_engine)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    return OverloadConfig(multiples=sorted(set(a.multiples)), placement=a.placement, arms=list(dict.fromkeys(a.arms)),
                          max_outstanding=a.max_outstanding,
                          max_outstanding_per_engine=a.max_outstanding_per_engine, rate_from=a.rate_from,
                          probe_requests=a.max_requests if a.probe_requests is None else a.probe_requests,
                          fleet=_fleet_config(a, [a.placement]))


def _soak_config(a: argparse.Namespace):
    from serving.bench.load.soak import SoakConfig, registered

    if not a.duration > 0:
        raise ValueError(f"--duration must be positive, got {a.duration:g}")
    if not a.load > 0:
        raise ValueError(f"--load must be positive, got {a.load:g}")
    if not 0 < a.sample_interval <= a.duration:
        raise ValueError(f"--sample-interval must be positive and at most --duration, got {a.sample_interval:g}")
    fleet = _fleet_config(a, [a.placement])
    registered(a.model)  # last: it loads MLflow
    return SoakConfig(duration_s=a.duration, load=a.load, sample_interval_s=a.sample_interval, model=a.model,
                      placement=a.placement, predictor_timeout_ms=a.predictor_timeout_ms, rate_from=a.rate_from,
                      probe_requests=40 if a.probe_requests is None else a.probe_requests, fleet=fleet)


def run_overload_cli(a: argparse.Namespace) -> int:
    from serving.bench.load.overload import run_overload_bench

    return _run(a, _overload_config, run_overload_bench)


def run_soak_cli(a: argparse.Namespace) -> int:
    from serving.bench.load.soak import run_soak_bench

    return _run(a, _soak_config, run_soak_bench)
