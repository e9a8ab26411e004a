"""``lengthwise relabel-ceiling FILE...``: how well could any predictor rank the served model's lengths? Measured on
prompts with K samples or more (relabel files of one model, sampling and cap, drawn with different seeds: say the
committed labels' two samples and two more of the held-out prompts, ``lengthwise relabel --split test --seed 1``).

A sampled answer's length is the prompt's own mean plus sampling noise, so against single samples no predictor can
rank perfectly. With K samples per prompt this measures, over the prompts:

- **between samples**: Kendall tau of one sample against another of the same prompt (every pair of the K), the
  served model's own noise;
- **the mean of m others**: tau of the mean of m of a prompt's other samples against a held-out one, m = 1 ... K-1 (every
  choice of held-out sample and of the m); a predictor that knew m draws of the model's answer. The mean of all
  samples would be the best predictor of one; with K-1 others it is measured, not modelled;
- **the noise model**: if lengths are the prompt's mean plus independent noise, two samples correlate by rho (the
  mean's share of the variance) and the mean of m others correlates with a held-out sample by
  rho / sqrt(rho + (1 - rho) / m); through the Gaussian link r = sin(pi tau / 2) (Greiner) the between-sample tau
  predicts the tau of each m, and the limit m -> infinity, sqrt(rho), is the ceiling. The measured m = 2 ... K-1
  check the model before its limit is believed;
- with ``--data`` (the prompt set the labels were drawn from): train-predictor's TF-IDF baseline fitted on the first
  file's training split, scored on these prompts against single samples and against each prompt's mean of K, beside
  the figures above. Only prompts of its test split are scored (none it trained on).

Each figure has a 95% bootstrap interval over prompts, per slice (first turns, later turns).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np


def pool(paths: list[Path]) -> tuple[dict[str, list[int]], dict[str, bool], dict[str, Any]]:
    """The samples of every file, per prompt hash, in file then sample order; each prompt's first-turn flag; the set-up.
    ValueError when the files label different set-ups or repeat a draw (the same sample seed in two files)."""
    from training.data.served import read_served

    lengths: dict[str, list[int]] = {}
    first: dict[str, bool] = {}
    seeds: set[tuple[str, int]] = set()
    setup = None
    for path in paths:
        records = sorted(read_served(path)[0], key=lambda r: (r["prompt_hash"], r["sample"]))
        if not records:
            raise ValueError(f"{path} holds no labels")
        for r in records:
            this = {"model": r.get("model"), "sampling": r.get("sampling"), "max_tokens": r.get("max_tokens")}
            if setup is None:
                setup = this
            elif this != setup:
                raise ValueError(f"{path} labels another set-up than {paths[0]}: {this} vs {setup}")
            draw = (r["prompt_hash"], int(r.get("seed", -1)))
            if draw[1] >= 0 and draw in seeds:
                raise ValueError(f"{path} repeats a draw of another file (prompt {r['prompt_hash'][:12]}, seed "
                                 f"{draw[1]}): relabel the extra samples with another --seed")
            seeds.add(draw)
            lengths.setdefault(r["prompt_hash"], []).append(int(r["response_tokens"]))
            first[r["prompt_hash"]] = bool(r.get("first_turn", r.get("turn", 0) == 0))
    return lengths, first, setup or {}


def model_tau(tau_between: float, m: float) -> float:
    """The noise model's tau of the mean of ``m`` samples against another sample (``m`` = inf: the prompt's mean)."""
    rho = max(math.sin(math.pi * tau_between / 2), 0.0)
    r = math.sqrt(rho) if math.isinf(m) else rho / math.sqrt(rho + (1 - rho) / m) if rho > 0 else 0.0
    return 2 / math.pi * math.asin(min(r, 1.0))


def _taus(x: np.ndarray, pred: dict[str, np.ndarray] | None) -> dict[str, float]:
    """Every figure of the module docstring on the sample matrix ``x`` [prompts, K] (and predictions, if any)."""
    from training.evaluate import kendall_tau

    k = x.shape[1]
    out = {"between": float(np.mean([kendall_tau(x[:, i], x[:, j]) for i, j in itertools.combinations(range(k), 2)]))}
    for m in range(2, k):
        out[f"mean_of_{m}"] = float(np.mean([kendall_tau(x[:, list(s)].mean(1), x[:, held]) for held in range(k)
                                             for s in itertools.combinations([i for i in range(k) if i != held], m)]))
    mean = x.mean(1)
    for name, p in (pred or {}).items():
        out[f"{name}_vs_sample"] = float(np.mean([kendall_tau(p, x[:, i]) for i in range(k)]))
        out[f"{name}_vs_mean"] = kendall_tau(p, mean)
    return out


def ceiling(x: np.ndarray, first: np.ndarray, pred: dict[str, np.ndarray] | None = None, boot: int = 500,
            seed: int = 0) -> dict[str, Any]:
    """Per slice: each figure, its 95% bootstrap interval over prompts, and the noise model's taus from the
    between-sample tau (for m = 1 ... K-1 and the limit)."""
    rng = np.random.default_rng(seed)
    k = x.shape[1]
    out: dict[str, Any] = {}
    for name, mask in (("all", np.ones(len(x), dtype=bool)), ("first_turn", first), ("later_turns", ~first)):
        if mask.sum() < 10:
            continue
        xs, ps = x[mask], {n: p[mask] for n, p in (pred or {}).items()}
        point = _taus(xs, ps)
        draws = []
        for _ in range(boot):
            i = rng.integers(0, len(xs), len(xs))
            draws.append(_taus(xs[i], {n: p[i] for n, p in ps.items()}))
        interval = {f: [float(np.percentile([d[f] for d in draws], 2.5)), float(np.percentile([d[f] for d in draws], 97.5))]
                    for f in point}
        model = {f"mean_of_{m}": model_tau(point["between"], m) for m in range(1, k)} | {
            "prompt_mean": model_tau(point["between"], math.inf)}
        out[name] = {"prompts": int(mask.sum()), "measured": point, "interval95": interval, "noise_model": model}
    return out


def tfidf_predictions(data: str, fmt: str, served: Path, max_tokens: int, hashes: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """train-predictor's TF-IDF baseline fitted per slice on ``served``'s training split (as ``train-predictor --data DATA
    --served-lengths SERVED --max-tokens N`` fits it), its expected length for each of ``hashes`` in the test split;
    returns (predictions, mask of the hashes it could score: those in its test split)."""
    from training.baselines import TfidfLogReg, exact_labelled, fit_sliced, rows_of
    from training.config import TrainConfig
    from training.data.served import prompt_hash
    from training.pipeline import prepare

    prep = prepare(TrainConfig(data=data, fmt=fmt, served_lengths=str(served), max_tokens=max_tokens))
    s = prep.splits

    def rows(part):
        return rows_of(part, prep.counter.count(["\n".join(t.text for t in e.turns) for e in part]))

    test = list({prompt_hash(e.turns): e for e in s.test}.items())  # one row per prompt: the prediction is per prompt
    train = exact_labelled(s.train, prep.scheme)  # as train-predictor fits it
    pred, _ = fit_sliced(TfidfLogReg, prep.scheme, rows(train), rows(s.val), rows([e for _, e in test]))
    by_hash = dict(zip([h for h, _ in test], pred.point))
    mask = np.array([h in by_hash for h in hashes])
    return np.array([by_hash.get(h, np.nan) for h in hashes]), mask


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("relabel-ceiling", help="how well any predictor could rank the served model's lengths, measured "
                       "with K samples per prompt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", type=Path, nargs="+", metavar="FILE", help="relabel files (.jsonl or .jsonl.xz) of one "
                   "model, sampling and cap, with different seeds; their samples are pooled per prompt")
    p.add_argument("--samples", type=int, default=4, metavar="K",
                   help="use the prompts with at least K samples, their first K (default: %(default)s)")
    p.add_argument("--data", metavar="FILE", help="the prompt set the labels come from: also score train-predictor's "
                   "TF-IDF baseline (fitted on the first file's training split) on these prompts")
    p.add_argument("--format", dest="fmt", default="sharegpt", help="of --data (default: %(default)s)")
    p.add_argument("--bootstrap", type=int, default=500, metavar="N", help="resamples for the intervals (default: %(default)s)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the numbers here too")
    p.set_defaults(func=run)
    return p


def _label(figure: str, k: int) -> str:
    """What a figure of :func:`_taus` ranks one sample with, in words."""
    if figure == "between":
        return "another sample of the prompt"
    if figure.startswith("mean_of_"):
        m = figure.rsplit("_", 1)[1]
        return f"the mean of {m} other sample{'s' if m != '1' else ''}"
    if figure == "prompt_mean":
        return "the prompt's mean (the ceiling)"
    name, _, against = figure.partition("_vs_")
    return f"{name} (vs one sample)" if against == "sample" else f"{name} (vs the mean of {k})"


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    k, slices = res["samples"], res["slices"]
    t = Table(title=f"ranking the served model's lengths: {res['prompts']} prompts x {k} samples "
                    f"({res['setup'].get('model')})", title_justify="left")
    t.add_column("Kendall tau against one sample")
    for name, s in slices.items():
        t.add_column(f"{name} ({s['prompts']})", justify="right")
    for f in slices["all"]["measured"]:
        t.add_row(_label(f, k), *[f"{s['measured'][f]:.3f} [{s['interval95'][f][0]:.3f}, {s['interval95'][f][1]:.3f}]"
                                  for s in slices.values()])
    for f in slices["all"]["noise_model"]:
        t.add_row(f"noise model: {_label(f, k)}", *[f"{s['noise_model'][f]:.3f}" for s in slices.values()])
    Console().print(t)


def run(a: argparse.Namespace) -> int:
    try:
        if a.samples < 2:
            raise ValueError(f"--samples must be at least 2, got {a.samples}")
        lengths, first_of, setup = pool(a.files)
        hashes = sorted(h for h, v in lengths.items() if len(v) >= a.samples)
        if len(hashes) < 10:
            raise ValueError(f"only {len(hashes)} prompts have {a.samples} samples in these files; need 10 or more")
        if a.data and not Path(a.data).exists():
            raise ValueError(f"--data {a.data}: no such file")
    except ValueError as exc:  # DataError is one
        print(f"lengthwise relabel-ceiling: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    pred = None
    if a.data:
        tfidf, scored = tfidf_predictions(a.data, a.fmt, a.files[0], int(setup["max_tokens"]), hashes)
        hashes = [h for h, ok in zip(hashes, scored) if ok]
        pred = {"tfidf": tfidf[scored]}
    x = np.array([lengths[h][:a.samples] for h in hashes], dtype=np.float64)
    first = np.array([first_of[h] for h in hashes], dtype=bool)
    res = {"files": [str(f) for f in a.files], "setup": setup, "prompts": len(hashes), "samples": a.samples,
           "slices": ceiling(x, first, pred, a.bootstrap)}
    _print(res)
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0
