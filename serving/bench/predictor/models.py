"""``lengthwise bench model-lengths``: how well each kind of length predictor ranks the answers of several models, per
model and across models in one queue, on AlpacaEval's 805 instructions answered by 62 real LLMs.

A fleet serving several models needs each request's length for the model it names. SeaLLM profiles a service by its
mean and spread and so ranks nothing within a service (Kendall tau 0 inside one model), though it ranks across services
as far as their means differ. The candidates here, all scored on the same held-out instructions (split by instruction,
seed 0, as ``train-predictor`` splits: no test instruction is in any training row, of any model):

- ``model-mean``: the model's own training mean (SeaLLM's profile);
- ``tfidf``: TF-IDF + logistic regression fitted per model, on that model's answers only (one predictor per model);
- ``tfidf-pooled``: one TF-IDF model on every model's answers, blind to which model answers;
- ``tfidf-conditioned``: one TF-IDF model on every model's answers, each prompt prefixed with its model's name
  (:func:`predictor.conditioning.conditioned_text`), so the model is a feature (one predictor conditioned on the model);
- ``encoder-conditioned`` (``--conditioned-package``): the LoRA encoder trained the same way, by ``train-predictor``
  on the JSONL that ``--write-conditioned`` writes (``--condition-on-model``);
- ``encoder`` (``--per-model-packages DIR``): one LoRA encoder per model, ``DIR/<model>/`` trained by ``train-predictor
  --format alpaca-eval --generator <model>``.

Lengths are counted with one tokenizer for every model (GPT-2's from the data directory by default): the models'
own tokenizers are not all available, and one ruler keeps models comparable in one queue.
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from rich.console import Console
from rich.table import Table

from predictor.buckets import BucketScheme
from predictor.conditioning import conditioned_text

if TYPE_CHECKING:
    from training.evaluate import Predictions

DEFAULT_DATA = "prompts/alpaca_eval_model_outputs.62models.jsonl.xz"


class ModelLengthsError(ValueError):
    """Bad input, said in one line (exit 2)."""


@dataclass
class Answers:
    """Every selected model's answer to each instruction: one row per (model, instruction)."""

    models: np.ndarray  # [n] the answering model
    groups: list[str]  # the instruction's id: what the split is by
    texts: list[str]  # the instruction
    lengths: np.ndarray  # [n] the answer's length in tokens
    split: np.ndarray  # [n] train, val, test, or skip (a held-out row that is not scored: see ``scored``)
    scored: np.ndarray | None = None  # [n] rows a test may score (None: all); relabelled sets: prompts every model has

    def take(self, mask: np.ndarray) -> Answers:
        return Answers(self.models[mask], [g for g, m in zip(self.groups, mask) if m],
                       [t for t, m in zip(self.texts, mask) if m], self.lengths[mask], self.split[mask],
                       None if self.scored is None else self.scored[mask])


def load_answers(path: Path, tokenizer: Path, models: list[str] | None, seed: int = 0) -> Answers:
    """The AlpacaEval rows of ``models`` (None: every generator), their lengths counted by ``tokenizer``, each row's
    split by its instruction."""
    from training.data.example import DataError
    from training.data.labels import attach_labels, labels_of, load_counter
    from training.data.loaders import alpaca_eval_by_generator
    from training.split import split_of

    try:
        by_model = alpaca_eval_by_generator(path)  # train-predictor's own loader: the same rows and instruction groups
    except (DataError, lzma.LZMAError, EOFError) as exc:
        raise ModelLengthsError(f"{path}: not readable AlpacaEval model outputs ({exc})") from None
    known = sorted(m for m, examples in by_model.items() if examples)
    if not known:
        raise ModelLengthsError(f"{path}: no rows with instruction, output and generator")
    if models is not None:
        unknown = [m for m in models if m not in known]
        if unknown:
            raise ModelLengthsError(f"--models: {', '.join(unknown)} not in {path.name} (it has {len(known)}: "
                                    f"{', '.join(known[:6])}, ...)")
    chosen = [(m, e) for m in by_model if models is None or m in models for e in by_model[m]]  # the file's order
    examples = attach_labels([e for _, e in chosen], load_counter(tokenizer))
    groups = [e.group for e in examples]
    return Answers(np.array([m for m, _ in chosen], dtype=object), groups, [e.turns[-1].text for e in examples],
                   labels_of(examples).astype(np.float64), np.array([split_of(g, seed=seed) for g in groups], dtype=object))


def load_relabelled(files: dict[str, Path], prompts: Path, seed: int = 0) -> Answers:
    """The served models' own lengths, from ``lengthwise relabel`` files of one prompt set (a base and its adapters,
    relabelled from the same prompts, some on more of them than others): one row per (model, prompt it labelled), its
    length the mean of that model's samples (a censored sample counts at the cap), each row's split by its
    conversation, as ``train-predictor`` splits. Every row trains; only prompts every model labelled are scored, so
    each model is judged on the same prompts and one queue holds each of them once per model."""
    from training.data.example import DataError
    from training.data.loaders import load_examples
    from training.data.served import join_served_lengths, prompt_hash
    from training.split import split_of

    try:
        examples = load_examples(str(prompts), "sharegpt")
        per_model = {}
        for name, f in files.items():
            lengths: dict[str, list[int]] = {}
            for e in join_served_lengths(examples, f):
                lengths.setdefault(prompt_hash(e.turns), []).append(int(e.response_tokens))
            per_model[name] = lengths
    except (DataError, OSError, lzma.LZMAError) as exc:
        raise ModelLengthsError(f"--relabelled: {' '.join(str(exc).split())}") from None
    common = set.intersection(*(set(v) for v in per_model.values()))
    if not common:
        raise ModelLengthsError("--relabelled: the files share no prompt; relabel every model from the same prompt set")
    first = {}
    for e in examples:  # the prompt set's order, each prompt once
        first.setdefault(prompt_hash(e.turns), e)
    rows = [(m, first[h].group, first[h].turns[-1].text, float(np.mean(per_model[m][h])), h in common)
            for m in files for h in first if h in per_model[m]]
    scored = np.array([r[4] for r in rows])
    split = np.array([split_of(r[1], seed=seed) for r in rows], dtype=object)
    split[(split == "test") & ~scored] = "skip"
    return Answers(np.array([r[0] for r in rows], dtype=object), [r[1] for r in rows], [r[2] for r in rows],
                   np.array([r[3] for r in rows]), split, scored)


def write_conditioned(answers: Answers, path: Path) -> int:
    """Every row as ``train-predictor --format jsonl --condition-on-model`` reads it (prompt, the model that answered,
    response_tokens, group = the instruction). ``train-predictor`` splits by group with the same seed, so an encoder
    conditioned on the model trains and validates on exactly the rows ``tfidf-conditioned`` does and never on a test
    instruction (its own report scores those). Returns the rows written."""
    with open(path, "w") as f:
        f.writelines(json.dumps({"prompt": t, "model": m, "response_tokens": int(n), "group": g}) + "\n"
                     for m, g, t, n in zip(answers.models, answers.groups, answers.texts, answers.lengths))
    return len(answers.lengths)


def _rows(texts: list[str], lengths: np.ndarray):
    from training.baselines import Rows

    n = len(texts)
    return Rows(texts, np.zeros(n), np.zeros((n, 2)), np.ones(n, dtype=bool), lengths)


def _tfidf(train_texts: list[str], train_len: np.ndarray, val_texts: list[str], val_len: np.ndarray,
           scheme: BucketScheme):
    from training.baselines import TfidfLogReg

    return TfidfLogReg().fit(_rows(train_texts, train_len), _rows(val_texts, val_len), scheme)


def predict_all(answers: Answers, scheme: BucketScheme, conditioned_package: Path | None = None,
                per_model_packages: Path | None = None, progress=None) -> dict[str, Predictions]:
    """Each predictor's bucket probabilities and expected length for every test row (NaN where it has none: a model
    without its own encoder package)."""
    from training.evaluate import Predictions

    tr, va, te = (answers.take(answers.split == s) for s in ("train", "val", "test"))
    models = sorted(set(answers.models))
    n, k = len(te.lengths), scheme.n
    out: dict[str, Predictions] = {}
    profile = {m: (tr.lengths[tr.models == m].mean(),  # SeaLLM's profile: the mean, and the histogram for top-1
                   np.bincount(scheme.assign(tr.lengths[tr.models == m]), minlength=k) + 1e-3) for m in models}
    out["model-mean"] = Predictions(np.stack([profile[m][1] / profile[m][1].sum() for m in te.models]),
                                    np.array([profile[m][0] for m in te.models]))
    per = Predictions(np.zeros((n, k)), np.zeros(n))
    for m in models:
        a, b, c = (part.models == m for part in (tr, va, te))
        fit = _tfidf(tr.take(a).texts, tr.lengths[a], va.take(b).texts, va.lengths[b], scheme)
        _put(per, c, fit.predict(_rows(te.take(c).texts, te.lengths[c])))
        if progress:
            progress(f"tfidf {m}")
    out["tfidf"] = per
    pooled = _tfidf(tr.texts, tr.lengths, va.texts, va.lengths, scheme)
    out["tfidf-pooled"] = pooled.predict(_rows(te.texts, te.lengths))
    cond = [[conditioned_text(m, t) for m, t in zip(p.models, p.texts)] for p in (tr, va, te)]
    conditioned = _tfidf(cond[0], tr.lengths, cond[1], va.lengths, scheme)
    out["tfidf-conditioned"] = conditioned.predict(_rows(cond[2], te.lengths))
    if conditioned_package is not None:
        out["encoder-conditioned"] = _encoder(conditioned_package, cond[2], scheme)
    if per_model_packages is not None:
        own = Predictions(np.full((n, k), np.nan), np.full(n, np.nan))
        for m in models:
            pkg = per_model_packages / m
            if (pkg / "package").is_dir():
                pkg = pkg / "package"
            if (pkg / "meta.json").exists():
                rows = te.models == m
                _put(own, rows, _encoder(pkg, te.take(rows).texts, scheme))
        out["encoder"] = own
    return out


def predict_folds(answers: Answers, scheme: BucketScheme, folds: int) -> tuple[Answers, dict[str, Predictions]]:
    """Every row predicted by predictors that never saw its prompt group: the groups dealt into ``folds`` folds (by a
    stable hash), each fold tested on with the next one as validation and the rest as training. For prompt sets too
    small for one held-out split to rank on (a few hundred relabelled prompts). Returns the rows, all marked test, and
    each predictor's predictions in their order."""
    from training.evaluate import Predictions

    fold = np.array([zlib.crc32(g.encode()) % folds for g in answers.groups])
    scored = np.ones(len(fold), dtype=bool) if answers.scored is None else answers.scored
    out: dict[str, Predictions] = {}
    for f in range(folds):
        test = (fold == f) & scored
        split = np.where(test, "test", np.where(fold == f, "skip", np.where(fold == (f + 1) % folds, "val", "train")))
        part = predict_all(Answers(answers.models, answers.groups, answers.texts, answers.lengths, split.astype(object)),
                           scheme)
        for name, pred in part.items():
            into = out.setdefault(name, Predictions(np.zeros((len(fold), scheme.n)), np.zeros(len(fold))))
            _put(into, test, pred)
    every = answers.take(scored)
    every.split = np.full(int(scored.sum()), "test", dtype=object)
    return every, {name: Predictions(p.probs[scored], p.point[scored]) for name, p in out.items()}


def _put(into: Predictions, rows: np.ndarray, part: Predictions) -> None:
    into.probs[rows], into.point[rows] = part.probs, part.point


def _encoder(package: Path, texts: list[str], scheme: BucketScheme) -> Predictions:
    """A package's predictions, on the bench's buckets (a package trained with other buckets cannot be compared)."""
    from predictor.runtime import OnnxLengthPredictor
    from training.evaluate import Predictions

    predictor = OnnxLengthPredictor(package)
    if list(predictor.scheme.edges) != list(scheme.edges):
        raise ModelLengthsError(f"{package}: its buckets {predictor.scheme.edges} are not the bench's {scheme.edges} "
                                "(give the bench the --bucket-width and --max-tokens it was trained with)")
    batch = predictor.predict_encoded(predictor.encode(texts))
    return Predictions(batch.probs, batch.expected)


def score(answers: Answers, points: dict[str, Predictions], scheme: BucketScheme) -> dict:
    """Per model and across models (one queue of every model's test rows): Kendall tau and top-1 of each predictor, on
    the rows it predicted (a per-model encoder missing for a model leaves that model out of its row)."""
    from training.evaluate import compute_metrics, take

    te = answers.take(answers.split == "test")
    models = sorted(set(te.models))

    def metrics(pred: Predictions, rows: np.ndarray) -> dict:
        m = compute_metrics(take(pred, rows), te.lengths[rows], scheme)
        return {k: m[k] for k in ("n", "kendall_tau", "accuracy", "mae_tokens")}

    report: dict = {"per_model": {}, "across_models": {}, "summary": {}}
    for name, pred in points.items():
        ok = ~np.isnan(pred.point)
        report["across_models"][name] = metrics(pred, ok)
        taus, tops = [], []
        for m in models:
            rows = (te.models == m) & ok
            if rows.sum() < 2:
                continue
            r = metrics(pred, rows)
            report["per_model"].setdefault(m, {"mean_length": float(answers.lengths[answers.models == m].mean())})[name] = r
            taus.append(r["kendall_tau"])
            tops.append(r["accuracy"])
        report["summary"][name] = {"models": len(taus), "mean_tau": float(np.mean(taus)) if taus else None,
                                   "median_tau": float(np.median(taus)) if taus else None,
                                   "mean_top1": float(np.mean(tops)) if tops else None}
    return report


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "model-lengths", help="per-model length predictors on AlpacaEval's 62 models: conditioned, per model, the "
                              "model's mean, TF-IDF",
        formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__.split("\n\n")[0].replace("``", "'"),
        epilog="examples:\n"
               "  lengthwise bench model-lengths                      # the TF-IDF rows and the means, all 62 models\n"
               "  lengthwise bench model-lengths --models 12 --write-conditioned cond.jsonl\n"
               "  train-predictor --data cond.jsonl --format jsonl --max-samples 0 --no-register --work-dir cond\n"
               "  lengthwise bench model-lengths --models 12 --conditioned-package cond/package")
    p.add_argument("--data", type=Path, help=f"AlpacaEval model outputs (default: $LENGTHWISE_DATA/{DEFAULT_DATA})")
    p.add_argument("--models", help="all (default), N (the N models spread evenly over the range of mean lengths), or "
                                    "names separated by commas")
    p.add_argument("--relabelled", metavar="NAME=FILE,...", help="instead of AlpacaEval: the served models' own lengths, "
                   "each a `lengthwise relabel` file of the same prompt set (--prompts), e.g. a base and its LoRA "
                   "adapters; every labelled prompt trains, those every file labelled are scored")
    p.add_argument("--prompts", type=Path, help="the prompt set --relabelled was labelled from (default: "
                   "$LENGTHWISE_DATA's ShareGPT slice, as relabel's)")
    p.add_argument("--folds", type=int, metavar="K", help="score every row, each predicted by predictors fitted on the "
                   "other K-1 folds of prompt groups (the TF-IDF rows and the means; for small sets such as --relabelled) "
                   "instead of one 80/10/10 split")
    p.add_argument("--tokenizer", type=Path, help="what counts answer tokens (default: GPT-2's from the data directory)")
    p.add_argument("--bucket-width", type=int, default=200, help="bucket width in tokens (default: %(default)s, "
                                                                  "train-predictor's)")
    p.add_argument("--max-tokens", type=int, default=2048, help="the last bucket's end (default: %(default)s)")
    p.add_argument("--conditioned-package", type=Path, metavar="DIR", help="score this encoder package, trained on "
                   "--write-conditioned's rows, as encoder-conditioned")
    p.add_argument("--per-model-packages", type=Path, metavar="DIR", help="score DIR/<model>[/package] as each model's "
                   "own encoder")
    p.add_argument("--write-conditioned", type=Path, metavar="FILE", help="write every row, each prompt prefixed with "
                   "its model, as JSONL for train-predictor (which splits it by instruction as the bench does), and stop")
    p.add_argument("--json", type=Path, default=Path("bench-results/model-lengths/model_lengths.json"),
                   help="the report (default: %(default)s; the PNG beside it)")
    p.set_defaults(func=run_cli)
    return p


def selected_answers(path: Path, tokenizer: Path, spec: str | None) -> Answers:
    """The answers ``--models`` asks for: every model's, the named ones', or those of N models spread over the range of
    mean answer lengths (every model's answers read and counted once, then the N taken from them)."""
    if spec in (None, "", "all"):
        return load_answers(path, tokenizer, None)
    if not spec.isdigit():
        return load_answers(path, tokenizer, [m.strip() for m in spec.split(",") if m.strip()])
    n = int(spec)
    if n < 2:
        raise ModelLengthsError("--models N needs N >= 2 (one model ranks nothing across models)")
    every = load_answers(path, tokenizer, None)
    means = sorted((float(every.lengths[every.models == m].mean()), m) for m in set(every.models))
    idx = np.unique(np.round(np.linspace(0, len(means) - 1, min(n, len(means)))).astype(int))
    return every.take(np.isin(every.models, [means[i][1] for i in idx]))


def relabelled_files(spec: str) -> dict[str, Path]:
    """``NAME=FILE,NAME=FILE`` as a dict; ModelLengthsError naming what is wrong."""
    out = {}
    for part in filter(None, (x.strip() for x in spec.split(","))):
        name, sep, f = part.partition("=")
        if not sep or not name or not f:
            raise ModelLengthsError(f"--relabelled {part!r}: give NAME=FILE")
        if not Path(f).is_file():
            raise ModelLengthsError(f"--relabelled {name}: {f} not found")
        out[name] = Path(f)
    if len(out) < 2:
        raise ModelLengthsError("--relabelled needs two models or more (one model ranks nothing across models)")
    return out


def run_cli(a: argparse.Namespace) -> int:
    from predictor.common import data_dir, default_sharegpt, default_tokenizer

    console = Console()
    try:
        path = a.data or data_dir() / DEFAULT_DATA
        tokenizer = a.tokenizer or default_tokenizer()
        if not a.relabelled and not Path(path).exists():  # --relabelled reads its own files and --prompts instead
            raise ModelLengthsError(f"{path} not found (set LENGTHWISE_DATA or give --data)")
        for flag, value in (("--conditioned-package", a.conditioned_package), ("--per-model-packages", a.per_model_packages)):
            if value is not None and not value.is_dir():
                raise ModelLengthsError(f"{flag} {value}: not a directory")
        if a.folds is not None and (a.folds < 3 or a.conditioned_package or a.per_model_packages):
            raise ModelLengthsError("--folds takes K >= 3 (a test, a validation and a training fold) and scores the "
                                    "TF-IDF rows and the means only, without --conditioned-package or --per-model-packages")
        if a.bucket_width < 1 or a.max_tokens <= a.bucket_width:
            raise ModelLengthsError("--bucket-width must be >= 1 and below --max-tokens")
        if a.relabelled:
            answers = load_relabelled(relabelled_files(a.relabelled), a.prompts or default_sharegpt())
            path, tokenizer = a.relabelled, "each served model's own output tokens"
        else:
            answers = selected_answers(Path(path), Path(tokenizer), a.models)
    except ModelLengthsError as exc:
        print(f"lengthwise bench model-lengths: error: {exc}", file=sys.stderr)
        return 2
    chosen = sorted(set(answers.models))
    if a.write_conditioned is not None:
        n = write_conditioned(answers, a.write_conditioned)
        console.print(f"wrote {n} rows of {len(chosen)} models to {a.write_conditioned} (train-predictor splits them by "
                      "instruction as this bench does)")
        return 0
    scheme = BucketScheme.equal_width(a.bucket_width, a.max_tokens)
    try:
        with console.status("fitting and predicting") as status:
            if a.folds:
                answers, points = predict_folds(answers, scheme, a.folds)
            else:
                points = predict_all(answers, scheme, a.conditioned_package, a.per_model_packages,
                                     progress=lambda what: status.update(f"fitting {what}"))
    except ModelLengthsError as exc:
        print(f"lengthwise bench model-lengths: error: {exc}", file=sys.stderr)
        return 2
    report = score(answers, points, scheme)
    report["config"] = {"data": str(path), "tokenizer": str(tokenizer), "models": chosen, "bucket_width": a.bucket_width,
                        "max_tokens": a.max_tokens, "split": (f"{a.folds} folds of " if a.folds else "")
                        + ("conversations" if a.relabelled else "instructions") + ("" if a.folds else ", seed 0"),
                        "rows": {s: int((answers.split == s).sum()) for s in ("train", "val", "test")},
                        "conditioned_package": str(a.conditioned_package) if a.conditioned_package else None,
                        "per_model_packages": str(a.per_model_packages) if a.per_model_packages else None}
    _table(console, report)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=1))
    png = _plot(report, a.json.with_suffix(".png"))
    console.print(f"wrote {a.json}" + (f" and {png}" if png else ""))
    return 0


def _table(console: Console, report: dict) -> None:
    t = Table(title=f"{len(report['per_model'])} models, {report['config']['rows']['test']} test answers "
                    "(prompts no predictor trained on)")
    for col in ("predictor", "tau within a model (mean / median)", "top-1 (mean over models)", "tau across models",
                "top-1 across models"):
        t.add_column(col)
    for name, s in report["summary"].items():
        across = report["across_models"][name]
        t.add_row(name, f"{s['mean_tau']:.3f} / {s['median_tau']:.3f}" if s["mean_tau"] is not None else "-",
                  f"{s['mean_top1']:.3f}" if s["mean_top1"] is not None else "-", f"{across['kendall_tau']:.3f}",
                  f"{across['accuracy']:.3f}")
    console.print(t)


def _plot(report: dict, path: Path) -> Path | None:
    """Each model's within-model tau for each predictor, models ordered by their mean answer length."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    per = sorted(report["per_model"].items(), key=lambda kv: kv[1]["mean_length"])
    fig, ax = plt.subplots(figsize=(max(6.0, 0.22 * len(per) + 2), 4.0))
    for name in report["summary"]:
        ys = [v.get(name, {}).get("kendall_tau", np.nan) for _, v in per]
        ax.plot(range(len(per)), ys, marker="o", ms=3, lw=0.8, label=name)
    ax.set_xticks(range(len(per)), [m for m, _ in per], rotation=90, fontsize=6)
    ax.set_ylabel("Kendall tau within the model (test answers)")
    ax.set_title("per-model length ranking, models by mean answer length")
    ax.axhline(0, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
