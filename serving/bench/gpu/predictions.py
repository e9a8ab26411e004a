"""A trained predictor's own predictions for the GPU run's prompts, made here and carried as a file.

The GPU machine has no prompt text and no predictor: its workload is a length-only CSV (ShareGPT first turns, their
answers counted in Llama-3 tokens). Those answers are ChatGPT's, so the honest predictor for them is the one trained on
ChatGPT's lengths, not the served SmolLM2's. This module

1. takes the workload's requests (the same selection :func:`serving.bench.engine.presets.write_length_workload` makes),
2. writes a training set of every other ShareGPT first turn (a prompt that appears among the workload's is dropped
   wherever it occurs, so no run prompt or its duplicate is trained on),
3. runs ``train-predictor`` on it (ChatGPT's answers in Llama-3 tokens; the LoRA encoder, ONNX export, no registry),
4. predicts the workload's prompts with the exported package and writes each request's bucket distribution as JSON,
   with the predictor's Kendall tau against the workload's true lengths.

The bench reads the file with ``--predictor given:PATH`` (:class:`serving.sim.predictions.GivenPredictions`), the
errors being the predictor's own, correlated with the prompt as a deployed predictor's are, unlike ``noise-tau``.

    python -m serving.bench.gpu.predictions   # writes docs/results/gpu/sharegpt_first_turns_llama3_predictions.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from serving.policy.request import Prediction

EDGES = "32,64,128,256,384,512,768,1024,1536"
"""Buckets of the ChatGPT-length predictor: doubling where most answers fall, so that short answers can be ranked
among themselves, up to the preset's 2,048-token context."""


def prediction_json(p: Prediction, truth_tokens: int) -> dict:
    """One prediction as the file stores it, with the length of the request it was made for (which the bench checks
    against its workload's, so that a file made for another workload is refused; the plug-in never sees it)."""
    return {"length": round(p.length, 2), "hi": p.hi, "bucket": p.bucket,
            "edges": list(p.edges) if p.edges else None,
            "probs": [round(x, 5) for x in p.probs] if p.probs else None, "truth_tokens": truth_tokens}


def write_training_set(requests, sharegpt: Path, path: Path) -> dict[str, int]:
    """Every ShareGPT first turn whose prompt is not one of ``requests``' first turns, as train-predictor's JSONL."""
    from training.data.loaders import load_sharegpt

    held = {r.turns[-1][1].strip() for r in requests if r.turns}
    kept = dropped = 0
    with path.open("w") as f:
        for ex in load_sharegpt(sharegpt, first_turn_only=True):
            if ex.latest.strip() in held:
                dropped += 1
                continue
            f.write(json.dumps({"id": ex.group, "prompt": ex.latest, "response": ex.response}) + "\n")
            kept += 1
    return {"training_rows": kept, "dropped_as_run_prompts": dropped}


def make(out: Path, n: int, max_samples: int, epochs: int, work: Path | None) -> dict:
    """Steps 1-4 of the module; returns what was written to ``out``."""
    import numpy as np

    from serving.bench.engine.presets import LLAMA3_TOKENIZER
    from serving.sim.predictions import make_predictor
    from serving.sim.scenarios import SHAREGPT, data_path
    from serving.sim.workload import load_workload
    from training.evaluate import kendall_tau

    tok = str(data_path(LLAMA3_TOKENIZER))
    wl = load_workload(data_path(SHAREGPT), arrival="poisson", rate=1.0, max_requests=n, tokenizer=tok,
                       max_prompt_tokens=2048)
    work = work or Path(tempfile.mkdtemp(prefix="lengthwise-gpu-predictor-"))
    work.mkdir(parents=True, exist_ok=True)
    train = work / "chatgpt-first-turns.jsonl"
    counts = write_training_set(wl.requests, data_path(SHAREGPT), train)
    print(f"training set: {counts['training_rows']} ShareGPT first turns ({counts['dropped_as_run_prompts']} dropped "
          f"as the run's prompts); work dir {work}", flush=True)
    cmd = [sys.executable, "-m", "training.cli", "--data", str(train), "--format", "jsonl", "--tokenizer", tok,
           "--edges", EDGES, "--max-tokens", "2048", "--max-samples", str(max_samples), "--epochs", str(epochs),
           "--no-register", "--work-dir", str(work / "train"), "--output-json", str(work / "metrics.json")]
    print("running: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    package = next((work / "train").rglob("model.onnx")).parent
    preds = make_predictor(str(package)).predict(wl.requests)
    truth = np.array([r.output_tokens for r in wl.requests], dtype=float)
    tau = float(kendall_tau(np.array([p.length for p in preds]), truth))
    metrics = json.loads((work / "metrics.json").read_text()) if (work / "metrics.json").exists() else {}
    doc = {
        "what": "a LoRA encoder trained on ChatGPT's ShareGPT answers in Llama-3 tokens (the run's prompts held out), "
                "predicting the GPU workload's first turns",
        "workload_rows": len(wl.requests), "kendall_tau_on_workload": tau, **counts,
        "train_command": " ".join(cmd[2:]), "test_split": metrics.get("test", metrics.get("model")),
        "predictions": {str(r.rid): prediction_json(p, r.output_tokens) for r, p in zip(wl.requests, preds)},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc))
    print(f"wrote {out}: {len(preds)} predictions, Kendall tau {tau:.3f} against the workload's Llama-3 lengths")
    return doc


def main(argv: list[str] | None = None) -> int:
    from serving.bench.engine.presets import GPU_PREDICTIONS

    ap = argparse.ArgumentParser(prog="python -m serving.bench.gpu.predictions", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=GPU_PREDICTIONS,
                    help="JSON to write (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=1000, help="workload rows, as the pack's CSV (default: %(default)s)")
    ap.add_argument("--max-samples", type=int, default=12000, help="training rows (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=2, help="training epochs (default: %(default)s)")
    ap.add_argument("--work-dir", type=Path, help="keep the training set, checkpoints and package here")
    a = ap.parse_args(argv)
    make(a.out, a.requests, a.max_samples, a.epochs, a.work_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
