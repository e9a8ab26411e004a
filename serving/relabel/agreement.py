"""``lengthwise relabel-agreement A B``: do two relabel files of the same model draw the same lengths?

Labels drawn by another engine (:mod:`serving.relabel.transformers_engine` on a GPU host beside vLLM on the serving CPU, say) can
only stand in for the served engine's if, on the prompts both labelled, the lengths follow one distribution and one
engine's samples rank the other's as well as they rank their own. Individual samples differ between engines as they
differ between two seeds of one engine, so the test is distributional:

- length distribution of each: mean, median, the capped share; a two-sample Kolmogorov-Smirnov test;
- Kendall tau of sample 0 against sample 1 within each file (the model's own noise), against the same tau across files
  (A's sample k against B's sample k): if the engines agree, across is as high as within;
- Kendall tau between the two files' per-prompt mean lengths.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np


def agreement(pa: dict[str, list[int]], pb: dict[str, list[int]], cap: int) -> dict[str, Any]:
    """The comparison of the module docstring on the prompts with two samples or more in both files (each a prompt
    hash -> sample lengths map, as :class:`training.data.served.ServedLabels` holds them)."""
    from scipy.stats import ks_2samp

    from training.evaluate import kendall_tau

    common = sorted(h for h in pa if h in pb and len(pa[h]) >= 2 and len(pb[h]) >= 2)
    if len(common) < 10:
        raise ValueError(f"only {len(common)} prompts have two samples in both files; need 10 or more")

    def s(p: dict, k: int) -> np.ndarray:
        return np.array([p[h][k] for h in common], dtype=float)

    def tau(x: np.ndarray, y: np.ndarray) -> float:
        return kendall_tau(x, y)

    la, lb = np.concatenate([s(pa, 0), s(pa, 1)]), np.concatenate([s(pb, 0), s(pb, 1)])
    side = {name: {"samples": len(v), "mean": float(v.mean()), "median": float(np.median(v)),
                   "capped_share": float((v >= cap).mean())} for name, v in (("a", la), ("b", lb))}
    ks = ks_2samp(la, lb)
    return {"prompts": len(common), **side, "ks_statistic": float(ks.statistic), "ks_pvalue": float(ks.pvalue),
            "tau_within_a": tau(s(pa, 0), s(pa, 1)), "tau_within_b": tau(s(pb, 0), s(pb, 1)),
            "tau_across": [tau(s(pa, 0), s(pb, 0)), tau(s(pa, 1), s(pb, 1))],
            "tau_of_means": tau((s(pa, 0) + s(pa, 1)) / 2, (s(pb, 0) + s(pb, 1)) / 2)}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("relabel-agreement", help="whether two relabel files of one model draw the same lengths",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="a relabel file (.jsonl or a committed .jsonl.xz)")
    p.add_argument("b", type=Path, help="another, of the same model and sampling")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the numbers here too")
    p.set_defaults(func=run)
    return p


def run(a: argparse.Namespace) -> int:
    from training.data.served import load_served

    try:
        la, lb = load_served(a.a), load_served(a.b)  # each refuses a file that mixes set-ups
        for path, lab in ((a.a, la), (a.b, lb)):
            if not lab.lengths:
                raise ValueError(f"{path} holds no labels")
        setups = [(lab.model, json.dumps(lab.sampling, sort_keys=True), lab.max_tokens) for lab in (la, lb)]
        if setups[0] != setups[1]:
            raise ValueError(f"the files label different settings: {setups[0]} vs {setups[1]}")
        res = agreement(la.lengths, lb.lengths, int(la.max_tokens))
    except ValueError as exc:  # DataError is one
        print(f"lengthwise relabel-agreement: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    for k, path, lab in (("a", a.a, la), ("b", a.b, lb)):
        res[k] = {"file": str(path), "engines": list(lab.engines), **res[k]}
    print(f"{res['prompts']} prompts with two samples in both files (model {la.model})")
    print(f"{'':4} {'engine':44} {'samples':>8} {'mean':>7} {'median':>7} {'capped':>7} {'tau s0-s1':>10}")
    for k in ("a", "b"):
        r = res[k]
        print(f"{k:4} {', '.join(r['engines'])[:44]:44} {r['samples']:>8} {r['mean']:>7.1f} {r['median']:>7.0f} "
              f"{r['capped_share']:>7.1%} {res['tau_within_' + k]:>10.3f}")
    print(f"across the files: tau of sample 0 {res['tau_across'][0]:.3f}, of sample 1 {res['tau_across'][1]:.3f}, "
          f"of the per-prompt means {res['tau_of_means']:.3f}; Kolmogorov-Smirnov D {res['ks_statistic']:.3f}, "
          f"p {res['ks_pvalue']:.3f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0
