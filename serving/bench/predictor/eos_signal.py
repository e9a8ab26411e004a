"""``python -m serving.bench.predictor.eos_signal``: what the served model's own probability of ending its answer says
about how much of the answer is left.

Why measure it: a logits processor, vLLM's official per-step hook (``--logits-processors``, the hook the bench's
exact-length processor uses), sees the model's next-token distribution for every running request at every step. So the
probability the model gives its end-of-sequence token is reachable while a request runs, for one softmax entry per
request per step, with no sidecar and no text. Whether it ranks the remaining length is the question.

How: offline, on the served model's own held-out answers (``lengthwise relabel --answers``), the model is run over each
prompt and answer (transformers on the CPU). It reads p(EOS) at every position of the answer. At each ``k`` the answers
still running are ranked by the mean log p(EOS) over the last ``window`` positions before ``k``: the higher, the
sooner it ends. Kendall tau of that ranking against the true remaining length is reported with a 95% bootstrap interval
over the answers. The model's raw distribution is read at temperature 1; the answers were sampled at the served
temperature and top-p.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from serving.bench.predictor.remaining import EVAL_KS, running_at
from training.remaining import Answer, served_answers


def eos_log_probs(model_dir: Path, answers: list[Answer], progress: bool = True) -> list[np.ndarray]:
    """For each answer, log p(EOS) at each of its positions (position t: the model's probability that token t ends it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    out = []
    with torch.inference_mode():
        for i, a in enumerate(answers):
            prompt = tok.apply_chat_template([{"role": r, "content": c} for r, c in a.turns], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]
            ids = torch.tensor([list(prompt) + list(a.ids)])
            logits = model(ids).logits[0, len(prompt) - 1:-1]  # the distribution each answer token was drawn from
            out.append(torch.log_softmax(logits.float(), dim=-1)[:, eos].numpy())
            if progress and (i + 1) % 25 == 0:
                print(f"eos signal: {i + 1}/{len(answers)} answers", flush=True)
    return out


def score(answers: list[Answer], logp: list[np.ndarray], ks: tuple[int, ...] = EVAL_KS, window: int = 16,
          resamples: int = 1000, seed: int = 0) -> list[dict[str, Any]]:
    """One row per ``k``: over the answers still running there, Kendall tau of the EOS signal's ranking of the remaining
    length, with its bootstrap interval."""
    from scipy.stats import bootstrap, kendalltau

    def tau(s: np.ndarray, t: np.ndarray) -> float:
        return float(kendalltau(s, t).statistic)

    rows = []
    for k in ks:
        if (running := running_at(answers, k)) is None:
            continue
        idx, truth = running
        signal = np.array([-float(np.mean(logp[i][max(0, k - window):k])) for i in idx])  # high: far from the end
        ci = bootstrap((signal, truth), tau, paired=True, vectorized=False, n_resamples=resamples,
                       random_state=seed, method="percentile").confidence_interval
        rows.append({"k": k, "running": len(idx), "tau_eos": tau(signal, truth), "ci": [float(ci.low), float(ci.high)]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.predictor.eos_signal", description=__doc__.split("\n\n")[0])
    ap.add_argument("--served", type=Path, required=True, help="lengthwise relabel --answers output (JSONL)")
    ap.add_argument("--model-dir", type=Path, required=True, help="the served model's Hugging Face directory")
    ap.add_argument("--split", default="test", help="the train-predictor split scored (default: %(default)s)")
    ap.add_argument("--window", type=int, default=16, help="positions before k the signal averages (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the table as JSON")
    a = ap.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    from training.split import split_of

    answers = [x for x in served_answers(a.served) if split_of(x.group) == a.split]
    if not answers:
        print(f"eos_signal: no answer of {a.served} is in the {a.split} split", file=sys.stderr)
        return 2
    rows = score(answers, eos_log_probs(a.model_dir.expanduser(), answers), window=a.window)
    t = Table(title=f"the model's own p(EOS) ranking the remaining length ({len(answers)} held-out answers)")
    for col in ("k", "running", "tau", "95% CI"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["k"]), str(r["running"]), f"{r['tau_eos']:.3f}", f"[{r['ci'][0]:+.3f}, {r['ci'][1]:+.3f}]")
    Console().print(t)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"command": "python -m serving.bench.predictor.eos_signal " + " ".join(argv or sys.argv[1:]),
                                     "answers": len(answers), "window": a.window, "rows": rows}, indent=2))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
