"""``lengthwise retrain``: live traffic back into a promoted predictor.

The sidecar keeps every answered prediction's feedback (prompt, predicted distribution, actual length, finish reason)
in its store (monitoring.feedback_store). A predictor that served another model's lengths, or whose traffic drifted,
shows it there first: its online windows fall below its offline accuracy and raise the drift alarm. This job closes
the loop, once (``--once``, for cron) or every ``--interval``:

1. **Trigger.** By default only when the champion's latest online window carries the drift alarm
   (``--trigger always``: on every run).
2. **Window.** The champion's feedback rows, oldest first; the most recent ``--holdout`` share is held out, so the
   challenger is judged on traffic newer than anything it trained on. Rows whose prompt was not kept
   (``predictor-sidecar --no-store-prompts``) cannot be trained on: the job refuses with one line.
3. **Labels.** The engine's own output token counts: the served model's lengths in its tokenizer. A capped answer
   (``finish_reason=length``) is a censored label: its true length is at least the count. It trains as that lower
   bound (the censored likelihood of :func:`training.module.censored_cross_entropy`), never as a short answer. Only
   rows whose bucket is known (stopped by themselves, or cut already inside the open last bucket) are held out to
   judge the two versions: a lower bound below the last bucket has no true bucket to score against.
4. **Challenger.** ``train-predictor``'s pipeline on the training rows (optionally with a base dataset of the served
   model's lengths, ``--base-data`` with ``--base-served-lengths``), registered with its lineage: parent version, the
   data window, the counts, the trigger. Its buckets stop at **the cap clients send** (``--served-max-tokens``; by
   default the median count of the answers cut by ``length``): nothing in the feedback says how long a cut answer
   would have run, so buckets past the cap could only be guessed (trained on lower bounds alone, a model spreads
   their mass anywhere above the cap, and its expected length with it). Under the cap it gets
   :data:`UNDER_CAP_BUCKETS` equal buckets and a last one opening at the cap, so every capped answer's bucket is
   known and the answers under the cap are still told apart (the champion's edges alone could leave two buckets,
   whose expected lengths cannot rank). When the champion's edges all lie under the cap, its buckets are kept.
5. **Guard.** Champion and challenger predict the same held-out rows. On the same buckets the challenger is promoted
   only when it is better by the rule :func:`registry.store.promote` applies (top-1, ties by Kendall tau). On
   different buckets top-1 means different things (two buckets are easier to hit than ten), so the rule is the
   scheduler's: Kendall tau over the held-out pairs whose order is known, ties by MAE. The sidecar picks the new
   champion up by its alias.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from monitoring.feedback_store import FeedbackRow, FeedbackStore
from predictor.buckets import BucketScheme
from predictor.monitoring_runs import window_history
from predictor.target import served_model_id

log = logging.getLogger(__name__)

DEFAULT_HOLDOUT = 0.2
DEFAULT_MIN_FEEDBACK = 200
UNDER_CAP_BUCKETS = 8  # the challenger's equal buckets under the served cap (TetriInfer's fixed-width granularity)
TAG_PARENT = "lengthwise.parent_version"
TAG_WINDOW = "lengthwise.retrain.window"
TAG_COUNTS = "lengthwise.retrain.counts"
TAG_TRIGGER = "lengthwise.retrain.trigger"
TAG_HOLDOUT = "lengthwise.retrain.holdout"

EPILOG = """\
examples:
  # once, now, whatever the alarm says (e.g. after switching the served model)
  lengthwise retrain --once --trigger always --served-model ./SmolLM2-135M-Instruct

  # from cron, hourly: retrains only when the champion's online windows raised the drift alarm
  0 * * * *  lengthwise retrain --once --served-model /models/SmolLM2-135M-Instruct

  # the feedback mixed with a base dataset of the served model's own lengths (lengthwise relabel --no-text)
  lengthwise retrain --once --served-model ./SmolLM2-135M-Instruct --base-data sharegpt.json.xz \\
      --base-served-lengths smollm2.lengths.jsonl

Exit status: 0 when the run did what it could (retrained, promoted or not, or had nothing to do and said why);
2 for bad input (no feedback store, prompts not stored, unknown model name), with one line saying how to fix it.
"""


class RetrainError(ValueError):
    """Input the job cannot use; the message is one line saying what to fix."""


@dataclass
class Window:
    """The rows of one run: what trains the challenger and the newer rows both predictors are judged on."""

    train: list[FeedbackRow]
    holdout: list[FeedbackRow]  # the newest rows: decided ones judge top-1 and MAE, all of them the ranking
    undecided: int = 0  # of the held-out rows, cut ones whose bucket is not known (they judge the ranking only)

    @property
    def span(self) -> tuple[float, float]:
        rows = self.train + self.holdout
        return min(r.time for r in rows), max(r.time for r in rows)


@dataclass
class Outcome:
    """What one run did, for the console, ``--output-json`` and tests."""

    action: str  # "skipped", "promoted", "kept"
    reason: str
    champion: str | None = None
    challenger: str | None = None
    counts: dict[str, int] = field(default_factory=dict)
    holdout: dict[str, dict[str, float]] = field(default_factory=dict)
    edges: list[int] = field(default_factory=list)  # the buckets both versions were judged on (the challenger's)


def decided(row: FeedbackRow, scheme: BucketScheme) -> bool:
    """Whether a row's true bucket is known (:meth:`predictor.buckets.BucketScheme.decided`)."""
    return bool(scheme.decided([row.actual_tokens], [row.censored])[0])


def split_window(rows: list[FeedbackRow], scheme: BucketScheme, holdout: float) -> Window:
    """Oldest first: the span holding the newest ``holdout`` share of the decided rows is held out (with the cut rows
    inside it, which judge the ranking), and every row older than it trains (cut ones as lower bounds)."""
    rows = sorted(rows, key=lambda r: r.time)
    keep = [r for r in rows if decided(r, scheme)]
    hold = keep[-max(1, round(len(keep) * holdout)):] if keep else []
    start = rows.index(hold[0]) if hold else len(rows)
    return Window(rows[:start], rows[start:], undecided=sum(not decided(r, scheme) for r in rows[start:]))


def drift_alarm(name: str, version: str) -> tuple[bool, str]:
    """(raised, why) from the champion's latest logged online window."""
    _, windows = window_history(name, version)
    if not windows:
        return False, f"no online windows logged for {name} version {version} yet"
    last = windows[-1]
    acc = last.get("accuracy")
    raised = bool(last.get("accuracy_alarm", 0.0))
    return raised, (f"latest online window (step {int(last['step'])}, n={int(last.get('n', 0))}): top-1 "
                    f"{acc if acc is None else round(acc, 3)}, drift alarm {'raised' if raised else 'not raised'}")


def write_jsonl(rows: list[FeedbackRow], path: Path, target: dict[str, Any], base: list[Any] | None = None) -> int:
    """The rows as a ``train-predictor --format jsonl`` dataset: chat turns and the engine's output tokens, every line
    naming the served model (so the challenger records it as its target); each feedback row its own group (the store
    keeps no conversation id)."""
    named = {k: target[k] for k in ("model", "sampling", "max_tokens", "source")}
    n = 0
    with path.open("w") as f:
        for r in rows:
            msgs = [{"role": role, "content": text} for role, text in (r.turns or [])]
            f.write(json.dumps({"id": r.prediction_id, "messages": msgs, "response_tokens": r.actual_tokens,
                                "censored": r.censored, **named}) + "\n")
            n += 1
        for e in base or []:
            msgs = [{"role": t.role, "content": t.text} for t in e.turns]
            f.write(json.dumps({"id": f"base-{e.group}", "messages": msgs, "response_tokens": e.response_tokens,
                                "censored": e.censored, **named}) + "\n")
            n += 1
    return n


def served_scheme(champion: BucketScheme, rows: list[FeedbackRow], cap: int | None = None) -> BucketScheme:
    """The challenger's buckets: :data:`UNDER_CAP_BUCKETS` equal ones under the served cap (``cap``, else the median
    count of the answers cut by ``length``) and a last, open one from the cap; the champion's scheme when no answer was
    capped or when its edges all lie under the cap already."""
    if cap is None:
        capped = [r.actual_tokens for r in rows if r.finish_reason == "length"]
        if not capped:
            return champion
        cap = int(np.median(capped))
    if champion.edges[-1] <= cap or cap < UNDER_CAP_BUCKETS:
        return champion
    inner = sorted({round(i * cap / UNDER_CAP_BUCKETS) for i in range(1, UNDER_CAP_BUCKETS)} | {cap})
    return BucketScheme.from_edges(inner, max_tokens=cap + 1)


def holdout_metrics(pred: Any, rows: list[FeedbackRow]) -> dict[str, float]:
    """One predictor (an OnnxLengthPredictor) on the held-out rows, on its own buckets: top-1, within-1 and MAE on the
    rows whose bucket is known there (training.evaluate's definitions; ``n`` counts them), and Kendall tau over every
    pair of held-out rows whose order is known, cut answers included (:func:`training.evaluate.censored_tau`, the
    same pairs for any predictor): judged on the decided rows alone, a predictor that calls every answer short would
    look best, as the answers that ran long are the ones cut."""
    from training.evaluate import Predictions, censored_tau, compute_metrics

    batch = pred.predict([list(r.turns or []) for r in rows])
    actual = np.array([r.actual_tokens for r in rows], float)
    cut = np.array([r.censored for r in rows], bool)
    known = pred.scheme.decided(actual, cut)
    expected = np.asarray(batch.expected)
    m = compute_metrics(Predictions(np.asarray(batch.probs)[known], expected[known]), actual[known], pred.scheme)
    tau, pairs = censored_tau(expected, actual, cut)
    out = {k: float(m[k]) for k in ("n", "accuracy", "accuracy_within_1", "mae_tokens")}
    return {**out, "kendall_tau": float("nan") if tau is None else tau, "tau_pairs": float(pairs)}


def better(cand: dict[str, float], champ: dict[str, float], same_buckets: bool = True) -> bool:
    """On the same buckets, the promotion rule of registry.store.promote (:func:`registry.store.ranking_key`); on
    different ones, the ranking (Kendall tau over the known pairs), ties by MAE: top-1 over two buckets and over ten
    are not the same test."""
    from registry.store import ranking_key

    if same_buckets:
        return ranking_key(cand) > ranking_key(champ)
    return (cand["kendall_tau"], -cand["mae_tokens"]) > (champ["kendall_tau"], -champ["mae_tokens"])


@dataclass
class Settings:
    name: str = "length-predictor"
    served_model: str | None = None
    trigger: str = "alarm"
    holdout: float = DEFAULT_HOLDOUT
    min_feedback: int = DEFAULT_MIN_FEEDBACK
    store: str | None = None
    served_max_tokens: int | None = None  # the cap clients send (None: inferred from the capped answers)
    base_data: str | None = None
    base_format: str = "sharegpt"
    base_served_lengths: str | None = None
    base_exclude_groups: frozenset[str] = frozenset()  # conversations of the base set not to train on (see below)
    epochs: int = 2
    max_prompt_tokens: int = 128
    batch_size: int = 32
    seed: int = 0
    work_dir: str | None = None


def retrain_once(s: Settings) -> Outcome:
    """One pass of the loop (see the module docstring); raises :class:`RetrainError` for bad input."""
    from registry import store as reg

    if not s.served_model:
        raise RetrainError("--served-model is needed: the challenger learns that model's lengths and records it as its "
                           "target (give the directory or name the engines serve)")
    reg.check_reachable()
    reg.configure()
    champion = reg.alias_version(s.name, reg.CHAMPION)
    if champion is None:
        raise RetrainError(f"no @{reg.CHAMPION} version of {s.name!r} in {reg.tracking_uri()}: "
                           "train one with train-predictor --promote first")
    if s.trigger == "alarm":
        raised, why = drift_alarm(s.name, champion)
        if not raised:
            return Outcome("skipped", why, champion)
    fb = FeedbackStore(s.store)
    if not fb.path.exists():
        raise RetrainError(f"no feedback store at {fb.path}: run predictor-sidecar (it keeps feedback there) "
                           "or give --store")
    rows = fb.read(model_name=s.name)
    if len(rows) < s.min_feedback:
        return Outcome("skipped", f"{len(rows)} feedback rows for {s.name} (need --min-feedback {s.min_feedback})",
                       champion, counts={"rows": len(rows)})
    if any(r.turns is None for r in rows):
        n = sum(r.turns is None for r in rows)
        raise RetrainError(f"{n} of {len(rows)} feedback rows kept only a prompt hash (predictor-sidecar "
                           "--no-store-prompts): retraining needs the prompts; run the sidecar without that flag")
    champ_uri = f"models:/{s.name}/{champion}"
    champ_pred = reg.load_predictor(champ_uri)  # loaded once: its scheme, then its held-out predictions
    scheme = served_scheme(champ_pred.scheme, rows, s.served_max_tokens)
    win = split_window(rows, scheme, s.holdout)
    counts = {"rows": len(rows), "train": len(win.train), "holdout": len(win.holdout) - win.undecided,
              "censored_undecided": win.undecided, "censored_train": sum(r.censored for r in win.train),
              "censored_holdout": sum(r.censored for r in win.holdout)}
    if len(win.train) < 10:
        return Outcome("skipped", f"only {len(win.train)} rows to train on", champion, counts=counts)
    base = _base_examples(s) if s.base_data else []
    counts["base"] = len(base)
    challenger, run_id = _train_challenger(s, win, base, scheme, champion)
    hold = {"champion": holdout_metrics(champ_pred, win.holdout),
            "challenger": holdout_metrics(reg.load_predictor(f"models:/{s.name}/{challenger}"), win.holdout)}
    same = tuple(scheme.edges) == tuple(champ_pred.scheme.edges)
    rule = "top-1" if same else "Kendall tau"
    key = "accuracy" if same else "kendall_tau"
    _record_lineage(s, challenger, run_id, champion, win, counts, hold)
    if better(hold["challenger"], hold["champion"], same):
        reg.set_alias(s.name, reg.CHAMPION, challenger)
        reason = (f"version {challenger} beats version {champion} on the {len(win.holdout)} newest rows "
                  f"({rule} {hold['challenger'][key]:.3f} vs {hold['champion'][key]:.3f}); "
                  f"it is now @{reg.CHAMPION}")
        return Outcome("promoted", reason, champion, challenger, counts, hold, list(scheme.edges))
    reason = (f"version {challenger} is not better than version {champion} on the {len(win.holdout)} newest rows "
              f"({rule} {hold['challenger'][key]:.3f} vs {hold['champion'][key]:.3f}); @{reg.CHAMPION} kept")
    return Outcome("kept", reason, champion, challenger, counts, hold, list(scheme.edges))


def _base_examples(s: Settings) -> list[Any]:
    """The base dataset, labelled with the served model's own lengths (a base of another model's lengths would teach
    the challenger the wrong model)."""
    from training.data import DataError, load_examples
    from training.data.served import join_served_lengths

    if not s.base_served_lengths:
        raise RetrainError("--base-data needs --base-served-lengths (lengthwise relabel --no-text of that set): the "
                           "challenger must learn the served model's lengths, not the dataset's answers")
    try:
        base = join_served_lengths(load_examples(s.base_data, s.base_format), s.base_served_lengths)
    except (DataError, FileNotFoundError) as exc:
        raise RetrainError(" ".join(str(exc).split())) from None
    # A caller that replays conversations of the base set as traffic (a benchmark of the loop) leaves them out: the
    # guard's held-out feedback and any later measurement must be prompts the challenger never trained on.
    return [e for e in base if e.group not in s.base_exclude_groups]


def _target(s: Settings, n_rows: int) -> dict[str, Any]:
    return {"model": served_model_id(str(s.served_model)), "label_tokenizer": "served model's own output tokens",
            "sampling": None, "max_tokens": None, "source": f"feedback of {n_rows} served requests (lengthwise retrain)"}


def _train_challenger(s: Settings, win: Window, base: list[Any], scheme: BucketScheme, champion: str) -> tuple[str, str]:
    from training.config import TrainConfig
    from training.pipeline import run

    work = Path(s.work_dir or tempfile.mkdtemp(prefix="lengthwise-retrain-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "feedback.jsonl"
    write_jsonl(win.train, data, _target(s, len(win.train)), base)
    edges = ",".join(str(e) for e in scheme.edges[1:])
    cfg = TrainConfig(data=str(data), fmt="jsonl", edges=edges, max_tokens=scheme.max_tokens, epochs=s.epochs,
                      max_prompt_tokens=s.max_prompt_tokens, batch_size=s.batch_size, seed=s.seed, register=s.name,
                      alias="challenger", promote=False, work_dir=str(work / "train"), max_samples=None,
                      baselines=False)
    report = run(cfg)
    return str(report["registered_version"]), str(report["run_id"])


def _record_lineage(s: Settings, version: str, run_id: str, parent: str, win: Window, counts: dict[str, int],
                    hold: dict[str, dict[str, float]]) -> None:
    from mlflow import MlflowClient

    client = MlflowClient()
    start, end = (datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds") for t in win.span)
    tags = {TAG_PARENT: parent, TAG_WINDOW: f"{start}..{end}", TAG_COUNTS: json.dumps(counts),
            TAG_TRIGGER: s.trigger, TAG_HOLDOUT: json.dumps(hold)}
    for k, v in tags.items():
        client.set_model_version_tag(s.name, version, k, v)
    for who, m in hold.items():
        for k in ("accuracy", "kendall_tau", "mae_tokens"):
            if m[k] == m[k]:  # a tau with no known pair is NaN: nothing to log
                client.log_metric(run_id, f"holdout_{who}_{k}", m[k])


# --- the command --------------------------------------------------------------------------------------------------
def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("retrain", help="train a challenger on the sidecar's feedback and promote it if it is better",
                       formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
                       description="Train a challenger predictor on the served requests' feedback (the prompts the "
                                   "sidecar kept and the lengths the engine produced), judge it against the champion "
                                   "on the newest feedback held out, register it with its lineage and promote it when "
                                   "it is better. Capped answers are censored labels: they train as lower bounds, and "
                                   "only answers whose bucket is known judge the two versions.")
    p.add_argument("--name", default="length-predictor", help="registered model name (default: %(default)s)")
    p.add_argument("--served-model", metavar="DIR_OR_NAME", required=True,
                   help="the model the engines serve: the feedback's lengths are its own, and the challenger records "
                        "it as its target model (name@hash for a local directory, as the gateway computes it)")
    p.add_argument("--trigger", choices=("alarm", "always"), default="alarm",
                   help="alarm: only when the champion's latest online window raised the drift alarm; always: every "
                        "run (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="one pass, then exit (for cron)")
    p.add_argument("--interval", type=float, default=3600.0, metavar="S",
                   help="without --once: seconds between passes (default: %(default)s)")
    p.add_argument("--holdout", type=float, default=DEFAULT_HOLDOUT, metavar="F",
                   help="share of the newest feedback held out to judge both versions (default: %(default)s)")
    p.add_argument("--min-feedback", type=int, default=DEFAULT_MIN_FEEDBACK, metavar="N",
                   help="skip the pass with fewer feedback rows (default: %(default)s)")
    p.add_argument("--store", metavar="PATH", help="the feedback database (default: $LENGTHWISE_HOME/feedback.db)")
    p.add_argument("--served-max-tokens", type=int, metavar="N",
                   help="the max_tokens clients send: the challenger's buckets stop there, as the feedback says nothing "
                        "about lengths past it (default: the median count of the answers cut by length)")
    p.add_argument("--base-data", metavar="FILE", help="a prompt set to train on beside the feedback")
    p.add_argument("--base-format", default="sharegpt", help="its format (default: %(default)s)")
    p.add_argument("--base-served-lengths", metavar="FILE", help="its labels: lengthwise relabel --no-text output")
    p.add_argument("--epochs", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=128, metavar="N", help="(default: %(default)s)")
    p.add_argument("--work-dir", metavar="DIR", help="keep the dataset, checkpoints and package here")
    p.add_argument("--output-json", metavar="PATH", help="write each pass's outcome here")
    p.set_defaults(func=run_cli)
    return p


def settings_from_args(a: argparse.Namespace) -> Settings:
    if not 0 < a.holdout < 1:
        raise RetrainError(f"--holdout must be between 0 and 1, got {a.holdout:g}")
    for flag, v in (("--min-feedback", a.min_feedback), ("--epochs", a.epochs), ("--max-prompt-tokens", a.max_prompt_tokens),
                    ("--served-max-tokens", a.served_max_tokens or 1)):
        if v < 1:
            raise RetrainError(f"{flag} must be at least 1, got {v}")
    if not a.once and not a.interval > 0:
        raise RetrainError(f"--interval must be positive, got {a.interval:g}")
    if a.base_data and not Path(a.base_data).exists():
        raise RetrainError(f"--base-data {a.base_data}: no such file")
    return Settings(name=a.name, served_model=a.served_model, trigger=a.trigger, holdout=a.holdout,
                    min_feedback=a.min_feedback, store=a.store, served_max_tokens=a.served_max_tokens,
                    base_data=a.base_data, base_format=a.base_format,
                    base_served_lengths=a.base_served_lengths, epochs=a.epochs, max_prompt_tokens=a.max_prompt_tokens,
                    work_dir=a.work_dir)


def run_cli(a: argparse.Namespace) -> int:
    from mlflow.exceptions import MlflowException
    from rich.console import Console

    from registry.store import RegistryUnreachable

    con = Console(stderr=True)
    try:
        s = settings_from_args(a)
        while True:
            t0 = time.monotonic()
            try:
                with con.status("retrain: reading feedback, training, judging ..."):
                    out = retrain_once(s)
            except (RegistryUnreachable, MlflowException) as exc:  # a loop outlives a registry outage: next interval
                why = str(exc).splitlines()[0][:300]
                if a.once:
                    raise RetrainError(f"the registry failed: {why}") from None
                con.print(f"retrain: skipped: the registry failed ({why}); trying again in {a.interval:.0f} s")
                time.sleep(a.interval)
                continue
            con.print(f"retrain: {out.action}: {out.reason}")
            if out.counts:
                con.print("  rows: " + ", ".join(f"{k} {v}" for k, v in out.counts.items()))
            for who, m in out.holdout.items():
                con.print(f"  {who}: top-1 {m['accuracy']:.3f}, within-1 {m['accuracy_within_1']:.3f}, "
                          f"MAE {m['mae_tokens']:.1f}, tau {m['kendall_tau']:.3f} on {int(m['n'])} held-out rows")
            if a.output_json:
                with open(a.output_json, "a") as f:
                    f.write(json.dumps({"time": time.time(), **out.__dict__}) + "\n")
            if a.once:
                return 0
            time.sleep(max(0.0, a.interval - (time.monotonic() - t0)))
    except RetrainError as exc:
        print(f"lengthwise retrain: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
