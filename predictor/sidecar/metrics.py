"""Prometheus metrics of the prediction sidecar (``GET /metrics``).

One registry per app instance (not the process-global default), so tests and embedders can build
several apps in one process. Names carry the ``lengthwise_sidecar_`` prefix; online-error gauges are
labelled by model version so a hot swap starts a fresh series instead of blending two models. Every label value
comes from a fixed set or from a version this sidecar loaded (the state keeps the last few and forgets the
series of older ones), never from a request, so a caller cannot grow the number of series.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
ENDPOINTS = ("/v1/predict", "/v1/predict/remaining", "/v1/feedback", "/health", "/ready", "/metrics", "/openapi.json", "/docs")
# Why feedback is refused: a fixed set, so no request can add a label value.
REJECT_REASONS = ("unknown_id", "duplicate", "unknown_version", "out_of_range", "unauthorized")
ONLINE = ("accuracy", "accuracy_within_1", "mae_tokens", "bias_tokens", "under_prediction_rate", "quantile_overrun_rate")


def endpoint_label(path: str) -> str:
    """A request path as a label value: one of ENDPOINTS, or "other" (no caller can add a series)."""
    return path if path in ENDPOINTS else "other"


class SidecarMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "lengthwise_sidecar_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "HTTP request latency by endpoint", ["endpoint"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.predictions = Counter(p + "predictions", "prompts predicted", registry=r)
        self.truncated = Counter(p + "truncated_prompts", "prompts cut to the model's input budget", registry=r)
        self.batch_size = Histogram(p + "batch_size", "prompts per forward pass (micro-batch)", buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram(p + "batch_seconds", "tokenisation + inference time per micro-batch",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "prompts waiting for a micro-batch", registry=r)
        self.expired = Counter(p + "expired_prompts", "prompts dropped unrun because the caller's x-lengthwise-timeout-ms "
                               "passed while they were queued (answered 504: the caller had fallen back already)", registry=r)
        self.spilled = Counter(p + "fast_tier_prompts", "prompts still queued near their caller's x-lengthwise-timeout-ms, "
                               "answered by the package's fast tier instead of the encoder", registry=r)
        self.model_info = Gauge(p + "model_info", "the served model (value 1)", ["name", "version"], registry=r)
        self.model_version = Gauge(p + "model_version", "the served registry version number (-1 if not numeric)", registry=r)
        self.model_ready = Gauge(p + "model_ready", "1 when a model is loaded and serving", registry=r)
        self.reloads = Counter(p + "model_reloads", "hot reload attempts by result", ["result"], registry=r)
        self.feedback = Counter(p + "feedback", "feedback received by source", ["source"], registry=r)
        self.feedback_rejected = Counter(p + "feedback_rejected", "feedback that changed nothing, by reason: unknown_id "
                                         "(never served here, or forgotten), duplicate (already counted), unknown_version "
                                         "(a model version this sidecar does not serve), out_of_range (actual_tokens or "
                                         "the inline prediction impossible), unauthorized (no or a wrong token)",
                                         ["reason"], registry=r)
        for reason in REJECT_REASONS:
            self.feedback_rejected.labels(reason)
        self.over_share = Counter(p + "feedback_over_share", "feedback kept out of its open online-error window because "
                                  "its client key already holds --window-key-share of that window (still stored as a "
                                  "training row and counted in the totals)", registry=r)
        self.unauthorized = Counter(p + "unauthorized", "requests refused with 401 (no or a wrong bearer token), by endpoint",
                                    ["endpoint"], registry=r)
        self.online = {k: Gauge(f"lengthwise_online_{k}", f"online {k} since start, from feedback", ["model_version"], registry=r)
                       for k in ONLINE}
        self.online_n = Gauge("lengthwise_online_feedback_n", "feedbacks counted in the online metrics", ["model_version"],
                              registry=r)
        self.online_alarm = Gauge("lengthwise_online_accuracy_alarm",
                                  "1 when the last closed window's accuracy fell below offline accuracy minus the margin",
                                  ["model_version"], registry=r)
        self.windows_buffered = Gauge("lengthwise_online_windows_buffered", "closed windows waiting to be logged to MLflow",
                                      registry=r)
        self.windows_dropped = Gauge("lengthwise_online_windows_dropped", "windows dropped because the MLflow buffer was full",
                                     registry=r)
        self.online_censored = Gauge("lengthwise_online_feedback_censored", "feedbacks of answers cut short (finish reason "
                                     "length, abort, ...): lower bounds on the true length", ["model_version"], registry=r)
        self.drift_alarm = Gauge("lengthwise_predictor_drift_alarm", "1 while the last closed window's top-1 accuracy is below "
                                 "the version's offline accuracy minus the alarm margin", ["model", "version"], registry=r)
        self.model_accuracy = Gauge("lengthwise_online_model_accuracy", "online top-1 accuracy since start of the "
                                    "requests for one served model", ["model_version", "served_model"], registry=r)
        self.model_n = Gauge("lengthwise_online_model_feedback_n", "feedbacks counted for one served model",
                             ["model_version", "served_model"], registry=r)
        self.model_alarm = Gauge("lengthwise_online_model_accuracy_alarm", "1 when the last closed window's accuracy on one "
                                 "served model's requests fell below offline accuracy minus the margin",
                                 ["model_version", "served_model"], registry=r)
        self._models: dict[str, set[str]] = {}  # version -> the served models it has series for
        self.store_rows = Counter(p + "feedback_store_rows", "feedback rows by what became of them in the local store: "
                                  "written, dropped (writer queue full), failed (write error), pruned (retention), "
                                  "skipped (no prompt known: the prediction was not served here)", ["outcome"], registry=r)
        self.store_errors = Counter(p + "feedback_store_errors", "failed writes to the feedback store by cause: locked, "
                                    "disk_full, read_only, io, error", ["reason"], registry=r)
        self.store_queue = Gauge(p + "feedback_store_queue", "feedback rows waiting for the store's writer", registry=r)
        self._served: tuple[str, str] | None = None

    def set_model(self, name: str, version: str) -> None:
        if self._served is not None:
            self.model_info.remove(*self._served)
        self._served = (name, version)
        self.model_info.labels(name, version).set(1)
        self.model_version.set(float(version) if version.isdigit() else -1.0)
        self.model_ready.set(1)

    def set_online(self, version: str, metrics: dict[str, float]) -> None:
        self.online_n.labels(version).set(metrics.get("n", 0.0))
        self.online_censored.labels(version).set(metrics.get("censored", 0.0))
        for k, g in self.online.items():
            if k in metrics:
                g.labels(version).set(metrics[k])

    def set_online_models(self, version: str, per_model: dict[str, tuple[int, float | None]]) -> None:
        """Each served model's feedback count and online accuracy since start (None: nothing decided yet), for the
        served models a window keeps apart, so the series stay few."""
        for served, (n, accuracy) in per_model.items():
            self._models.setdefault(version, set()).add(served)
            self.model_n.labels(version, served).set(n)
            if accuracy is not None:
                self.model_accuracy.labels(version, served).set(accuracy)

    def count_unauthorized(self, path: str) -> None:
        self.unauthorized.labels(endpoint_label(path)).inc()
        if path == "/v1/feedback":
            self.feedback_rejected.labels("unauthorized").inc()

    def forget_version(self, name: str, version: str) -> None:
        """Drop the online series of a version the sidecar no longer tracks."""
        for g in (*self.online.values(), self.online_n, self.online_censored, self.online_alarm):
            g.remove(version)
        self.drift_alarm.remove(name, version)
        for served in self._models.pop(version, set()):
            for g in (self.model_accuracy, self.model_n, self.model_alarm):
                with contextlib.suppress(KeyError):  # a series never set (no closed window yet)
                    g.remove(version, served)

    def render(self) -> bytes:
        return generate_latest(self.registry)
