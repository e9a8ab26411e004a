"""``lengthwise bench predictor-variants``: the Pareto table of one package's serving variants, quality beside speed.

Each row is one lever setting, scored on the same labelled test split: the graph (``fp32``, ``int8``, ``fused``,
``fused-int8``: :data:`predictor.runtime.PRECISIONS`), the input budget (prompt tokens, at most what the package was
trained with: :func:`predictor.runtime.input_budget`) and the thread layout (onnxruntime intra-op threads x inference
workers, as the sidecar's ``--threads`` and ``--workers``). Quality: top-1, within-1, Kendall tau and pairwise ranking
accuracy (:mod:`training.evaluate`, as ``train-predictor`` reports them), and parity with the package's own fp32 graph
at its trained budget (max |logit diff|, share of equal buckets). Speed, in this process: wall p50/p99 and CPU ms per
prediction at batch 1 (a lone request: one session with T threads), and predictions per second and CPU ms per
prediction at batch 32 with W workers side by side, each with its own T-thread session, tokenisation included, as the
sidecar runs a micro-batch. With ``--sidecar-levels`` each row is also measured over HTTP by ``lengthwise bench
sidecar``'s machinery (a started sidecar, closed-loop clients), with the gateway's fallback rate.

With ``--tfidf`` one more row: the cheap per-slice predictor a package can ship instead of its encoder
(:mod:`predictor.slices`: TF-IDF + logistic regression over the same buckets, with the same length hints), fitted here
on the package's own training split exactly as ``train-predictor`` fits its baseline, and served from a copy of the
package whose routing table sends every slice to it: quality, speed and (with ``--sidecar-levels``) HTTP figures measured
the same way as the encoder's rows, so the table shows what skipping the encoder gives and costs.

The test split is rebuilt the way ``train-predictor`` made it (the same data, label tokenizer, sample cap and seed;
``--served-lengths`` for labels that are the served model's own lengths), with the package's buckets; its fingerprint
is compared with the one the package recorded, so a table scored on rows the model trained on says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from predictor.common import default_sharegpt, quiet_libraries
from predictor.package_meta import META_FILE, PackageMeta, read_meta
from serving.bench.predictor.sidecar import GATEWAY_PREDICTOR_TIMEOUT_MS, PRECISIONS, BenchError, bench, parse_levels
from serving.progress import waiting

DEFAULT_BUDGETS = (32, 64, 96, 128)


@dataclass(frozen=True)
class Layout:
    """``threads`` onnxruntime intra-op threads per session, ``workers`` sessions running batches side by side."""

    threads: int
    workers: int

    @property
    def name(self) -> str:
        return f"{self.threads}x{self.workers}"


@dataclass
class LabelledTest:
    """The test split's conversations, true lengths and first-turn mask, and whether it is the package's own split."""

    turns: list[list[tuple[str, str]]]
    lengths: np.ndarray
    first_turn: np.ndarray
    fingerprint: str
    package_fingerprint: str | None
    splits: object = None  # training.split.Splits the test rows came from (train and val for the --tfidf row's fit)

    @property
    def matches_package(self) -> bool:
        return self.package_fingerprint is not None and self.fingerprint == self.package_fingerprint


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register ``bench predictor-variants`` under the ``lengthwise bench`` group."""
    p = bench_sub.add_parser(
        "predictor-variants", help="quality and CPU cost of a package's graph variants, input budgets and thread layouts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Score and time one model package's serving variants on its labelled test split: each graph (fp32, "
                    "int8, fused, fused-int8) at each input budget (prompt tokens, at most the trained budget) and thread "
                    "layout (THREADSxWORKERS, as the sidecar's --threads and --workers). Quality: top-1, within-1, "
                    "Kendall tau, pairwise ranking accuracy and parity with fp32 at the trained budget. Speed, in this "
                    "process: p50/p99 and CPU ms per lone prediction, predictions/s and CPU ms per prediction at batch 32; "
                    "with --sidecar-levels also over HTTP through a started sidecar, with the gateway's fallback rate. "
                    "Prints a table, writes JSON and a PNG (ranking quality against CPU per prediction).",
        epilog="examples:\n  lengthwise bench predictor-variants --package work/package\n"
               "  lengthwise bench predictor-variants --package work/package --precisions int8,fused-int8 --budgets 64,128 "
               "--layouts 1x2,2x1\n"
               "  lengthwise bench predictor-variants --package pkg --served-lengths smollm2.lengths.jsonl --max-tokens 1024\n"
               "  lengthwise bench predictor-variants --package pkg --sidecar-levels 1,32 --sidecar-duration 10")
    p.add_argument("--package", required=True, metavar="DIR", help="the model package (model.onnx, tokenizer.json, meta.json)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="graphs to compare (default: %(default)s)")
    p.add_argument("--budgets", help="input budgets in prompt tokens, at most the trained one (default: "
                                     f"{','.join(map(str, DEFAULT_BUDGETS))} up to the trained budget)")
    p.add_argument("--layouts", help="THREADSxWORKERS for the speed columns, e.g. 1x2,2x1 (default: Nx1,1xN with N the "
                                     "cores, at most 4)")
    p.add_argument("--tfidf", action="store_true",
                   help="add a row for the per-slice TF-IDF + logistic-regression route (what a package can ship instead "
                        "of its encoder for a slice): fitted on the package's training split as train-predictor fits it, "
                        "served from a copy of the package that routes every slice to it")
    d = p.add_argument_group("the labelled test split (as train-predictor made it; defaults from the package's meta.json)")
    d.add_argument("--data", help="the data the package was trained on (default: its recorded path, else ShareGPT)")
    d.add_argument("--format", dest="fmt", help="its format (default: the recorded one, else sharegpt)")
    d.add_argument("--tokenizer", help="the label tokenizer (default: GPT-2 from the data dir)")
    d.add_argument("--generator", help="alpaca-eval: whose answers (default: the recorded one)")
    d.add_argument("--served-lengths", metavar="FILE", help="labels from `lengthwise relabel --no-text`: the served model's "
                                                            "own lengths of these prompts")
    d.add_argument("--first-turn-only", action="store_true", help="only first turns, as train-predictor --first-turn-only")
    d.add_argument("--max-samples", type=int, default=20000, help="the training run's sample cap (default: %(default)s, "
                                                                   "train-predictor's; 0 = all)")
    d.add_argument("--seed", type=int, default=0, help="the training run's seed (default: %(default)s)")
    d.add_argument("--test-limit", type=int, default=0, metavar="N", help="score the first N test rows only (default: all)")
    s = p.add_argument_group("speed")
    s.add_argument("--speed-prompts", type=int, default=256, metavar="N",
                   help="test prompts timed per row: N lone requests and N/32 batches per worker (default: %(default)s)")
    s.add_argument("--token-budget", type=int, default=256, metavar="N",
                   help="padded tokens per onnxruntime run, as the sidecar's --token-budget (default: %(default)s, its "
                        "default)")
    s.add_argument("--sidecar-levels", help="also measure each row over HTTP at these concurrency levels, e.g. 1,32")
    s.add_argument("--sidecar-duration", type=float, default=10.0, help="measured seconds per level (default: %(default)s)")
    s.add_argument("--fallback-ms", type=float, default=GATEWAY_PREDICTOR_TIMEOUT_MS,
                   help="the gateway's prediction timeout, for the HTTP fallback rate (default: %(default)s)")
    p.add_argument("--json", help="write the report here (default: bench-results/predictor-variants/variants.json; PNG "
                                  "beside it)")
    p.set_defaults(func=run_cli)
    return p


def parse_precisions(spec: str) -> list[str]:
    names = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [n for n in names if n not in PRECISIONS]
    if not names or bad:
        raise BenchError(f"--precisions takes a comma-separated subset of {','.join(PRECISIONS)}, got {spec!r}")
    return list(dict.fromkeys(names))


def parse_budgets(spec: str | None, trained: int) -> list[int]:
    """The budgets to score: the given ones (each at most ``trained``), else the defaults up to ``trained`` and
    ``trained`` itself."""
    if spec is None:
        return sorted({b for b in DEFAULT_BUDGETS if b < trained} | {trained})
    try:
        budgets = sorted({int(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise BenchError(f"--budgets must be comma-separated integers, got {spec!r}") from None
    if not budgets or budgets[0] < 4 or budgets[-1] > trained:
        raise BenchError(f"--budgets must be between 4 and the package's trained budget of {trained} tokens, got {spec!r}")
    return budgets


def parse_layouts(spec: str | None) -> list[Layout]:
    if spec is None:
        n = max(1, min(4, os.cpu_count() or 1))
        return list(dict.fromkeys([Layout(n, 1), Layout(1, n)]))
    out = []
    for part in (x.strip().lower() for x in spec.split(",") if x.strip()):
        t, sep, w = part.partition("x")
        if not sep or not t.isdigit() or not w.isdigit() or not 1 <= int(t) <= 64 or not 1 <= int(w) <= 64:
            raise BenchError(f"--layouts takes THREADSxWORKERS pairs like 1x2,2x1, got {spec!r}")
        out.append(Layout(int(t), int(w)))
    if not out:
        raise BenchError(f"--layouts takes THREADSxWORKERS pairs like 1x2,2x1, got {spec!r}")
    return list(dict.fromkeys(out))


def split_source(meta: PackageMeta, a: argparse.Namespace) -> str:
    """The data to rebuild the test split from: --data, else what the package trained on, else the default ShareGPT."""
    recorded = meta.trained_on
    data = a.data or (recorded if recorded and Path(recorded).exists() else str(default_sharegpt()))
    if not Path(data).exists():
        raise BenchError(f"the test data {data} does not exist; pass --data")
    return data


def labelled_test(meta: PackageMeta, a: argparse.Namespace) -> LabelledTest:
    """The test split ``train-predictor`` made from the same data and settings, labelled, with the package's buckets."""
    from training.config import TrainConfig
    from training.data.labels import labels_of
    from training.pipeline import prepare

    scheme = meta.buckets
    data = split_source(meta, a)
    cfg = TrainConfig(data=data, fmt=a.fmt or meta.data_format or "sharegpt", tokenizer=a.tokenizer,
                      generator=a.generator or meta.generator, first_turn_only=a.first_turn_only,
                      served_lengths=a.served_lengths, bucket_width=None, edges=",".join(map(str, scheme.edges[1:])),
                      max_tokens=scheme.max_tokens, max_samples=a.max_samples or None, seed=a.seed)
    splits = prepare(cfg).splits
    rows = splits.test[: a.test_limit] if a.test_limit else splits.test
    return LabelledTest([[(t.role, t.text) for t in e.turns] for e in rows], labels_of(rows).astype(np.float64),
                        np.array([e.first_turn for e in rows], dtype=bool), splits.fingerprint(), meta.eval_split,
                        splits)


def tfidf_package(package: Path, test: LabelledTest, dst: Path) -> tuple[Path, dict]:
    """A copy of ``package`` (its files linked, not copied) whose routing table sends every slice to a TF-IDF +
    logistic-regression model fitted per slice on the package's training split, C chosen on its validation split:
    ``training.baselines.fit_sliced`` with ``TfidfLogReg``, what ``train-predictor`` fits and ships. Returns the copy and
    each slice's fit (C, rows)."""
    from predictor.slices import SLICES, SLICES_DIR, TFIDF
    from training.baselines import TfidfLogReg, fit_sliced, rows_of
    from training.routing import ship_routes

    scheme = read_meta(package).buckets
    splits = test.splits
    rows = {k: rows_of(getattr(splits, k), np.zeros(len(getattr(splits, k)))) for k in ("train", "val", "test")}
    fitted: dict = {}
    _, info = fit_sliced(TfidfLogReg, scheme, rows["train"], rows["val"], rows["test"], fitted=fitted)
    dst.mkdir(parents=True, exist_ok=True)
    for f in package.iterdir():
        if f.name != META_FILE and f.name != SLICES_DIR and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f.resolve())
    shutil.copyfile(package / META_FILE, dst / META_FILE)  # a copy of its own: ship_routes rewrites it
    # every slice "recommends" TF-IDF: ship_routes writes its files and table (a slice it was not fitted on stays the model's)
    ship_routes(dst, {"recommended": {part: TFIDF for part in SLICES}, "recommended_by": "bench predictor-variants --tfidf"},
                {TFIDF: fitted})
    return dst, info


def quality(probs: np.ndarray, test: LabelledTest, scheme) -> dict:
    """The offline metrics of ``train-predictor`` on the whole split and on first and later turns."""
    from training.evaluate import Predictions, compute_metrics

    out = {}
    for name, mask in (("all", np.ones(len(test.lengths), dtype=bool)), ("first_turn", test.first_turn),
                       ("later_turns", ~test.first_turn)):
        if mask.sum() >= 2:
            pred = Predictions(probs[mask], scheme.expected(probs[mask]))
            out[name] = compute_metrics(pred, test.lengths[mask], scheme)
    return out


def full_model_gap(probs: np.ndarray, ref_probs: np.ndarray, test: LabelledTest, scheme) -> dict:
    """A variant's top-1 and tau minus the full model's (fp32 at the trained budget) on the same rows, each with its
    95% paired-bootstrap interval (:func:`training.evaluate.paired_gap`): whether these rows can tell a gap of the
    agreed loss (1 point, 0.02) from none."""
    from training.evaluate import paired_gap

    return paired_gap(scheme.expected(probs), probs.argmax(1), scheme.expected(ref_probs), ref_probs.argmax(1),
                      test.lengths, scheme)


def lone_requests(pred, prompts: list) -> dict:
    """Batch 1, one after another: wall p50/p99 per prediction and process CPU per prediction."""
    pred.predict(prompts[:2])  # warm-up
    walls = []
    cpu0 = time.process_time()
    for p in prompts:
        t = time.perf_counter()
        pred.predict([p])
        walls.append(time.perf_counter() - t)
    cpu = time.process_time() - cpu0
    ms = np.array(walls) * 1e3
    return {"predictions": len(prompts), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "cpu_ms_per_prediction": cpu / len(prompts) * 1e3}


def batched(preds: list, prompts: list, batch: int = 32) -> dict:
    """Batches of ``batch`` prompts, one worker thread per predictor (its own session), all at once: predictions per
    second and process CPU per prediction, as the sidecar's workers run micro-batches."""
    chunks = [prompts[i: i + batch] for i in range(0, len(prompts) - batch + 1, batch)] or [prompts]
    for pr in preds:
        pr.predict(chunks[0][:batch])  # warm-up
    per_worker = [chunks[i:: len(preds)] or chunks[:1] for i in range(len(preds))]

    def work(i: int) -> int:
        for c in per_worker[i]:
            preds[i].predict(c)
        return sum(len(c) for c in per_worker[i])

    cpu0, t0 = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(len(preds)) as pool:
        n = sum(pool.map(work, range(len(preds))))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"predictions": n, "batch": batch, "workers": len(preds), "predictions_per_s": n / wall,
            "cpu_ms_per_prediction": cpu / n * 1e3}


def bench_variants(package: Path, precisions: list[str], budgets: list[int], layouts: list[Layout], test: LabelledTest,
                   speed_prompts: int, console, sidecar: dict | None = None, token_budget: int = 256,
                   tfidf_dir: Path | None = None) -> dict:
    """Score and time every (precision, budget, layout), and with ``tfidf_dir`` the TF-IDF route built there
    (:func:`tfidf_package`); returns the JSON report."""
    from predictor.runtime import OnnxLengthPredictor, softmax

    reference = OnnxLengthPredictor(package, threads=layouts[0].threads, precision="fp32")
    trained = reference.trained_max_tokens
    ref_ids = [e.ids for e in reference.encode(test.turns)]
    ref_logits = reference.logits_encoded(ref_ids)
    ref_probs = softmax(ref_logits.astype(np.float64))
    timed = [test.turns[i % len(test.turns)] for i in range(speed_prompts)]  # a small split is cycled through
    rows = []
    for precision in precisions:
        for budget in budgets:
            with waiting(console, f"{precision} at {budget} tokens: scoring {len(test.turns)} test prompts ..."):
                pred = OnnxLengthPredictor(package, threads=layouts[0].threads, precision=precision, max_prompt_tokens=budget)
                encoded = pred.encode(test.turns)
                logits = pred.logits_encoded([e.ids for e in encoded])
            probs = softmax(logits.astype(np.float64))
            # at the trained budget the inputs are the reference's: this is the graph's own parity, prompt by prompt
            parity = {"parity_max_abs_diff": float(np.abs(logits - ref_logits).max()),
                      "bucket_agreement": float((logits.argmax(1) == ref_logits.argmax(1)).mean())}
            base = {"precision": precision, "budget": budget, "trained_budget": trained,
                    "quality": quality(probs, test, pred.scheme), "parity": parity,
                    "vs_full": full_model_gap(probs, ref_probs, test, pred.scheme),
                    "truncated": float(np.mean([e.truncated for e in encoded])),
                    "mean_prompt_tokens": float(np.mean([len(e.ids) for e in encoded]))}
            for layout in layouts:
                with waiting(console, f"{precision} at {budget} tokens, {layout.name}: timing ..."):
                    kw = {"threads": layout.threads, "precision": precision, "max_prompt_tokens": budget,
                          "token_budget": token_budget}
                    lone = OnnxLengthPredictor(package, **kw)
                    workers = [OnnxLengthPredictor(package, **kw) for _ in range(layout.workers)]
                    row = dict(base, layout=layout.name, threads=layout.threads, workers=layout.workers,
                               batch1=lone_requests(lone, timed), batch32=batched(workers, timed))
                if sidecar:
                    row["sidecar"] = _over_http(package, precision, budget, layout, test, sidecar, console)
                rows.append(row)
    if tfidf_dir is not None:
        rows += _tfidf_rows(package, tfidf_dir, layouts, test, timed, ref_probs, console, sidecar)
    return {"package": str(package), "cpus": os.cpu_count(), "trained_budget": trained, "test_rows": len(test.turns),
            "test_split": test.fingerprint, "package_split": test.package_fingerprint,
            "split_matches_package": test.matches_package, "speed_prompts": len(timed),
            "layouts": [x.name for x in layouts], "token_budget": token_budget, "rows": rows}


def _tfidf_rows(package: Path, dst: Path, layouts: list[Layout], test: LabelledTest, timed: list, ref_probs: np.ndarray,
                console, sidecar: dict | None) -> list[dict]:
    """The TF-IDF route's rows, one per layout: scored on the same test rows, timed on the same prompts (the encoder is
    loaded but never run: every prompt's slice is routed), its bucket agreement with the fp32 encoder."""
    from predictor.runtime import OnnxLengthPredictor

    with waiting(console, "fitting the per-slice TF-IDF route on the package's training split ..."):
        routed, fit = tfidf_package(package, test, dst)
        pred = OnnxLengthPredictor(routed, threads=layouts[0].threads)
        probs = pred.predict(test.turns).probs
    base = {"precision": "tfidf-logreg", "budget": None, "trained_budget": pred.trained_max_tokens, "fit": fit,
            "quality": quality(probs, test, pred.scheme), "vs_full": full_model_gap(probs, ref_probs, test, pred.scheme),
            "parity": {"parity_max_abs_diff": None, "bucket_agreement": float((probs.argmax(1) == ref_probs.argmax(1)).mean())},
            "truncated": None, "mean_prompt_tokens": None}
    rows = []
    for layout in layouts:
        with waiting(console, f"tfidf-logreg, {layout.name}: timing ..."):
            lone = OnnxLengthPredictor(routed, threads=layout.threads)
            workers = [OnnxLengthPredictor(routed, threads=layout.threads) for _ in range(layout.workers)]
            row = dict(base, layout=layout.name, threads=layout.threads, workers=layout.workers,
                       batch1=lone_requests(lone, timed), batch32=batched(workers, timed))
        if sidecar:
            row["sidecar"] = _over_http(routed, "fp32", pred.trained_max_tokens, layout, test, sidecar, console)
        rows.append(row)
    return rows


def _over_http(package: Path, precision: str, budget: int, layout: Layout, test: LabelledTest, sidecar: dict,
               console) -> dict:
    """One row measured through a started sidecar (``lengthwise bench sidecar``'s machinery), latest turns as prompts."""
    args = ["--precision", precision, "--max-prompt-tokens", str(budget), "--threads", str(layout.threads),
            "--workers", str(layout.workers), "--token-budget", str(sidecar["token_budget"])]
    prompts = [turns[-1][1] for turns in test.turns if turns[-1][1].strip()]
    report = bench(str(package), None, sidecar["levels"], sidecar["duration"], 1.0, len(prompts), args, console,
                   sidecar["timeout_ms"], prompts=prompts)
    return report["levels"]


def print_table(report: dict, console) -> None:
    t = Table(title=f"predictor variants: {report['package']}, {report['test_rows']} test prompts, {report['cpus']} CPUs")
    t.caption = ("quality on the whole test split; parity: max |logit diff| and bucket agreement with fp32 at the "
                 f"trained budget ({report['trained_budget']} tokens); batch 1: lone requests with THREADS threads; "
                 "batch 32: WORKERS sessions side by side" + ("" if report["split_matches_package"]
                                                              else "; the split differs from the package's own"))
    cols = ["precision", "budget", "layout", "top-1", "within-1", "MAE", "tau", "pairwise", "max |dlogit|", "agree",
            "b1 p50 ms", "b1 p99 ms", "b1 CPU ms", "b32 pred/s", "b32 CPU ms"]
    http = any("sidecar" in r for r in report["rows"])
    if http:
        cols += ["http p99 ms @lowest", "http pred/s @highest", "fallback @highest"]
    for c in cols:
        t.add_column(c, justify="left" if c == "precision" else "right", min_width=12 if c == "precision" else None)
    for r in report["rows"]:
        q = r["quality"].get("all", {})
        budget = "-" if r["budget"] is None else str(r["budget"])
        cells = [r["precision"], budget, r["layout"], f"{q.get('accuracy', float('nan')):.3f}",
                 f"{q.get('accuracy_within_1', float('nan')):.3f}", f"{q.get('mae_tokens', float('nan')):.0f}",
                 f"{q.get('kendall_tau', float('nan')):.3f}", f"{q.get('pairwise_accuracy', float('nan')):.3f}",
                 "-" if r["parity"]["parity_max_abs_diff"] is None else f"{r['parity']['parity_max_abs_diff']:.2g}",
                 f"{r['parity']['bucket_agreement']:.3f}", f"{r['batch1']['p50_ms']:.2f}", f"{r['batch1']['p99_ms']:.2f}",
                 f"{r['batch1']['cpu_ms_per_prediction']:.2f}", f"{r['batch32']['predictions_per_s']:.0f}",
                 f"{r['batch32']['cpu_ms_per_prediction']:.2f}"]
        if http:
            levels = r.get("sidecar") or {}
            lo = levels[min(levels, key=int)] if levels else None
            hi = levels[max(levels, key=int)] if levels else None
            cells += ["-" if lo is None else f"{lo['p99_ms']:.1f}", "-" if hi is None else f"{hi['throughput_rps']:.0f}",
                      "-" if hi is None or hi.get("fallback_rate") is None else f"{hi['fallback_rate']:.1%}"]
        t.add_row(*cells)
    console.print(t)
    gaps = Table(title="gap to the full model (fp32 at the trained budget) on the same rows, 95% paired-bootstrap interval")
    top1_drop, tau_drop = agreed_loss()
    gaps.caption = (f"a gap inside the agreed loss ({top1_drop * 100:g} point of top-1, {tau_drop} of tau) is told from "
                    "none only if its interval is")
    for c in ("precision", "budget", "top-1 points [95%]", "tau [95%]"):
        gaps.add_column(c, justify="left" if c == "precision" else "right")
    for r in {(r["precision"], r["budget"]): r for r in report["rows"]}.values():
        gaps.add_row(r["precision"], "-" if r["budget"] is None else str(r["budget"]),
                     _gap(r["vs_full"]["top1"], 100, ".1f"), _gap(r["vs_full"]["tau"], 1, ".3f"))
    console.print(gaps)


def agreed_loss() -> tuple[float, float]:
    """The top-1 and tau a cheaper variant may give up against the full model: ``train-predictor``'s defaults for a
    cheaper route (``--route-max-top1-drop``, ``--route-max-tau-drop``), the same loss a distilled student may give up."""
    from training.config import TrainConfig

    fields = TrainConfig.model_fields
    return float(fields["route_max_top1_drop"].default), float(fields["route_max_tau_drop"].default)


def _gap(gap: list[float], scale: float, fmt: str) -> str:
    """``+0.4 [-1.2, +2.0]``: a gap to the full model and its 95% interval (top-1 in points, tau as is)."""
    g, lo, hi = (x * scale for x in gap)
    return f"{g:+{fmt}} [{lo:+{fmt}}, {hi:+{fmt}}]"


def plot(report: dict, path: Path) -> Path:
    """Kendall tau against CPU per lone prediction, one point per (precision, budget) at the first layout, each with the
    95% interval of its gap to the full model, and the agreed loss (0.02 below the full model) shaded: on a few hundred
    test rows the intervals are wider than the loss, and the picture should say so."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    first = report["layouts"][0]
    for precision in dict.fromkeys(r["precision"] for r in report["rows"]):
        pts = [r for r in report["rows"] if r["precision"] == precision and r["layout"] == first]
        xs = [r["batch1"]["cpu_ms_per_prediction"] for r in pts]
        ys = [r["quality"].get("all", {}).get("kendall_tau", float("nan")) for r in pts]
        gaps = [r.get("vs_full", {}).get("tau", [0.0, 0.0, 0.0]) for r in pts]
        # a percentile interval need not contain its point estimate: a bar never goes negative
        yerr = [[max(0.0, g[0] - g[1]) for g in gaps], [max(0.0, g[2] - g[0]) for g in gaps]]
        ax.errorbar(xs, ys, yerr=yerr, fmt="o-", capsize=3, label=precision)
        for r, x, y in zip(pts, xs, ys):
            label = "" if r["budget"] is None else str(r["budget"])
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    rows = [r for r in report["rows"] if "vs_full" in r]
    if rows:  # every row knows the full model's tau: its own minus its gap
        full = rows[0]["quality"]["all"]["kendall_tau"] - rows[0]["vs_full"]["tau"][0]
        _, tau_drop = agreed_loss()
        ax.axhspan(full - tau_drop, full, color="grey", alpha=0.15, label=f"agreed loss ({tau_drop} of tau)")
    ax.set(xlabel=f"CPU ms per lone prediction ({first})", ylabel="Kendall tau (bars: 95% interval of the gap to fp32)",
           title=f"predictor variants on {report['test_rows']} test rows (labels: input budget in tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def run_cli(a: argparse.Namespace) -> int:
    quiet_libraries(False)
    console = Console(width=max(Console().width, 160))
    package = Path(a.package)
    try:
        if not (package / META_FILE).is_file() or not (package / "model.onnx").is_file():
            raise BenchError(f"{package} is not a model package (no meta.json and model.onnx)")
        meta = read_meta(package)
        precisions = parse_precisions(a.precisions)
        budgets = parse_budgets(a.budgets, meta.input_format.max_tokens)
        layouts = parse_layouts(a.layouts)
        if a.speed_prompts < 1 or a.token_budget < 1 or a.test_limit < 0 or a.max_samples < 0:
            raise BenchError("--speed-prompts and --token-budget must be at least 1, --test-limit and --max-samples at "
                             "least 0")
        sidecar = None
        if a.sidecar_levels:
            if not a.sidecar_duration > 0 or not a.fallback_ms > 0:
                raise BenchError("--sidecar-duration and --fallback-ms must be positive")
            sidecar = {"levels": parse_levels(a.sidecar_levels), "duration": a.sidecar_duration, "timeout_ms": a.fallback_ms,
                       "token_budget": a.token_budget}
        from training.data import DataError

        split_source(meta, a)  # a missing file is said before the wait starts
        with waiting(console, "rebuilding the labelled test split ..."):
            try:
                test = labelled_test(meta, a)
            except (DataError, FileNotFoundError, ValueError) as exc:
                raise BenchError(str(exc)) from None
        if len(test.turns) < 2:
            raise BenchError(f"the test split has {len(test.turns)} rows; pass more data or a larger --max-samples")
        if test.package_fingerprint is None:
            console.print("[yellow]note: the package records no test split, so some of these rows may be ones it trained "
                          "on[/]")
        elif not test.matches_package:
            console.print(f"[yellow]note: this test split ({test.fingerprint}) is not the one the package recorded "
                          f"({test.package_fingerprint}); pass the data, --max-samples and --seed it was trained with[/]")
        with tempfile.TemporaryDirectory(prefix="lengthwise-tfidf-") as tmp:
            report = bench_variants(package, precisions, budgets, layouts, test, a.speed_prompts, console, sidecar,
                                    a.token_budget, Path(tmp) / "package" if a.tfidf else None)
    except BenchError as exc:
        print(f"lengthwise bench predictor-variants: error: {exc}", file=sys.stderr)
        return 2
    print_table(report, console)
    out = Path(a.json) if a.json else Path("bench-results") / "predictor-variants" / "variants.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    png = plot(report, out.with_suffix(".png"))
    console.print(f"wrote {out} and {png}")
    return 0
