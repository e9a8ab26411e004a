"""``python -m training.remaining``: a predictor of the remaining length from the prompt and the answer so far, and
how much better it ranks what is left of each answer than the prompt alone.

A prompt-only predictor is capped by the answers the prompt allows: two samples of one SmolLM2 prompt agree at Kendall
tau 0.32-0.41. Once an answer has started, its first tokens say which of them the engine is writing. This module

1. builds remaining-length examples (:mod:`predictor.partial`): for each answer and each point ``k`` of :data:`KS` it
   is still running at, the prompt and the answer's first ``k`` tokens, labelled with the tokens still to come
   (under the served cap, as the engine will stop it; an answer that reaches the cap is censored). ``k`` = 0 is the
   prompt-only question, so one model answers every ``k``. The served model's own answers (``lengthwise relabel
   --answers``) are joined by ChatGPT's ShareGPT answers counted in the served model's tokens, each row naming its
   model (``--condition-on-model``), split by conversation as train-predictor splits;
2. trains the LoRA encoder on them with ``train-predictor`` (ONNX export; registered in MLflow with ``--register``);
3. scores it on the served model's held-out answers: at each ``k``, over the answers still running there, Kendall tau
   of the predicted remaining length against the true one, beside the prompt-only prediction conditioned on the same
   ``k`` (its bucket distribution's :meth:`~serving.policy.request.Prediction.remaining_after`), with the paired 95%
   bootstrap interval of the gap.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from predictor.partial import with_answer

KS = (0, 16, 32, 64, 96, 128, 192, 256)
"""The points of an answer at which examples are made (0: the prompt alone)."""
EVAL_KS = (16, 64, 128, 192)
EDGES = "16,32,64,128,192,256,384"
CHATGPT = "ChatGPT"


@dataclass(frozen=True)
class Answer:
    """One sampled answer: its conversation, prompt turns, token ids (in the served model's tokenizer), whether it ran
    to the cap, and who wrote it."""

    group: str
    turns: tuple[tuple[str, str], ...]
    ids: tuple[int, ...]
    censored: bool
    model: str


def served_answers(path: Path) -> list[Answer]:
    """The answers of ``lengthwise relabel --answers``."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if "answer_ids" not in r:
            raise ValueError(f"{path}: a line without answer_ids: relabel with --answers")
        turns = tuple((m["role"], m["content"]) for m in r["messages"])
        out.append(Answer(str(r["group"]), turns, tuple(r["answer_ids"]), bool(r["censored"]), r["model"].split("@")[0]))
    return out


def chatgpt_answers(sharegpt: Path, tokenizer, n: int, cap: int) -> list[Answer]:
    """ChatGPT's answers to the first ``n`` ShareGPT first turns, in the served model's tokens, cut at ``cap`` as the
    served engine would cut them (an answer that reaches it is censored)."""
    from training.data.loaders import load_sharegpt

    exs = load_sharegpt(sharegpt, first_turn_only=True)[:n]
    enc = tokenizer.encode_batch([e.response or "" for e in exs], add_special_tokens=False)
    return [Answer(e.group, tuple((t.role, t.text) for t in e.turns), tuple(x.ids[:cap]), len(x.ids) >= cap, CHATGPT)
            for e, x in zip(exs, enc) if x.ids]


def example_rows(answers: list[Answer], tokenizer, ks: tuple[int, ...] = KS) -> list[dict[str, Any]]:
    """Every answer at every ``k`` it is still running at, as train-predictor's JSONL rows."""
    rows = []
    for a in answers:
        for k in ks:
            if k and k >= len(a.ids):
                break
            text = tokenizer.decode(list(a.ids[:k]), skip_special_tokens=True) if k else ""
            rows.append({"group": a.group, "messages": [{"role": r, "content": t} for r, t in with_answer(a.turns, text, k)],
                         "generated_tokens": k, "response_tokens": len(a.ids) - k, "censored": a.censored,
                         "model": a.model})
    return rows


def _predict(pred, turns_list: list[list[tuple[str, str]]], model: str):
    from predictor.conditioning import condition_turns

    if pred.conditioned_models:
        turns_list = [condition_turns(t, model) for t in turns_list]
    return pred.predict(turns_list)


def evaluate(package: Path, answers: list[Answer], tokenizer, ks: tuple[int, ...] = EVAL_KS,
             as_model: str | None = None) -> list[dict[str, Any]]:
    """Step 3 of the module on ``answers`` (held out): one row per ``k``. ``as_model``: the model a conditioned package
    is told wrote them (default: the one that did), to score how a predictor of one writer carries to another."""
    from predictor.runtime import OnnxLengthPredictor
    from serving.policy.request import Prediction
    from training.evaluate import kendall_tau, paired_gap

    pred = OnnxLengthPredictor(package)
    scheme = pred.scheme
    model = as_model or answers[0].model
    base = _predict(pred, [list(a.turns) for a in answers], model)
    edges = tuple(int(e) for e in scheme.edges[1:])
    rows = []
    for k in ks:
        idx = [i for i, a in enumerate(answers) if len(a.ids) > k]
        if len(idx) < 10:
            continue
        truth = np.array([len(answers[i].ids) - k for i in idx], dtype=float)
        prior = np.array([Prediction(1.0, edges=edges, probs=tuple(base.probs[i])).remaining_after(k) for i in idx])
        texts = [tokenizer.decode(list(answers[i].ids[:k]), skip_special_tokens=True) for i in idx]
        refined = _predict(pred, [with_answer(answers[i].turns, t, k) for i, t in zip(idx, texts)], model)
        point = np.asarray(refined.expected, dtype=float)
        gap = paired_gap(point, scheme.assign(point), prior, scheme.assign(prior), truth, scheme)
        rows.append({"k": k, "running": len(idx), "tau_refined": kendall_tau(point, truth),
                     "tau_prompt_only": kendall_tau(prior, truth), "tau_gap": gap["tau"],
                     "mae_refined": float(np.mean(np.abs(point - truth))),
                     "mae_prompt_only": float(np.mean(np.abs(prior - truth)))})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="remaining length of the answers still running at k tokens (held-out served-model answers)")
    for col in ("k", "running", "tau refined", "tau prompt-only", "gap [95% CI]", "MAE refined", "MAE prompt-only"):
        t.add_column(col, justify="right")
    for r in rows:
        g = r["tau_gap"]
        t.add_row(str(r["k"]), str(r["running"]), f"{r['tau_refined']:.3f}", f"{r['tau_prompt_only']:.3f}",
                  f"{g[0]:+.3f} [{g[1]:+.3f}, {g[2]:+.3f}]", f"{r['mae_refined']:.0f}", f"{r['mae_prompt_only']:.0f}")
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.remaining", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example:\n  python -m training.remaining --served smollm2.answers.jsonl "
                                        "--sharegpt $LENGTHWISE_DATA/prompts/sharegpt_v3_unfiltered_cleaned_split."
                                        "first15000.json.xz --model-dir ~/.cache/lengthwise/models/SmolLM2-135M-Instruct "
                                        "--out remaining.json")
    ap.add_argument("--served", type=Path, help="lengthwise relabel --answers output (JSONL)")
    ap.add_argument("--chatgpt-only", action="store_true",
                    help="no served model's answers: train and score on ChatGPT's alone (the mechanism on another "
                         "writer's answers, e.g. before a relabel with --answers has finished)")
    ap.add_argument("--sharegpt", type=Path, help="ShareGPT file whose ChatGPT answers join the training set")
    ap.add_argument("--chatgpt-prompts", type=int, default=3000, help="ChatGPT answers to use (default: %(default)s)")
    ap.add_argument("--model-dir", type=Path, required=True, help="the served model's directory (its tokenizer.json)")
    ap.add_argument("--max-tokens", type=int, default=512, help="the served cap (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--work-dir", type=Path)
    ap.add_argument("--register", metavar="NAME", help="register the model in MLflow under NAME (default: not)")
    ap.add_argument("--package", type=Path, help="score this package instead of training one")
    ap.add_argument("--as-model", metavar="NAME", help="with --package: tell a conditioned package the answers are "
                    "NAME's (e.g. ChatGPT), to score a predictor of one writer on another's answers")
    ap.add_argument("--out", type=Path, help="write the table as JSON")
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer

    from training.split import split_of

    tok = Tokenizer.from_file(str(a.model_dir.expanduser() / "tokenizer.json"))
    if a.chatgpt_only == (a.served is not None) or (a.chatgpt_only and not a.sharegpt):
        ap.error("give --served FILE, or --chatgpt-only with --sharegpt")
    served = (chatgpt_answers(a.sharegpt, tok, a.chatgpt_prompts, a.max_tokens) if a.chatgpt_only
              else served_answers(a.served))
    test = [x for x in served if split_of(x.group) == "test"]
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="lengthwise-remaining-"))
    work.mkdir(parents=True, exist_ok=True)
    package = a.package
    cmd: list[str] = []
    if package is None:
        extra = chatgpt_answers(a.sharegpt, tok, a.chatgpt_prompts, a.max_tokens) if a.sharegpt and not a.chatgpt_only else []
        answers = served + extra
        rows = example_rows(answers, tok)
        data = work / "remaining.jsonl"
        data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"{len(rows)} examples from {len(answers)} answers ({len(served)} served, {len(test)} of them held out); "
              f"work dir {work}", flush=True)
        cmd = [sys.executable, "-m", "training.cli", "--data", str(data), "--format", "jsonl", "--condition-on-model",
               "--tokenizer", str(a.model_dir.expanduser() / "tokenizer.json"), "--edges", EDGES, "--max-tokens",
               str(a.max_tokens), "--max-prompt-tokens", "256", "--max-samples", "0", "--epochs", str(a.epochs),
               "--route-slices", "off", "--work-dir", str(work / "train"), "--output-json", str(work / "metrics.json"),
               *(["--register", a.register] if a.register else ["--no-register"])]
        print("running: " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        package = next((work / "train").rglob("model.onnx")).parent
    table = evaluate(package, test, tok, as_model=a.as_model)
    print_table(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"package": str(package), "train_command": " ".join(cmd[2:]) or None,
                                     "command": "python -m training.remaining " + " ".join(argv or sys.argv[1:]),
                                     "held_out_answers": len(test), "written_by": test[0].model if test else None,
                                     "read_as": a.as_model, "rows": table}, indent=2))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
