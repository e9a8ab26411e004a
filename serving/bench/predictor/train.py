"""``lengthwise bench predictor``: train on real ShareGPT data, report quality vs baselines, and time
ONNX inference per prompt at batch 1 and 32 on this machine. Prints a table and writes JSON."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np

from predictor.common import default_sharegpt, default_tokenizer
from training.config import TrainConfig


def onnx_latency(predictor, prompts: list[str], batch_sizes=(1, 32), repeats: int = 3) -> dict:
    """Wall time per prompt (tokenisation included) of ``predictor.predict`` at each batch size."""
    out = {}
    for bs in batch_sizes:
        predictor.predict(prompts[:bs])  # warm-up
        per_call = []
        for r in range(repeats):
            for s in range(0, min(len(prompts), 256), bs):
                chunk = prompts[s : s + bs]
                if len(chunk) < bs:
                    break
                t = time.perf_counter()
                predictor.predict(chunk)
                per_call.append(time.perf_counter() - t)
        arr = np.array(per_call)
        out[str(bs)] = {"calls": len(per_call), "p50_ms_per_call": float(np.median(arr) * 1e3),
                        "p99_ms_per_call": float(np.quantile(arr, 0.99) * 1e3),
                        "ms_per_prompt": float(arr.mean() / bs * 1e3), "prompts_per_s": float(bs / arr.mean())}
    return out


def run_bench(json_path: str | None, max_samples: int, epochs: int, work_dir: str | None, base_model: str | None,
              max_prompt_tokens: int, bucket_width: int, first_turn_only: bool, threads: int | None) -> dict:
    from predictor.runtime import OnnxLengthPredictor
    from training.pipeline import run
    from training.report import print_report

    work = Path(work_dir) if work_dir else Path("bench-results") / "predictor"
    cfg = TrainConfig(
        data=str(default_sharegpt()), fmt="sharegpt", tokenizer=str(default_tokenizer()), bucket_width=bucket_width,
        max_samples=max_samples, epochs=epochs, base_model=base_model, max_prompt_tokens=max_prompt_tokens,
        first_turn_only=first_turn_only, experiment="bench-predictor", register="length-predictor", alias="challenger",
        promote=True, work_dir=str(work),
    )
    report = run(cfg)
    print_report(report)
    from training.data import load_examples

    prompts = [e.latest for e in load_examples(cfg.data, "sharegpt", first_turn_only=True)[-512:]]
    pred = OnnxLengthPredictor(work / "package", threads=threads)
    report["onnx_latency"] = onnx_latency(pred, prompts)
    for bs, v in report["onnx_latency"].items():
        print(f"ONNX batch {bs:>2}: {v['ms_per_prompt']:.2f} ms/prompt, p50 {v['p50_ms_per_call']:.1f} ms/call, "
              f"p99 {v['p99_ms_per_call']:.1f} ms/call, {v['prompts_per_s']:.0f} prompts/s")
    if report.get("epoch_seconds"):
        report["epoch_seconds_median"] = statistics.median(report["epoch_seconds"])
    out = Path(json_path) if json_path else work / "bench_predictor.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=float))
    print(f"wrote {out}")
    return report
