"""What one sidecar holds over time: the serving model version and its hot reload, the batcher, the served
predictions waiting for feedback, the online error windows (and drift alarm) that feedback becomes, and the local
feedback store that keeps it as training data.

The model follows a registry alias: a poller loads a new version in the background and swaps it in atomically
(a batch already running finishes on the model it started with), and a failed load keeps the old one. Separate
from the HTTP layer (predictor/sidecar/app.py) so the routes stay thin and this logic has no FastAPI in it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from monitoring.feedback_store import FeedbackRow, FeedbackStore, FeedbackWriter
from monitoring.online import Feedback, WindowAggregator, WindowStats
from predictor.buckets import BucketScheme
from predictor.features import is_first_turn
from predictor.monitoring_runs import MlflowWindowLogger
from predictor.sidecar.batcher import MicroBatcher
from predictor.sidecar.cache import ModelRef, ResolvedModel, download_version, prune, registry_version, remember_alias
from predictor.sidecar.loading import PredictItem, ServedModel, load_served, predict_fast, predict_items
from predictor.sidecar.metrics import SidecarMetrics
from predictor.sidecar.settings import SidecarSettings

log = logging.getLogger("predictor.sidecar")

MAX_VERSIONS = 8  # model versions whose feedback is still taken and whose online series are kept (the newest loaded)


def prompt_json(turns: list[tuple[str, str]]) -> str:
    """The turns as the predictor encoded them, as compact JSON: ``[["user", "..."], ...]``."""
    return json.dumps([list(t) for t in turns], ensure_ascii=False, separators=(",", ":"))


@dataclass(slots=True)
class ServedPrediction:
    """What a prediction id remembers until its feedback arrives (or the LRU evicts it): enough to score it, and to
    store it as a training row (the prompt only when prompts are kept)."""

    name: str
    version: str
    bucket: int
    expected: float
    quantile_tokens: float
    scheme: BucketScheme
    probs: list[float]
    target: dict | str
    predicted_at: float
    prompt_sha256: str
    turns_json: str | None  # None: --no-store-prompts (or no store)
    used: bool = False
    first_turn: bool | None = None  # the prompt opened its conversation: its online error counts in that slice
    served_model: str | None = None  # the served model the request named: its online error counts in that model's part

    @property
    def size(self) -> int:
        """Bytes held for this prediction beyond the fixed fields (what --lru-mb bounds)."""
        return len(self.turns_json or "") + 8 * len(self.probs)


@dataclass
class DriftState:
    """A version's drift alarm as its last closed window left it."""

    model_name: str
    model_version: str
    alarm: bool
    window_accuracy: float | None
    window_n: int
    window_censored: int
    offline_accuracy: float | None
    margin: float
    since: float | None
    closed_at: float
    models: dict[str, dict] = field(default_factory=dict)  # each served model's part of the window: alarm, accuracy, n


class SidecarState:
    """The served model, the batcher, served-prediction memory and online tracking of one sidecar."""

    def __init__(self, settings: SidecarSettings, ref: ModelRef, resolved: ResolvedModel, metrics: SidecarMetrics):
        self.settings, self.ref, self.resolved, self.metrics = settings, ref, resolved, metrics
        self.model: ServedModel | None = None
        self.load_error: str | None = None
        self.schemes: OrderedDict[tuple[str, str], BucketScheme] = OrderedDict()  # the versions tracked, oldest first
        self.served: OrderedDict[str, ServedPrediction] = OrderedDict()
        self.fed_back: OrderedDict[str, None] = OrderedDict()  # ids whose feedback counted, the last --lru-size
        self.batcher: MicroBatcher[PredictItem, tuple[dict, ServedModel]] = MicroBatcher(
            self._run_batch, settings.max_batch, settings.max_wait_ms / 1000.0, settings.workers, on_batch=self._observe_batch,
            on_expired=self.metrics.expired.inc, spill=self._run_fast if settings.fast_tier else None,
            spill_margin_s=settings.spill_margin_ms / 1000.0, on_spill=self.metrics.spilled.inc)
        self.aggregator = WindowAggregator(settings.window_size, settings.window_seconds, settings.padding,
                                           settings.alarm_margin, key_share=settings.window_key_share,
                                           on_over_share=metrics.over_share.inc)
        self.window_logger = MlflowWindowLogger(on_change=self._observe_buffer)
        self.drift: dict[tuple[str, str], DriftState] = {}
        self._served_bytes = 0
        self.feedback_writer: FeedbackWriter | None = None
        if settings.feedback_store:
            store = FeedbackStore(settings.feedback_db)  # None: $LENGTHWISE_HOME/feedback.db
            self.feedback_writer = FeedbackWriter(store, settings.feedback_max_rows, settings.feedback_max_age_days * 86400.0,
                                                  settings.feedback_queue, on_outcome=self._observe_store,
                                                  on_error=lambda reason: metrics.store_errors.labels(reason).inc())
            log.info("feedback store: %s (%s, up to %d rows and %g days)", store.path,
                     "prompts kept" if settings.store_prompts else "prompt hashes only", settings.feedback_max_rows,
                     settings.feedback_max_age_days)
        self.registry_error: str | None = None  # why the alias cannot be resolved now (registry down, alias gone)
        self.reload_error: str | None = None  # the last failed hot reload, until a reload succeeds
        self._failed: dict[str, float] = {}  # version -> when its load last failed

    # --- model ---------------------------------------------------------------------------------
    def _run_batch(self, items: list[PredictItem]) -> list[tuple[dict, ServedModel]]:
        model = self.model  # one snapshot per batch: a swap never mixes versions inside a batch
        if model is None:
            raise RuntimeError("no model loaded")
        return predict_items(model, items)

    def _run_fast(self, items: list[PredictItem]) -> list[tuple[dict, ServedModel] | None]:
        """Items the encoder could not answer in time, by the served version's fast tier (None where it has none: those
        expire, counted)."""
        model = self.model
        if model is None:
            raise RuntimeError("no model loaded")
        out = predict_fast(model, items)
        if missed := sum(r is None for r in out):
            self.metrics.expired.inc(missed)
        return out

    @property
    def trusted(self) -> bool:
        """Whether callers hold the token (the middleware refused everyone else), so an inline prediction is taken."""
        return self.settings.token is not None

    def swap(self, served: ServedModel) -> None:
        old = self.model
        self._track(served.name, served.version, served.predictor.scheme)
        self.aggregator.set_offline_accuracy(served.name, served.version, served.resolved.offline_accuracy)
        self.model = served  # a reference assignment: atomic for every reader
        self.metrics.set_model(served.name, served.version)
        log.info("serving %s version %s from %s%s", served.name, served.version, served.resolved.path,
                 f" (was version {old.version})" if old else "")

    def _track(self, name: str, version: str, scheme: BucketScheme) -> None:
        """Take feedback for this version; forget the oldest beyond MAX_VERSIONS (their online series too), so the
        versions a feedback may name, and the label series they make, stay few."""
        self.schemes.pop((name, version), None)
        self.schemes[(name, version)] = scheme
        while len(self.schemes) > MAX_VERSIONS:
            (gone_name, gone_version), _ = self.schemes.popitem(last=False)
            self.metrics.forget_version(gone_name, gone_version)
            self.drift.pop((gone_name, gone_version), None)
            log.info("no longer tracking %s version %s (more than %d versions loaded)", gone_name, gone_version, MAX_VERSIONS)

    async def initial_load(self) -> None:
        try:
            self.swap(await asyncio.to_thread(load_served, self.resolved, self.settings))
        except Exception as exc:  # noqa: BLE001 - stay up, not ready; the alias watcher retries
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("could not load %s: %s", self.resolved.path, self.load_error)

    async def watch_alias(self) -> None:
        """Poll the alias; load a moved-to version in the background and swap it in; keep the old one on failure."""
        while True:
            await asyncio.sleep(self.settings.reload_interval)
            try:
                version = await asyncio.to_thread(registry_version, self.ref)
            except Exception as exc:  # noqa: BLE001 - registry down: keep serving what we have
                if self.registry_error is None:
                    log.warning("cannot resolve %s (registry unreachable or alias gone); keep serving: %s", self.ref.uri,
                                " ".join(str(exc).split())[:200])
                self.registry_error = (f"cannot resolve {self.ref.uri} (registry unreachable or alias gone: "
                                       f"{' '.join(str(exc).split())[:200]}); serving the version loaded before")
                continue
            if self.registry_error is not None:
                log.info("registry reachable again")
            self.registry_error = None
            if self.model is not None and version == self.model.version:
                continue
            retry_after = max(5 * self.settings.reload_interval, 60.0)  # a broken version is not reloaded every poll
            if time.monotonic() - self._failed.get(version, -retry_after) < retry_after:
                continue
            try:
                resolved = await asyncio.to_thread(download_version, self.ref.name, version)
                served = await asyncio.to_thread(load_served, resolved, self.settings)
            except Exception as exc:  # noqa: BLE001
                self.metrics.reloads.labels("failed").inc()
                self._failed[version] = time.monotonic()
                self.reload_error = (f"hot reload of {self.ref.name} version {version} failed; still serving version "
                                     f"{self.model.version if self.model else 'none'}: {' '.join(str(exc).split())[:300]}")
                log.error("%s", self.reload_error)
                continue
            self.swap(served)
            self.load_error = self.reload_error = None
            self.metrics.reloads.labels("ok").inc()
            await asyncio.to_thread(remember_alias, self.ref.name, self.ref.alias, version)
            await asyncio.to_thread(prune, self.ref.name, self.settings.cache_versions, (version,))

    # --- served predictions and feedback -------------------------------------------------------
    def remember(self, prediction_id: str, d: dict, model: ServedModel, turns: list[tuple[str, str]],
                 served_model: str | None = None) -> None:
        """Keep what feedback on ``prediction_id`` will need, within --lru-size entries and --lru-mb of prompts."""
        text = prompt_json(turns)
        keep_prompt = self.feedback_writer is not None and self.settings.store_prompts
        entry = ServedPrediction(model.name, model.version, d["bucket"], d["expected_tokens"], d["quantile_tokens"],
                                 model.predictor.scheme, d["probs"], d["target"], time.time(),
                                 hashlib.sha256(text.encode()).hexdigest(), text if keep_prompt else None,
                                 first_turn=is_first_turn(turns), served_model=served_model)
        old = self.served.pop(prediction_id, None)
        if old is not None:
            self._served_bytes -= old.size
        self.fed_back.pop(prediction_id, None)  # a new prediction under an old id: its feedback is new too
        self.served[prediction_id] = entry
        self._served_bytes += entry.size
        budget = self.settings.lru_mb * 2**20
        while len(self.served) > self.settings.lru_size or (self._served_bytes > budget and len(self.served) > 1):
            self._served_bytes -= self.served.popitem(last=False)[1].size

    def fed_back_before(self, prediction_id: str, entry: ServedPrediction | None) -> bool:
        """Whether feedback on this prediction was already counted (a retry, or a replay)."""
        return entry.used if entry is not None else prediction_id in self.fed_back

    def mark_fed_back(self, prediction_id: str, entry: ServedPrediction | None) -> None:
        if entry is not None:
            entry.used = True
        self.fed_back[prediction_id] = None
        self.fed_back.move_to_end(prediction_id)
        while len(self.fed_back) > self.settings.lru_size:
            self.fed_back.popitem(last=False)

    def record(self, fb: Feedback) -> None:
        self.publish(self.aggregator.add(fb))
        total = self.aggregator.totals.get((fb.model_name, fb.model_version))
        if total is not None:
            self.metrics.set_online(fb.model_version, total.metrics())
            self.metrics.set_online_models(fb.model_version, {m: (p.n, p.accuracy) for m, p in total.models.items()})

    def store(self, prediction_id: str, entry: ServedPrediction | None, fb: Feedback) -> bool:
        """Queue the feedback as a training row (never waits); False when there is no store or nothing to store
        (an inline prediction: its prompt was never seen here)."""
        if self.feedback_writer is None:
            return False
        if entry is None:
            self.metrics.store_rows.labels("skipped").inc()
            return False
        scheme = entry.scheme
        row = FeedbackRow(
            prediction_id=prediction_id, time=time.time(), predicted_at=entry.predicted_at, model_name=entry.name,
            model_version=entry.version, target=entry.target if isinstance(entry.target, dict) else None,
            turns=None if entry.turns_json is None else [tuple(t) for t in json.loads(entry.turns_json)],
            prompt_sha256=entry.prompt_sha256, probs=entry.probs, edges=[int(e) for e in scheme.edges[1:]],
            bucket=entry.bucket, expected_tokens=entry.expected, quantile_tokens=entry.quantile_tokens,
            actual_tokens=fb.actual_tokens, finish_reason=fb.finish_reason, censored=fb.censored)
        queued = self.feedback_writer.submit(row)
        self.metrics.store_queue.set(self.feedback_writer.queued)
        return queued

    def publish(self, closed: list[WindowStats]) -> None:
        now = time.time()
        for w in closed:
            key = (w.model_name, w.model_version)
            if key not in self.schemes:  # the last window of a version no longer tracked: logged, not shown
                continue
            self.metrics.online_alarm.labels(w.model_version).set(float(w.alarm))
            self.metrics.drift_alarm.labels(w.model_name, w.model_version).set(float(w.alarm))
            before = self.drift.get(key)
            since = (before.since if before is not None and before.alarm else now) if w.alarm else None
            for served, part in w.models.items():
                self.metrics.model_alarm.labels(w.model_version, served).set(float(part.alarm))
            self.drift[key] = DriftState(w.model_name, w.model_version, w.alarm, w.accuracy, w.n, w.censored,
                                         w.offline_accuracy, w.alarm_margin, since, now,
                                         {m: {"alarm": p.alarm, "window_accuracy": p.accuracy, "window_n": p.n}
                                          for m, p in w.models.items()})
        self.window_logger.submit(closed)

    async def housekeeping(self) -> None:
        """Close windows that reached their time limit even when feedback stops arriving."""
        while True:
            await asyncio.sleep(1.0)
            self.publish(self.aggregator.flush_due())
            self.metrics.queue_depth.set(self.batcher.queued)
            if self.feedback_writer is not None:
                self.metrics.store_queue.set(self.feedback_writer.queued)

    def _observe_batch(self, size: int, seconds: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.batch_seconds.observe(seconds)

    def _observe_buffer(self, buffered: int, dropped: int) -> None:
        self.metrics.windows_buffered.set(buffered)
        self.metrics.windows_dropped.set(dropped)

    def _observe_store(self, outcome: str, rows: int) -> None:
        self.metrics.store_rows.labels(outcome).inc(rows)
