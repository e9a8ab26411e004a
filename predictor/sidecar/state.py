"""What one sidecar holds over time: the serving model version and its hot reload, the batcher, the served
predictions waiting for feedback, and the online error windows that feedback becomes.

The model follows a registry alias: a poller loads a new version in the background and swaps it in atomically
(a batch already running finishes on the model it started with), and a failed load keeps the old one. Separate
from the HTTP layer (predictor/sidecar/app.py) so the routes stay thin and this logic has no FastAPI in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from predictor.buckets import BucketScheme
from predictor.sidecar.batcher import MicroBatcher
from predictor.sidecar.cache import ModelRef, ResolvedModel, download_version, registry_version, remember_alias
from predictor.sidecar.loading import PredictItem, ServedModel, load_served, predict_items
from predictor.sidecar.metrics import SidecarMetrics
from predictor.sidecar.settings import SidecarSettings
from registry.online import Feedback, MlflowWindowLogger, WindowAggregator, WindowStats

log = logging.getLogger("predictor.sidecar")


class ServedPrediction:
    """What a prediction id remembers until its feedback arrives (or the LRU evicts it)."""

    __slots__ = ("bucket", "expected", "name", "quantile_tokens", "scheme", "used", "version")

    def __init__(self, name: str, version: str, bucket: int, expected: float, quantile_tokens: float, scheme: BucketScheme):
        self.name, self.version, self.bucket, self.expected = name, version, bucket, expected
        self.quantile_tokens, self.scheme, self.used = quantile_tokens, scheme, False


class SidecarState:
    """The served model, the batcher, served-prediction memory and online tracking of one sidecar."""

    def __init__(self, settings: SidecarSettings, ref: ModelRef, resolved: ResolvedModel, metrics: SidecarMetrics):
        self.settings, self.ref, self.resolved, self.metrics = settings, ref, resolved, metrics
        self.model: ServedModel | None = None
        self.load_error: str | None = None
        self.schemes: dict[tuple[str, str], BucketScheme] = {}
        self.served: OrderedDict[str, ServedPrediction] = OrderedDict()
        self.batcher: MicroBatcher[PredictItem, tuple[dict, ServedModel]] = MicroBatcher(
            self._run_batch, settings.max_batch, settings.max_wait_ms / 1000.0, settings.workers, on_batch=self._observe_batch)
        self.aggregator = WindowAggregator(settings.window_size, settings.window_seconds, settings.padding,
                                           settings.alarm_margin)
        self.window_logger = MlflowWindowLogger(on_change=self._observe_buffer)
        self._registry_down = False
        self._failed: dict[str, float] = {}  # version -> when its load last failed

    # --- model ---------------------------------------------------------------------------------
    def _run_batch(self, items: list[PredictItem]) -> list[tuple[dict, ServedModel]]:
        model = self.model  # one snapshot per batch: a swap never mixes versions inside a batch
        if model is None:
            raise RuntimeError("no model loaded")
        return predict_items(model, items)

    def swap(self, served: ServedModel) -> None:
        old = self.model
        self.schemes[(served.name, served.version)] = served.predictor.scheme
        self.aggregator.set_offline_accuracy(served.name, served.version, served.resolved.offline_accuracy)
        self.model = served  # a reference assignment: atomic for every reader
        self.metrics.set_model(served.name, served.version)
        log.info("serving %s version %s from %s%s", served.name, served.version, served.resolved.path,
                 f" (was version {old.version})" if old else "")

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
                if not self._registry_down:
                    log.warning("cannot resolve %s (registry unreachable or alias gone); keep serving: %s", self.ref.uri,
                                " ".join(str(exc).split())[:200])
                self._registry_down = True
                continue
            if self._registry_down:
                log.info("registry reachable again")
            self._registry_down = False
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
                log.error("hot reload of %s version %s failed; still serving version %s: %s", self.ref.name, version,
                          self.model.version if self.model else "none", " ".join(str(exc).split())[:300])
                continue
            self.swap(served)
            self.load_error = None
            self.metrics.reloads.labels("ok").inc()
            await asyncio.to_thread(remember_alias, self.ref.name, self.ref.alias, version)

    # --- served predictions and feedback -------------------------------------------------------
    def remember(self, prediction_id: str, d: dict, model: ServedModel) -> None:
        self.served[prediction_id] = ServedPrediction(model.name, model.version, d["bucket"], d["expected_tokens"],
                                             d["quantile_tokens"], model.predictor.scheme)
        self.served.move_to_end(prediction_id)
        while len(self.served) > self.settings.lru_size:
            self.served.popitem(last=False)

    def record(self, fb: Feedback) -> None:
        self.publish(self.aggregator.add(fb))
        total = self.aggregator.totals.get((fb.model_name, fb.model_version))
        if total is not None:
            self.metrics.set_online(fb.model_version, total.metrics())

    def publish(self, closed: list[WindowStats]) -> None:
        for w in closed:
            self.metrics.online_alarm.labels(w.model_version).set(float(w.alarm))
        self.window_logger.submit(closed)

    async def housekeeping(self) -> None:
        """Close windows that reached their time limit even when feedback stops arriving."""
        while True:
            await asyncio.sleep(1.0)
            self.publish(self.aggregator.flush_due())
            self.metrics.queue_depth.set(self.batcher.queued)

    def _observe_batch(self, size: int, seconds: float) -> None:
        self.metrics.batch_size.observe(size)
        self.metrics.batch_seconds.observe(seconds)

    def _observe_buffer(self, buffered: int, dropped: int) -> None:
        self.metrics.windows_buffered.set(buffered)
        self.metrics.windows_dropped.set(dropped)
