"""``predictor-sidecar``: the length predictor as an HTTP service beside the engines (SPEC §1.2, §2).

The gateway asks ``POST /v1/predict`` for every request and posts the actual output length to
``POST /v1/feedback`` when the answer is done. Concurrent requests are micro-batched into shared
forward passes (predictor/batcher.py); tokenisation and inference run in one worker thread so the
event loop keeps answering. The served version follows a registry alias: a poller loads a new
version in the background and swaps it in atomically (a batch already running finishes on the model
it started with), and a failed load keeps the old one. Resolved packages are cached under
``$LENGTHWISE_HOME/cache/models`` (predictor/cache.py) so a restart works with the registry down.
Feedback becomes online error windows in MLflow (registry/online.py) and gauges on ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import queue
import socket
import sys
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from predictor.buckets import BucketScheme
from predictor.runtime import OnnxLengthPredictor, softmax
from predictor.sidecar.batcher import MicroBatcher
from predictor.sidecar.cache import (
    ModelRef,
    ModelResolveError,
    ResolvedModel,
    download_version,
    parse_uri,
    registry_version,
    remember_alias,
    resolve,
)
from predictor.sidecar.metrics import SidecarMetrics
from predictor.sidecar.schemas import (
    ErrorResponse,
    FeedbackRequest,
    FeedbackResponse,
    Health,
    PredictRequest,
    PredictResponse,
    Ready,
)
from registry.online import Feedback, MlflowWindowLogger, WindowAggregator, WindowStats

log = logging.getLogger("predictor.sidecar")

DEFAULT_MODEL = "models:/length-predictor@champion"
ENDPOINTS = ("/v1/predict", "/v1/feedback", "/health", "/ready", "/metrics", "/openapi.json", "/docs")


@dataclass
class SidecarSettings:
    """Everything the CLI can set; the defaults suit a small CPU machine."""

    model: str = DEFAULT_MODEL
    host: str = "127.0.0.1"
    port: int = 8100
    max_batch: int = 32  # prompts per forward pass
    max_wait_ms: float = 2.0  # longest a prompt waits for others to share its batch
    reload_interval: float = 30.0  # seconds between alias polls; 0 disables hot reload
    threads: int | None = None  # onnxruntime intra-op threads (default: LENGTHWISE_ORT_THREADS or min(4, cores))
    workers: int = 1  # batches run side by side, each on its own session with `threads` threads
    token_budget: int = 256  # padded tokens per onnxruntime run: small runs stay in cache (measured: 2048 costs ~1.5x CPU)
    precision: str = "fp32"  # int8: dynamically quantized weights (~1.7x predictions/s on this CPU)
    ort_spin: bool = False  # busy-waiting onnxruntime threads: lower latency on an idle machine, wasted CPU on a shared one
    max_body_bytes: int = 1 << 20
    lru_size: int = 100_000  # served predictions remembered for feedback by id
    window_size: int = 100  # feedbacks per online-error window
    window_seconds: float = 60.0  # ... or this much time, whichever comes first
    alarm_margin: float = 0.10  # alarm when online accuracy < offline accuracy - margin
    padding: float = 0.15  # under-prediction: actual > expected x (1 + padding), as offline
    log_level: str = "info"


@dataclass(frozen=True)
class ServedModel:
    """One loaded version: an onnxruntime session per inference worker (sessions are not shared between
    concurrent batches, so each runs single-owner at full speed)."""

    sessions: queue.SimpleQueue
    predictor: OnnxLengthPredictor  # the first session; scheme, tokenizer and input format are the same in all
    resolved: ResolvedModel

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def version(self) -> str:
        return self.resolved.version


def load_served(resolved: ResolvedModel, settings: SidecarSettings) -> ServedModel:
    """Open one ONNX session per worker and run a warm-up prediction on each, so no request pays for it."""
    sessions: queue.SimpleQueue = queue.SimpleQueue()
    preds = [OnnxLengthPredictor(resolved.path, threads=settings.threads, batch_size=settings.max_batch,
                                 token_budget=settings.token_budget, spin=settings.ort_spin, precision=settings.precision)
             for _ in range(settings.workers)]
    for pred in preds:
        pred.predict(["warm-up"])
        sessions.put(pred)
    return ServedModel(sessions, preds[0], resolved)


@dataclass(frozen=True)
class _Item:
    turns: list[tuple[str, str]]
    quantile: float


class _Served:
    """What a prediction id remembers until its feedback arrives (or the LRU evicts it)."""

    __slots__ = ("bucket", "expected", "name", "quantile_tokens", "scheme", "used", "version")

    def __init__(self, name: str, version: str, bucket: int, expected: float, quantile_tokens: float, scheme: BucketScheme):
        self.name, self.version, self.bucket, self.expected = name, version, bucket, expected
        self.quantile_tokens, self.scheme, self.used = quantile_tokens, scheme, False


def predict_items(model: ServedModel, items: list[_Item]) -> list[tuple[dict[str, Any], ServedModel]]:
    """One micro-batch: tokenise each prompt once, one onnxruntime pass (grouped by length), per-item quantiles."""
    pred = model.sessions.get()  # at most `workers` batches run at once, so one is always free
    try:
        encoded = pred.encode([it.turns for it in items])
        probs = softmax(pred.logits_encoded([e.ids for e in encoded]).astype(np.float64))
    finally:
        model.sessions.put(pred)
    scheme = pred.scheme
    expected = scheme.expected(probs)
    buckets = probs.argmax(1)
    qs = np.array([it.quantile for it in items])
    quant = np.empty(len(items))
    for q in np.unique(qs):
        sel = qs == q
        quant[sel] = scheme.quantile(probs[sel], float(q))
    upper = scheme.upper()
    out = []
    for i, e in enumerate(encoded):
        b = int(buckets[i])
        out.append(({
            "bucket": b, "range": [int(scheme.edges[b]), int(upper[b])], "probs": probs[i].tolist(),
            "expected_tokens": float(expected[i]), "quantile": float(qs[i]), "quantile_tokens": float(quant[i]),
            "truncated": bool(e.truncated), "prompt_tokens": len(e.ids), "model_name": model.name,
            "model_version": model.version,
        }, model))
    return out


class SidecarState:
    """The served model, the batcher, served-prediction memory and online tracking of one sidecar."""

    def __init__(self, settings: SidecarSettings, ref: ModelRef, resolved: ResolvedModel, metrics: SidecarMetrics):
        self.settings, self.ref, self.resolved, self.metrics = settings, ref, resolved, metrics
        self.model: ServedModel | None = None
        self.load_error: str | None = None
        self.schemes: dict[tuple[str, str], BucketScheme] = {}
        self.served: OrderedDict[str, _Served] = OrderedDict()
        self.batcher: MicroBatcher[_Item, tuple[dict, ServedModel]] = MicroBatcher(
            self._run_batch, settings.max_batch, settings.max_wait_ms / 1000.0, settings.workers, on_batch=self._observe_batch)
        self.aggregator = WindowAggregator(settings.window_size, settings.window_seconds, settings.padding,
                                           settings.alarm_margin)
        self.window_logger = MlflowWindowLogger(on_change=self._observe_buffer)
        self._registry_down = False
        self._failed: dict[str, float] = {}  # version -> when its load last failed

    # --- model ---------------------------------------------------------------------------------
    def _run_batch(self, items: list[_Item]) -> list[tuple[dict, ServedModel]]:
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
        self.served[prediction_id] = _Served(model.name, model.version, d["bucket"], d["expected_tokens"],
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


class _BodyLimitAndMetrics:
    """ASGI middleware: 413 for bodies over the limit (declared or streamed), and request count/latency."""

    def __init__(self, app, max_body_bytes: int, metrics: SidecarMetrics):
        self.app, self.max_body, self.metrics = app, max_body_bytes, metrics

    async def _reject(self, send, status: int, detail: str) -> None:
        import json

        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        endpoint = scope["path"] if scope["path"] in ENDPOINTS else "other"
        status = 500
        too_large = False
        replaced = False
        limit_msg = f"request body exceeds {self.max_body} bytes"

        async def send_wrapper(msg) -> None:
            nonlocal status, replaced
            if too_large:  # swallow the app's answer to a cut-off body; say what really happened
                if msg["type"] == "http.response.start" and not replaced:
                    replaced, status = True, 413
                    await self._reject(send, 413, limit_msg)
                return
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        received = 0

        async def receive_wrapper():
            nonlocal received, too_large
            msg = await receive()
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > self.max_body:
                    too_large = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        headers = dict(scope.get("headers") or [])
        if scope.get("method") == "POST" and b"json" not in headers.get(b"content-type", b""):
            # every body here is JSON: read it as such even when the client (curl -d) labels it a form
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-type"]
                         + [(b"content-type", b"application/json")])
        try:
            declared = headers.get(b"content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
                status = 413
                await self._reject(send, 413, limit_msg)
                return
            await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            self.metrics.requests.labels(endpoint, str(status)).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)


def _error_responses(*codes: int) -> dict:
    return {c: {"model": ErrorResponse} for c in codes}


_UNION_TAGS = {"none", "str", "int", "float", "bool", "list", "dict", "constrained-str"}


def _readable(errors: list[dict]) -> str:
    """``field.path: what is wrong; ...`` without pydantic's union-branch noise (``prompts.none: Input should be None``)."""
    real = [e for e in errors if e.get("type") != "none_required"] or errors
    parts = []
    for e in real[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body" and not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS))]
        parts.append(f"{'.'.join(loc) or 'body'}: {str(e.get('msg', 'invalid')).removeprefix('Value error, ')}")
    more = f" (and {len(real) - 5} more)" if len(real) > 5 else ""
    return "; ".join(parts) + more


def create_app(settings: SidecarSettings, ref: ModelRef, resolved: ResolvedModel):
    """The FastAPI app; the model loads in the background after startup (``/ready`` says when)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response
    from starlette.exceptions import HTTPException as StarletteHTTPException

    metrics = SidecarMetrics()
    state = SidecarState(settings, ref, resolved, metrics)

    @asynccontextmanager
    async def lifespan(app):
        state.batcher.start()
        tasks = [asyncio.create_task(state.initial_load()), asyncio.create_task(state.housekeeping())]
        if ref.follows_alias and settings.reload_interval > 0:
            tasks.append(asyncio.create_task(state.watch_alias()))
        yield
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await state.batcher.stop()
        state.window_logger.submit(state.aggregator.flush_due(force=True))
        await asyncio.to_thread(state.window_logger.close, 5.0)

    app = FastAPI(title="lengthwise prediction sidecar", version="1", lifespan=lifespan,
                  description="Response-length predictions (bucket, probabilities, expected and quantile length) for an "
                              "LLM gateway, and online error tracking from the actual lengths it feeds back.")
    app.state.sidecar = state

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = list(exc.errors())
        bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
        if bad_json is not None:
            where = bad_json.get("loc", ("body", "?"))[-1]
            return JSONResponse({"detail": f"invalid JSON: {bad_json.get('ctx', {}).get('error', 'decode error')} "
                                           f"(at character {where})"}, status_code=400)
        return JSONResponse({"detail": _readable(errors)}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        detail = exc.detail
        if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
            detail = "request body is not valid UTF-8 JSON"
        return JSONResponse({"detail": str(detail)}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    def require_model() -> ServedModel:
        m = state.model
        if m is None:
            raise HTTPException(503, "no model loaded yet" + (f" (last load failed: {state.load_error})" if state.load_error else ""))
        return m

    @app.post("/v1/predict", response_model=PredictResponse, responses=_error_responses(400, 413, 422, 503),
              summary="predict response lengths for one prompt, several prompts or a chat conversation")
    async def predict(req: PredictRequest):
        t0 = time.perf_counter()
        require_model()
        convs = req.conversations()
        results = await state.batcher.submit([_Item(c, req.quantile) for c in convs])
        ms = (time.perf_counter() - t0) * 1000.0
        preds, truncated = [], 0
        for i, (d, model) in enumerate(results):
            if req.request_id is None:
                pid = uuid.uuid4().hex
            else:
                pid = req.request_id if len(results) == 1 else f"{req.request_id}/{i}"
            d["prediction_id"] = pid
            d["latency_ms"] = ms
            state.remember(pid, d, model)
            truncated += d["truncated"]
            preds.append(d)
        metrics.predictions.inc(len(preds))
        if truncated:
            metrics.truncated.inc(truncated)
        last = results[-1][1]
        return JSONResponse({"predictions": preds, "model_name": last.name, "model_version": last.version, "latency_ms": ms})

    @app.post("/v1/feedback", response_model=FeedbackResponse, responses=_error_responses(400, 404, 413, 422, 503),
              summary="report the actual output length of a predicted request (online error tracking)")
    async def feedback(req: FeedbackRequest):
        entry = state.served.get(req.request_id)
        if entry is not None:
            source, name, version, scheme = "served", entry.name, entry.version, entry.scheme
            bucket, expected, qtok = entry.bucket, entry.expected, entry.quantile_tokens
        elif req.prediction is not None:
            m = require_model()
            p = req.prediction
            name, version = p.model_name or m.name, p.model_version or m.version
            scheme = state.schemes.get((name, version), m.predictor.scheme)
            bucket = int(scheme.assign(p.expected_tokens)[0]) if p.bucket is None else p.bucket
            if bucket >= scheme.n:
                raise HTTPException(422, f"prediction.bucket: {bucket} is out of range for {scheme.n} buckets")
            for field, v in (("expected_tokens", p.expected_tokens), ("quantile_tokens", p.quantile_tokens)):
                if v is not None and v > scheme.max_tokens:  # no prediction of this model can say that
                    raise HTTPException(422, f"prediction.{field}: {v:g} exceeds the model's largest length {scheme.max_tokens}")
            source, expected, qtok = "inline", p.expected_tokens, p.quantile_tokens
        else:
            raise HTTPException(404, f"unknown request_id {req.request_id!r} (never served here, or evicted): "
                                     "send the served prediction inline as 'prediction'")
        actual_bucket = int(scheme.assign(req.actual_tokens)[0])
        accepted = not (entry is not None and entry.used)  # a retried feedback is not counted twice
        if accepted:
            if entry is not None:
                entry.used = True
            state.record(Feedback(name, version, bucket, actual_bucket, expected, qtok, req.actual_tokens))
            metrics.feedback.labels(source).inc()
        else:
            metrics.feedback.labels("duplicate").inc()
        return JSONResponse({"accepted": accepted, "request_id": req.request_id, "source": source, "model_name": name,
                             "model_version": version, "predicted_bucket": bucket, "actual_bucket": actual_bucket,
                             "error_tokens": float(expected - req.actual_tokens)})

    @app.get("/health", response_model=Health, summary="the process is alive")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", response_model=Ready, responses=_error_responses(503), summary="a model is loaded and serving")
    async def ready():
        m = require_model()
        return {"status": "ready", "model_name": m.name, "model_version": m.version, "model_uri": ref.uri,
                "from_cache_only": m.resolved.from_cache_only}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return _BodyLimitAndMetrics(app, settings.max_body_bytes, metrics) if settings.max_body_bytes else app


# --- command line -----------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2: operators grep logs, not usage blocks
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="predictor-sidecar", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve response-length predictions over HTTP beside the LLM engines: POST /v1/predict, "
                    "POST /v1/feedback (actual lengths -> online error in MLflow and Prometheus), GET /health, /ready, "
                    "/metrics, /openapi.json. Follows a registry alias and hot-swaps when it moves; restarts from "
                    "the local model cache when the registry is down.",
        epilog="examples:\n"
               "  predictor-sidecar                                    # models:/length-predictor@champion on 127.0.0.1:8100\n"
               "  predictor-sidecar --model models:/length-predictor@challenger --port 8101\n"
               "  predictor-sidecar --model models:/length-predictor/3 --reload-interval 0   # pin a version\n"
               "  curl -s localhost:8100/v1/predict -d '{\"prompt\": \"Write a haiku about autumn.\"}'\n"
               "  curl -s localhost:8100/v1/feedback -d '{\"request_id\": \"<prediction_id>\", \"actual_tokens\": 212}'\n\n"
               "environment: LENGTHWISE_HOME (store and model cache), MLFLOW_TRACKING_URI (a real MLflow server), "
               "LENGTHWISE_ORT_THREADS")
    d = SidecarSettings()
    p.add_argument("--model", default=d.model, metavar="URI",
                   help="models:/NAME@ALIAS (followed), models:/NAME/VERSION (pinned) or a package directory (default: %(default)s)")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    g = p.add_argument_group("batching and inference")
    g.add_argument("--max-batch", type=int, default=d.max_batch, help="prompts per forward pass (default: %(default)s)")
    g.add_argument("--max-wait-ms", type=float, default=d.max_wait_ms,
                   help="longest a prompt waits for others to join its batch (default: %(default)s)")
    g.add_argument("--threads", type=int, help="onnxruntime intra-op threads per worker (default: $LENGTHWISE_ORT_THREADS or min(4, cores))")
    g.add_argument("--workers", type=int, default=d.workers,
                   help="micro-batches run side by side, each with its own session; on 2 cores --workers 2 --threads 1 gives "
                        "more predictions/s under load, the default lower latency for a lone request (default: %(default)s)")
    g.add_argument("--token-budget", type=int, default=d.token_budget,
                   help="padded tokens per onnxruntime run; a micro-batch is split by prompt length into runs this size "
                        "(default: %(default)s)")
    g.add_argument("--precision", choices=["fp32", "int8"], default=d.precision,
                   help="int8 quantizes the model's weights once at load (kept beside it): about 1.7x predictions/s "
                        "on a CPU at equal measured accuracy (default: %(default)s)")
    g.add_argument("--ort-spin", action="store_true",
                   help="let idle onnxruntime threads busy-wait (a little lower latency when the machine is otherwise idle)")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="larger request bodies get 413 (default: %(default)s)")
    g.add_argument("--lru-size", type=int, default=d.lru_size, help="served predictions remembered for feedback (default: %(default)s)")
    r = p.add_argument_group("registry and online monitoring")
    r.add_argument("--reload-interval", type=float, default=d.reload_interval,
                   help="seconds between polls of the alias; 0 disables hot reload (default: %(default)s)")
    r.add_argument("--window-size", type=int, default=d.window_size, help="feedbacks per online-error window (default: %(default)s)")
    r.add_argument("--window-seconds", type=float, default=d.window_seconds, help="or this age, whichever first (default: %(default)s)")
    r.add_argument("--alarm-margin", type=float, default=d.alarm_margin,
                   help="alarm when window accuracy < offline accuracy - margin (default: %(default)s)")
    r.add_argument("--padding", type=float, default=d.padding,
                   help="under-prediction means actual > expected x (1 + padding) (default: %(default)s)")
    p.add_argument("--log-level", default=d.log_level, choices=["debug", "info", "warning", "error"])
    return p


def _check(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if not 0 < a.port < 65536:
        p.error(f"--port must be between 1 and 65535, got {a.port}")
    for name, ok in (("--max-batch", a.max_batch >= 1), ("--max-wait-ms", a.max_wait_ms >= 0),
                     ("--reload-interval", a.reload_interval >= 0), ("--window-size", a.window_size >= 1),
                     ("--window-seconds", a.window_seconds > 0), ("--lru-size", a.lru_size >= 1),
                     ("--max-body-bytes", a.max_body_bytes >= 1024), ("--padding", a.padding >= 0),
                     ("--threads", a.threads is None or a.threads >= 1),
                     ("--workers", 1 <= a.workers <= 64),
                     ("--token-budget", a.token_budget >= 1)):
        if not ok:
            p.error(f"{name} is out of range: {getattr(a, name[2:].replace('-', '_'))}")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    _check(a, p)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("mlflow", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.ERROR)  # retry chatter; we log the outcome ourselves
    # Fail fast against a dead tracking server (MLflow's default retries for minutes); the cache covers us.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    try:
        sock = _listen(a.host, a.port)
    except (OSError, OverflowError) as exc:
        print(f"predictor-sidecar: error: cannot listen on {a.host}:{a.port}: {getattr(exc, 'strerror', None) or exc}",
              file=sys.stderr)
        return 2
    try:
        ref = parse_uri(a.model)
        resolved = resolve(ref)
    except ModelResolveError as exc:
        print(f"predictor-sidecar: error: {exc}", file=sys.stderr)
        sock.close()
        return 2
    settings = SidecarSettings(**{k: v for k, v in vars(a).items() if k in SidecarSettings.__dataclass_fields__})
    import uvicorn

    app = create_app(settings, ref, resolved)
    config = uvicorn.Config(app, log_level=a.log_level, access_log=False, timeout_graceful_shutdown=5)
    log.info("listening on http://%s:%d (model %s -> version %s)", a.host, a.port, ref.uri, resolved.version)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
