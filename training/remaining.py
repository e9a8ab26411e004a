"""Remaining-length examples and their training: a predictor of the remaining length from the prompt and the answer
so far.

A prompt-only predictor is capped by the answers the prompt allows: two samples of one SmolLM2 prompt agree at Kendall
tau 0.32-0.41. Once an answer has started, its first tokens say which of them the engine is writing. This module

1. builds remaining-length examples (:mod:`predictor.partial`): for each answer and each point ``k`` of :data:`KS` it
   is still running at, the prompt and the answer's first ``k`` tokens, labelled with the tokens still to come
   (under the served cap, as the engine will stop it; an answer that reaches the cap is censored). ``k`` = 0 is the
   prompt-only question, so one model answers every ``k``. The served model's own answers (``lengthwise relabel
   --answers``) are joined by ChatGPT's ShareGPT answers counted in the served model's tokens, each row naming its
   model (``--condition-on-model``), split by conversation as train-predictor splits;
2. trains the LoRA encoder on them with ``train-predictor`` (ONNX export; registered in MLflow with ``register``).

``python -m serving.bench.predictor.remaining`` runs both and scores the model on held-out answers against the
prompt-only prediction conditioned on the same ``k``, as the scheduler conditions it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from predictor.partial import with_answer

KS = (0, 16, 32, 64, 96, 128, 192, 256)
"""The points of an answer at which examples are made (0: the prompt alone)."""
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
    for line in path.read_text().split("\n"):  # not splitlines(): an answer may hold U+2028, which it splits at
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


def train(answers: list[Answer], tokenizer, model_dir: Path, work: Path, max_tokens: int = 512, epochs: int = 2,
          register: str | None = None) -> tuple[Path, list[str]]:
    """Step 2 on ``answers``' examples: the exported package and the train-predictor command that made it."""
    rows = example_rows(answers, tokenizer)
    data = work / "remaining.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{len(rows)} examples from {len(answers)} answers; work dir {work}", flush=True)
    cmd = [sys.executable, "-m", "training.cli", "--data", str(data), "--format", "jsonl", "--condition-on-model",
           "--tokenizer", str(model_dir / "tokenizer.json"), "--edges", EDGES, "--max-tokens", str(max_tokens),
           "--max-prompt-tokens", "256", "--max-samples", "0", "--epochs", str(epochs), "--route-slices", "off",
           "--work-dir", str(work / "train"), "--output-json", str(work / "metrics.json"),
           *(["--register", register] if register else ["--no-register"])]
    print("running: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    return next((work / "train").rglob("model.onnx")).parent, cmd[2:]
