"""``python -m serving.bench.predictor.remaining``: how much better a remaining-length predictor ranks what is left of
each answer than the prompt alone.

It trains the encoder on answers so far (:mod:`training.remaining`), or takes a package, and scores it on the served
model's held-out answers: at each ``k``, over the answers still running there, Kendall tau of the predicted remaining
length against the true one, beside the prompt-only prediction conditioned on the same ``k`` as the scheduler
conditions it (:meth:`~serving.policy.request.Prediction.remaining_after` of the same model's distribution asked with no
answer), with the paired 95% bootstrap interval of the gap. The table's JSON is what ``lengthwise bench sim --refine``
reads.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from predictor.partial import with_answer
from serving.policy.request import Prediction
from training.remaining import Answer, chatgpt_answers, served_answers, train

EVAL_KS = (16, 64, 128, 192)


def _predict(pred, turns_list: list[list[tuple[str, str]]], model: str):
    from predictor.conditioning import condition_turns

    if pred.conditioned_models:
        turns_list = [condition_turns(t, model) for t in turns_list]
    return pred.predict(turns_list)


def running_at(answers: list[Answer], k: int, least: int = 10) -> tuple[list[int], np.ndarray] | None:
    """The answers still running after ``k`` tokens (their indices) and the true tokens each has left; None when fewer
    than ``least`` are, too few to rank."""
    idx = [i for i, a in enumerate(answers) if len(a.ids) > k]
    if len(idx) < least:
        return None
    return idx, np.array([len(answers[i].ids) - k for i in idx], dtype=float)


def evaluate(package: Path, answers: list[Answer], tokenizer, ks: tuple[int, ...] = EVAL_KS,
             as_model: str | None = None) -> list[dict[str, Any]]:
    """The module's scoring on ``answers`` (held out): one row per ``k``. ``as_model``: the model a conditioned package
    is told wrote them (default: the one that did), to score how a predictor of one writer carries to another."""
    from predictor.runtime import OnnxLengthPredictor
    from training.evaluate import kendall_tau, paired_gap

    pred = OnnxLengthPredictor(package)
    scheme = pred.scheme
    model = as_model or answers[0].model
    base = _predict(pred, [list(a.turns) for a in answers], model)
    edges = tuple(int(e) for e in scheme.edges[1:])
    rows = []
    for k in ks:
        if (running := running_at(answers, k)) is None:
            continue
        idx, truth = running
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
    ap = argparse.ArgumentParser(prog="python -m serving.bench.predictor.remaining", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="example:\n  python -m serving.bench.predictor.remaining --served smollm2.answers.jsonl "
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
        print(f"{len(served)} served answers, {len(test)} of them held out", flush=True)
        package, cmd = train(served + extra, tok, a.model_dir.expanduser(), work, a.max_tokens, a.epochs, a.register)
    table = evaluate(package, test, tok, as_model=a.as_model)
    print_table(table)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"package": str(package), "train_command": " ".join(cmd) or None,
                                     "command": "python -m serving.bench.predictor.remaining " + " ".join(argv or sys.argv[1:]),
                                     "held_out_answers": len(test), "written_by": test[0].model if test else None,
                                     "read_as": a.as_model, "rows": table}, indent=2))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
