"""Online prediction error: feedback (predicted vs actual output length) aggregated in windows, and the drift alarm.

Offline accuracy is measured once on a held-out split; traffic drifts. The serving endpoint posts the
actual output length of each answered request back to the sidecar, which folds it into the same
metrics the offline evaluation reports (top-1 and within-one bucket accuracy, MAE, signed bias,
under-prediction at the padding) so the two can be read side by side. A window closes after
``window_size`` feedbacks or ``window_seconds``, whichever comes first; each closed window becomes one
step of the run's metric history. When a window's accuracy falls more than ``alarm_margin`` below the
version's offline accuracy (its ``accuracy`` tag), the window carries ``online_accuracy_alarm = 1`` and
a warning is logged.

A censored feedback (the engine cut the answer: ``finish_reason`` "length" at max_tokens, "abort", ...) says only
that the true length T is at least the actual count a. It counts in ``n`` and in ``censored``, and in each metric
only where that metric's outcome is already decided by T >= a, because counting a as the truth would call every
capped answer a hit of its cap (a run whose answers were capped once showed a bias of +200 tokens and no
under-prediction, both false):

- top-1 and within-1: decided when every bucket T can still fall in (the bucket of a, up to the last, open
  bucket) gives the same answer: the predicted bucket below a's bucket (within-1: more than one below) is known
  wrong; the last bucket predicted for an answer already in it is known right; otherwise left out;
- MAE and bias: counted only when the expected length is below a (a known under-prediction), at the smallest
  error it can have, ``expected - a``; with censored feedback MAE is thus a lower bound and bias an upper bound,
  and a capped answer never makes bias positive;
- under-prediction (and the quantile overrun): counted when a already exceeds the padded expected length (the
  quantile), known under; otherwise left out, since the answer may yet have outgrown it.

Each metric's denominator is logged beside it (``accuracy_n``, ...), so windows merge by what each one counted.

A feedback whose prompt is known (the sidecar keeps each prediction's turns) also counts in its slice: a
conversation's first turn, or a later turn, whose previous answers make the length much easier to guess. Each window
logs top-1 and MAE per slice (``first_turn_accuracy``, ``later_turns_mae_tokens``, ... with their denominators), so
online error reads per slice as the offline report does.

A feedback whose request named a served model (``model`` of the prediction request: a catalogue serves several, and
one predictor may answer for all of them) also counts in that model's part of the window: each logs its own top-1,
MAE, bias and alarm (``model.<name>.accuracy``, ``model.<name>.accuracy_alarm``, ...), because a predictor that drifts
on one service, an adapter retrained to answer longer, is hidden in the total while the others still fit.

Only the arithmetic is here, no MLflow: the sidecar hands closed windows to a :class:`monitoring.window_log.WindowLogger`
that writes them to one MLflow run per model version (:mod:`predictor.monitoring_runs`, which also reads them back),
and :func:`merge_windows` and :func:`drift_state` total what was read back.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# The metric names of a window, in report order; every one is logged with the prefix "online_".
WINDOW_METRICS = ("n", "censored", "accuracy", "accuracy_within_1", "mae_tokens", "bias_tokens", "under_prediction_rate",
                  "quantile_overrun_rate", "accuracy_alarm")
# Rates and their denominators: a censored feedback counts only in the metrics its outcome is decided for.
RATES = {"accuracy": "accuracy_n", "accuracy_within_1": "within_1_n", "mae_tokens": "error_n", "bias_tokens": "error_n",
         "under_prediction_rate": "under_n", "quantile_overrun_rate": "quantile_n"}
# Finish reasons (OpenAI's and vLLM's): the model chose to stop, or the answer was cut and its length is a lower bound.
FINISHED = ("stop", "tool_calls", "function_call")
CUT = ("length", "abort", "content_filter", "error")
FINISH_REASONS = FINISHED + CUT
# The slices every evaluation reports apart (training.evaluate's): a conversation's first turn and its later turns.
SLICES = ("first_turn", "later_turns")
SLICE_METRICS = ("accuracy", "accuracy_within_1", "mae_tokens", "bias_tokens")
MAX_SERVED_MODELS = 64  # served models a window keeps apart (the name comes with the request: the rest count in the total)
MODEL_PREFIX = "model."  # a served model's metrics in a window: model.<name>.<metric>
MODEL_METRICS = ("n", "censored", "accuracy", "accuracy_n", "mae_tokens", "bias_tokens", "error_n", "accuracy_alarm")


def metric_name(served_model: str) -> str:
    """A served model's name as an MLflow metric key may hold it (letters, digits, ``_-. /``; the rest become ``_``)."""
    return re.sub(r"[^\w\-. /]", "_", served_model)


@dataclass
class Feedback:
    """One answered request: what was predicted and how many tokens the engine actually generated."""

    model_name: str
    model_version: str
    bucket: int
    true_bucket: int  # the bucket of actual_tokens (for a censored answer: the lowest bucket the true length can be in)
    expected_tokens: float
    quantile_tokens: float | None
    actual_tokens: int
    finish_reason: str | None = None  # None: not reported, taken as finished
    n_buckets: int | None = None  # the scheme's bucket count: the last bucket is open, so an answer in it stays there
    first_turn: bool | None = None  # the prompt opened its conversation (None: prompt not known)
    client: str | None = None  # which client key the answer went to (None: not told): one key's share of a window is capped
    served_model: str | None = None  # the served model the request named (None: not told)

    @property
    def slice(self) -> str | None:
        return None if self.first_turn is None else SLICES[0] if self.first_turn else SLICES[1]

    @property
    def censored(self) -> bool:
        """The answer was cut: the true length is at least ``actual_tokens``."""
        return self.finish_reason in CUT


def _within(bucket: int, lowest: int, last: int | None, k: int) -> bool | None:
    """Whether the true bucket is within ``k`` of ``bucket``, when the true bucket is only known to be ``lowest`` or
    above (up to ``last``, the open bucket, when known): decided when all those buckets agree, else None."""
    if bucket + k < lowest:
        return False  # the answer already outgrew the prediction
    if last is not None and bucket - k <= lowest and last <= bucket + k:
        return True  # every bucket the answer can still end in is close enough
    return None


@dataclass
class WindowStats:
    """Sums over a window; metrics are derived, so windows merge exactly (for reports and totals)."""

    model_name: str
    model_version: str
    n: int = 0
    censored: int = 0
    correct: int = 0
    accuracy_n: int = 0
    within_1: int = 0
    within_1_n: int = 0
    abs_err: float = 0.0
    err: float = 0.0
    error_n: int = 0
    under: int = 0
    under_n: int = 0
    quantile_n: int = 0
    quantile_over: int = 0
    opened: float = field(default_factory=time.time)
    offline_accuracy: float | None = None
    alarm_margin: float = 0.1
    min_alarm_n: int = 20
    slices: dict[str, WindowStats] = field(default_factory=dict)  # the same sums per slice (SLICES)
    clients: dict[str, int] = field(default_factory=dict)  # feedbacks counted per client key
    models: dict[str, WindowStats] = field(default_factory=dict)  # the same sums per served model, each with its alarm

    def add(self, fb: Feedback, padding: float) -> None:
        # what a part (a slice, a served model) counts: the feedback without what splits it into parts
        bare = Feedback(**{**fb.__dict__, "first_turn": None, "client": None, "served_model": None})
        if fb.slice is not None:
            part = self.slices.get(fb.slice)
            if part is None:
                part = self.slices[fb.slice] = WindowStats(self.model_name, self.model_version)
            part.add(bare, padding)
        if fb.served_model is not None and (fb.served_model in self.models or len(self.models) < MAX_SERVED_MODELS):
            own = self.models.get(fb.served_model)
            if own is None:
                own = self.models[fb.served_model] = WindowStats(self.model_name, self.model_version,
                                                                 offline_accuracy=self.offline_accuracy,
                                                                 alarm_margin=self.alarm_margin, min_alarm_n=self.min_alarm_n)
            own.add(bare, padding)
        if fb.client is not None:
            self.clients[fb.client] = self.clients.get(fb.client, 0) + 1
        self.n += 1
        e = fb.expected_tokens - fb.actual_tokens
        under = fb.actual_tokens > fb.expected_tokens * (1.0 + padding)
        over_q = fb.quantile_tokens is not None and fb.actual_tokens > fb.quantile_tokens
        if not fb.censored:
            self._count(fb.bucket == fb.true_bucket, abs(fb.bucket - fb.true_bucket) <= 1, e, under,
                        over_q if fb.quantile_tokens is not None else None)
            return
        self.censored += 1
        last = None if fb.n_buckets is None else fb.n_buckets - 1
        self._count(_within(fb.bucket, fb.true_bucket, last, 0), _within(fb.bucket, fb.true_bucket, last, 1),
                    e if e < 0 else None, True if under else None,
                    True if over_q else None)

    def _count(self, correct: bool | None, within_1: bool | None, err: float | None, under: bool | None,
               over_q: bool | None) -> None:
        """Fold in the outcomes that are known (None: undecided, left out of that metric)."""
        if correct is not None:
            self.accuracy_n += 1
            self.correct += int(correct)
        if within_1 is not None:
            self.within_1_n += 1
            self.within_1 += int(within_1)
        if err is not None:
            self.error_n += 1
            self.abs_err += abs(err)
            self.err += err
        if under is not None:
            self.under_n += 1
            self.under += int(under)
        if over_q is not None:
            self.quantile_n += 1
            self.quantile_over += int(over_q)

    @property
    def accuracy(self) -> float | None:
        return self.correct / self.accuracy_n if self.accuracy_n else None

    @property
    def alarm(self) -> bool:
        """Online accuracy more than the margin below offline, on enough decided feedback to mean something."""
        return (self.offline_accuracy is not None and self.accuracy_n >= self.min_alarm_n
                and self.correct / self.accuracy_n < self.offline_accuracy - self.alarm_margin)

    def metrics(self) -> dict[str, float]:
        if not self.n:
            return {"n": 0.0}
        out = {"n": float(self.n), "censored": float(self.censored)}
        sums = {"accuracy": self.correct, "accuracy_within_1": self.within_1, "mae_tokens": self.abs_err,
                "bias_tokens": self.err, "under_prediction_rate": self.under, "quantile_overrun_rate": self.quantile_over}
        for k, total in sums.items():
            denom = getattr(self, RATES[k])
            out[RATES[k]] = float(denom)
            if denom:
                out[k] = total / denom
        out["accuracy_alarm"] = float(self.alarm)
        for name, part in self.slices.items():
            m = part.metrics()
            out[f"{name}_n"] = m["n"]
            for k in SLICE_METRICS:
                out[f"{name}_{RATES[k]}"] = m[RATES[k]]
                if k in m:
                    out[f"{name}_{k}"] = m[k]
        for served, part in self.models.items():
            m = part.metrics()
            out.update({f"{MODEL_PREFIX}{metric_name(served)}.{k}": m[k] for k in MODEL_METRICS if k in m})
        if self.offline_accuracy is not None:
            out["offline_accuracy"] = self.offline_accuracy
            out["alarm_margin"] = self.alarm_margin
        return out


class WindowAggregator:
    """Per model version, the open window and the running total; returns windows as they close."""

    def __init__(self, window_size: int = 100, window_seconds: float = 60.0, padding: float = 0.15,
                 alarm_margin: float = 0.1, min_alarm_n: int = 20, key_share: float = 1.0,
                 on_over_share: Callable[[], None] | None = None):
        """``key_share``: the most of a window (of ``window_size``) one client key's feedback may fill; what is over it
        stays out of the open window (``on_over_share`` is called) but counts in the running total. Why: feedback is
        the client's answer, so one key holder choosing prompts could otherwise fill whole windows and raise the alarm."""
        if window_size < 1 or window_seconds <= 0:
            raise ValueError("window_size must be >= 1 and window_seconds > 0")
        if not 0 < key_share <= 1:
            raise ValueError("key_share must be in (0, 1]")
        self.window_size, self.window_seconds, self.padding = window_size, window_seconds, padding
        self.key_cap = max(1, int(key_share * window_size)) if key_share < 1 else None
        self._on_over_share = on_over_share
        self.alarm_margin, self.min_alarm_n = alarm_margin, min_alarm_n
        self._open: dict[tuple[str, str], WindowStats] = {}
        self.totals: dict[tuple[str, str], WindowStats] = {}
        self.offline: dict[tuple[str, str], float | None] = {}
        self._lock = threading.Lock()

    def set_offline_accuracy(self, name: str, version: str, accuracy: float | None) -> None:
        with self._lock:
            self.offline[(name, version)] = accuracy

    def _new(self, key: tuple[str, str]) -> WindowStats:
        return WindowStats(key[0], key[1], offline_accuracy=self.offline.get(key), alarm_margin=self.alarm_margin,
                           min_alarm_n=self.min_alarm_n)

    def add(self, fb: Feedback) -> list[WindowStats]:
        """Fold one feedback in; returns the windows that closed (by count, or by age of any open window)."""
        key = (fb.model_name, fb.model_version)
        with self._lock:
            w = self._open.get(key)
            if w is None:
                w = self._open[key] = self._new(key)
            if self.key_cap is not None and fb.client is not None and w.clients.get(fb.client, 0) >= self.key_cap:
                if self._on_over_share is not None:
                    self._on_over_share()
            else:
                w.add(fb, self.padding)
            total = self.totals.get(key)
            if total is None:
                total = self.totals[key] = self._new(key)
            total.add(fb, self.padding)
            closed = self._close_locked(lambda k, win: win.n >= self.window_size or
                                        time.time() - win.opened >= self.window_seconds)
        return closed

    def flush_due(self, force: bool = False) -> list[WindowStats]:
        """Close windows older than ``window_seconds`` (all non-empty ones with ``force``)."""
        with self._lock:
            return self._close_locked(lambda k, win: force or time.time() - win.opened >= self.window_seconds)

    def _close_locked(self, due: Callable[[tuple[str, str], WindowStats], bool]) -> list[WindowStats]:
        closed = []
        for key, win in list(self._open.items()):
            if win.n and due(key, win):
                closed.append(win)
                del self._open[key]
        for win in closed:
            if win.alarm:
                log.warning("online accuracy alarm: %s version %s: %.3f on the last %d feedbacks (%d censored), offline %.3f "
                            "(margin %.2f)", win.model_name, win.model_version, win.accuracy, win.n, win.censored,
                            win.offline_accuracy, win.alarm_margin)
            for served, part in win.models.items():
                if part.alarm:
                    log.warning("online accuracy alarm for the served model %s: %s version %s: %.3f on its %d feedbacks "
                                "of the last window, offline %.3f (margin %.2f)", served, win.model_name, win.model_version,
                                part.accuracy, part.n, win.offline_accuracy, win.alarm_margin)
        return closed


def merge_windows(rows: list[dict]) -> dict[str, float]:
    """Totals over logged windows (what all the windows together say): each rate weighted by the feedback it counted
    (its denominator, ``n`` for windows logged before censoring was tracked)."""
    n = sum(r.get("n", 0) for r in rows)
    if not n:
        return {"n": 0.0}
    out = {"n": float(n), "censored": float(sum(r.get("censored", 0.0) for r in rows))}
    for k, denom in RATES.items():
        have = [(r[k], r.get(denom, r["n"])) for r in rows if k in r]
        w = sum(d for _, d in have)
        if w:
            out[k] = sum(v * d for v, d in have) / w
    out["alarm_windows"] = float(sum(r.get("accuracy_alarm", 0.0) for r in rows))
    for name in SLICES:
        if sum(r.get(f"{name}_n", 0.0) for r in rows):
            out[f"{name}_n"] = float(sum(r.get(f"{name}_n", 0.0) for r in rows))
        for k in SLICE_METRICS:
            have = [(r[f"{name}_{k}"], r[f"{name}_{RATES[k]}"]) for r in rows if f"{name}_{k}" in r]
            if (w := sum(d for _, d in have)):
                out[f"{name}_{k}"] = sum(v * d for v, d in have) / w
    for served in served_models(rows):
        p = f"{MODEL_PREFIX}{served}."
        out[p + "n"] = float(sum(r.get(p + "n", 0.0) for r in rows))
        out[p + "alarm_windows"] = float(sum(r.get(p + "accuracy_alarm", 0.0) for r in rows))
        for k, denom in (("accuracy", "accuracy_n"), ("mae_tokens", "error_n"), ("bias_tokens", "error_n")):
            have = [(r[p + k], r[p + denom]) for r in rows if p + k in r and p + denom in r]
            if (w := sum(d for _, d in have)):
                out[p + k] = sum(v * d for v, d in have) / w
    return out


def served_models(rows: list[dict]) -> list[str]:
    """The served models (as metric keys name them) that logged windows hold parts of."""
    return sorted({k[len(MODEL_PREFIX):].rsplit(".", 1)[0] for r in rows for k in r if k.startswith(MODEL_PREFIX)})


def drift_state(rows: list[dict]) -> dict:
    """The alarm as the logged windows leave it: ``{"alarm", "window_accuracy", "offline_accuracy", "margin",
    "since", "models"}`` from the last window; ``since`` (ms) is when the run of alarming windows that ends there began;
    ``models``: each served model's part of that window (its alarm, accuracy and feedback count)."""
    if not rows:
        return {"alarm": False, "window_accuracy": None, "offline_accuracy": None, "margin": None, "since": None,
                "models": {}}
    last = rows[-1]
    since = None
    for r in reversed(rows):
        if not r.get("accuracy_alarm"):
            break
        since = r["timestamp"]
    models = {m: {"alarm": bool(last.get(f"{MODEL_PREFIX}{m}.accuracy_alarm")),
                  "window_accuracy": last.get(f"{MODEL_PREFIX}{m}.accuracy"), "window_n": last.get(f"{MODEL_PREFIX}{m}.n")}
              for m in served_models([last])}
    return {"alarm": bool(last.get("accuracy_alarm")), "window_accuracy": last.get("accuracy"),
            "offline_accuracy": last.get("offline_accuracy"), "margin": last.get("alarm_margin"), "since": since,
            "models": models}
