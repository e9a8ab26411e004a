"""Named settings of ``lengthwise bench engine``: the GPU experiment, and its CPU smoke on the very same path.

``h200-llama8b`` is EcoServe's KV-bound setting (EcoServe §4: 12 GB of KV cache beside OPT-13B, i.e. about 14.6k
tokens) carried to a Llama-3-8B-shaped engine on one GPU: random weights, a KV pool of 458 blocks of 32 tokens
(14,656 tokens), ShareGPT first turns counted in Llama-3 tokens, every request ended at its true length by the
bench's logits processor, engines one after another with async scheduling on for stock vLLM and the plug-in alike,
and vLLM's default compiled model with CUDA graphs (an eager engine measured about 28 ms a step there, host-bound).
Its plan (:mod:`serving.bench.engine.plan`), in order of value: at 1.5 times stock's simulated 90%-SLO knee, then at
the knee, on seeds 1, 2 and 0: stock; stock again in a second process (the noise between two stock runs); ``lengthwise``
with a trained predictor's own predictions (:data:`GPU_PREDICTIONS`: the LoRA encoder trained on ChatGPT's answers in
Llama-3 tokens, the run's prompts held out); ``sarathi`` (the strongest prediction-free policy); the posterior policy;
then ``lengthwise`` with synthetic noise ranking the trace as well as the SmolLM2-trained predictor ranks SmolLM2's
lengths (Kendall tau 0.372), and the oracle, last. What fits ``budget_s`` runs; the GPU script sets it from its time.

``cpu-smoke`` runs the same code path (sequential engines, a plan of seeds, stock again and a budget, the same arms
with the tau-matched noise as main predictor: its trace is not the one the predictions file was made for) with a
two-layer model and a few dozen requests, so that the GPU run's path is tested on every CPU build.

The GPU machine has no ``$LENGTHWISE_DATA``: its workload travels as a length-only CSV (``num_prefill_tokens,
num_decode_tokens``) that :func:`write_length_workload` writes from the ShareGPT file here, and its predictions as the
committed file :mod:`serving.bench.gpu.predictions` made.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

TRAINED_TAU = 0.372
"""Kendall tau of the trained predictor (pre-trained on ChatGPT's answers, then SmolLM2's) on 726 held-out SmolLM2
samples: the noise arm is made to rank the trace as well as that."""
GPU_WORKLOAD = Path(__file__).resolve().parents[3] / ".gpu-pack" / "sharegpt-first-turns.llama3.csv"
"""Where ``make gpu-pack`` writes the workload: inside the repository, so that it travels with the tree."""
LLAMA3_TOKENIZER = "tokenizers/llama3/tokenizer.model"
GPU_PREDICTIONS = (Path(__file__).resolve().parents[3] / "docs" / "results" / "gpu"
                   / "sharegpt_first_turns_llama3_predictions.json")
"""The trained predictor's predictions for the GPU workload's first 1,000 rows (committed: the run's input, and what
its predictions arm is scored with)."""

PRESETS: dict[str, dict[str, Any]] = {
    "h200-llama8b": {
        "shape": "llama3-8b", "kv_blocks": 458, "max_model_len": 2048,
        "max_num_batched_tokens": 2048, "max_num_seqs": 256, "workload": str(GPU_WORKLOAD),
        "predictor": f"given:{GPU_PREDICTIONS}", "ablation": ["sarathi", "lengthwise-posterior"],
        "compare_predictors": [f"noise-tau:{TRAINED_TAU}", "oracle"], "rate_factors": [1.5, 1.0], "seed": 1,
        "seeds": [1, 2, 0], "stock_again": True, "budget_s": 510.0, "swap_cores": False, "sequential": True,
        "async_scheduling": True, "gpu_memory_utilization": 0.3, "max_requests": 300, "calibration_requests": 96,
        "cuda_graphs": True,
    },
    "cpu-smoke": {
        "shape": "micro", "kv_blocks": 40, "max_model_len": 1024,
        "max_num_batched_tokens": 1024, "max_num_seqs": 64, "predictor": f"noise-tau:{TRAINED_TAU}",
        "ablation": ["sarathi"], "compare_predictors": ["oracle"], "rate_factors": [1.5, 1.0], "seed": 1,
        "seeds": [1, 2], "stock_again": True, "swap_cores": False, "sequential": True, "max_requests": 24,
        "calibration_requests": 16, "engine_start_s": 15.0,
    },
}


def write_length_workload(path: Path, n: int = 1000, max_model_len: int = 2048) -> Path:
    """The first ``n`` ShareGPT first turns that fit ``max_model_len``, their prompt and answer counted in Llama-3
    tokens, as a length-only CSV (no text travels: the bench's prompts are token ids)."""
    from serving.sim.scenarios import SHAREGPT, data_path
    from serving.sim.workload import load_workload

    wl = load_workload(data_path(SHAREGPT), arrival="poisson", rate=1.0, max_requests=n,
                       tokenizer=str(data_path(LLAMA3_TOKENIZER)), max_prompt_tokens=max_model_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [f"{r.prompt_tokens},{r.output_tokens}" for r in wl.requests]
    path.write_text("num_prefill_tokens,num_decode_tokens\n" + "\n".join(rows) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.engine.presets",
                                 description="Write the GPU preset's length-only workload (ShareGPT first turns in "
                                             "Llama-3 tokens) from $LENGTHWISE_DATA.")
    ap.add_argument("--out", type=Path, default=GPU_WORKLOAD, help="CSV to write (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=1000, help="rows (default: %(default)s)")
    a = ap.parse_args(argv)
    p = write_length_workload(a.out, a.requests)
    print(f"wrote {p} ({a.requests} requests at most)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
