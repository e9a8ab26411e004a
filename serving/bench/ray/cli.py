"""``lengthwise bench ray``'s command line (see :mod:`serving.bench.ray.bench`); nothing heavy is imported until
it runs, so ``lengthwise --help`` stays quick."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ARM_NAMES = "http,ray-power-of-two,ray-lengthwise"  # raybench.ARMS, spelled out so that --help imports nothing heavy


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """``lengthwise bench ray``'s flags (nothing heavy imported before it runs)."""
    p = bench_sub.add_parser(
        "ray", help="the same trace through the HTTP gateway, Ray Serve's default router and LengthwiseRequestRouter",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Replay the same ShareGPT trace, at the same rate and with the same predictions, through (http) the "
                    "HTTP gateway over two vLLM engine processes, (ray-power-of-two) the Ray Serve application with Ray's "
                    "default router, and (ray-lengthwise) the Ray Serve application with LengthwiseRequestRouter. The "
                    "engines, the exact-length requests, the calibration and the replay are `bench fleet`'s. Per arm: "
                    "SLO attainment, JCT p50/p99, requests per replica, lost or wrong-length requests, and the Ray "
                    "router's time per decision (its own counters). JSON, table and PNG.",
        epilog="examples:\n  lengthwise bench ray --max-requests 60\n"
               "  lengthwise bench ray --arms ray-power-of-two,ray-lengthwise --no-calibrate --rate 1 --max-requests 8\n\n"
               "On a 2-core machine: each Ray arm starts its engine replicas afresh (minutes each, longer on a busy "
               "machine), the two engines share the two cores with the gateway, the Ray processes and the client, "
               "and the replay is real time (requests / rate seconds); keep --max-requests to a few dozen and the rate "
               "low, and read differences between arms as indicative only. The measurement belongs on a machine with a "
               "core per engine and more for Ray's own processes.")
    p.add_argument("--arms", default=ARM_NAMES, help=f"comma-separated, of {ARM_NAMES} (default: all)")
    p.add_argument("--placement", default="lengthwise", help="the gateway's placement and the Ray router's policy "
                                                            "(default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=60, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, metavar="N", help="every request's max_tokens (default: as bench fleet)")
    p.add_argument("--rate", type=float, help="req/s (default: the calibrated simulator's 90%% point for JSQ)")
    p.add_argument("--no-calibrate", action="store_true", help="skip the calibration burst: the gateway's default SLO "
                                                                "terms; needs --rate")
    p.add_argument("--kv-blocks", type=int, default=160, help="KV blocks of 32 tokens per engine (default: %(default)s)")
    p.add_argument("--shape", default="tiny", help="the dummy model's shape (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--predictor", default="noise:0.55", metavar="SPEC", help="noise:ACC | gauss:SIGMA | oracle "
                                                                             "(default: %(default)s)")
    p.add_argument("--calibration-requests", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench-results/placement/bench_ray.json", help="(default: %(default)s)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(a: argparse.Namespace) -> int:
    from pydantic import ValidationError
    from rich.console import Console

    from serving.bench.ray.bench import ARMS, RayBenchConfig, run_ray_bench
    from serving.placement import PlacementError, make_placement
    from serving.placement.limits import Limits
    from serving.sim.predictions import PredictorSpecError, make_predictor

    try:
        import ray  # noqa: F401 - the Ray arms need it; say so before anything starts
    except ImportError:
        if any(arm.startswith("ray") for arm in a.arms.split(",")):
            print("lengthwise bench ray: error: Ray is not installed here; install the ray extra (pip install -e '.[ray]')",
                  file=sys.stderr)
            return 2
    try:
        make_placement(a.placement, Limits(kv_tokens=1024))
        make_predictor(a.predictor, seed=a.seed)
        cfg = RayBenchConfig(arms=[s.strip() for s in a.arms.split(",") if s.strip()], placement=a.placement,
                             calibrate=not a.no_calibrate, max_requests=a.max_requests, max_tokens=a.max_tokens, rate=a.rate,
                             kv_blocks=a.kv_blocks, shape=a.shape, max_num_seqs=a.max_num_seqs, predictor=a.predictor,
                             calibration_requests=a.calibration_requests, seed=a.seed)
        bad = [x for x in cfg.arms if x not in ARMS]
        if bad or not cfg.arms:
            raise ValueError(f"--arms: unknown arm(s) {', '.join(bad) or '(none)'}; choose from {', '.join(ARMS)}")
        if not cfg.calibrate and cfg.rate is None:
            raise ValueError("--no-calibrate needs --rate (the default rate is the calibrated simulator's)")
    except ValidationError as exc:
        err = exc.errors()[0]
        print(f"lengthwise bench ray: error: {'.'.join(map(str, err['loc']))}: {err['msg']}", file=sys.stderr)
        return 2
    except (ValueError, PlacementError, PredictorSpecError) as exc:
        print(f"lengthwise bench ray: error: {exc}", file=sys.stderr)
        return 2
    run_ray_bench(cfg, Path(a.json), Console())
    return 0
