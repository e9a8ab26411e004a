"""``lengthwise``: the operator's command line (benchmarks, registry; serving and simulation follow)."""

from __future__ import annotations

import argparse
import sys


def _bench_predictor(a: argparse.Namespace) -> int:
    from training.bench import run_bench
    from training.cli import quiet_libraries

    quiet_libraries(a.verbose)
    run_bench(a.json, a.max_samples or None, a.epochs, a.work_dir, a.base_model, a.max_prompt_tokens, a.bucket_width,
              a.first_turn_only, a.threads)
    return 0


def _registry(a: argparse.Namespace) -> int:
    from registry import cli as registry_cli

    return registry_cli.dispatch(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lengthwise", description="Response-length-aware LLM serving: benchmarks and registry tools.")
    sub = p.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks that print a table and write JSON")
    bsub = bench.add_subparsers(dest="bench", required=True)
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

    cv = sub.add_parser("convert-gguf", help="convert a GGUF checkpoint (e.g. SmolLM2) to a HF directory for vLLM and --base-model")
    cv.add_argument("gguf")
    cv.add_argument("out")
    cv.set_defaults(func=lambda a: __import__("predictor.convert", fromlist=["main"]).main([a.gguf, a.out]))

    from registry.cli import add_parser as add_registry

    add_registry(sub).set_defaults(func=_registry)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
