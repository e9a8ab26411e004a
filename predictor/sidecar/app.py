"""``predictor-sidecar``'s HTTP layer: the FastAPI app, its routes, error handlers and body-limit middleware.

The gateway asks ``POST /v1/predict`` for every request and posts the actual output length (and the engine's
finish reason: a capped answer is only a lower bound) to ``POST /v1/feedback`` when the answer is done; feedback
becomes online error windows, the drift alarm ``/health`` shows, and rows of the local feedback store
(registry/feedback_store.py) that retraining reads. The routes stay thin: concurrent requests are
micro-batched into shared forward passes (predictor/sidecar/batcher.py) and run in worker threads so the event
loop keeps answering; which model version serves, hot reload and feedback windows live in
predictor/sidecar/state.py. Errors are one readable ``{"detail": ...}`` whatever fails (bad JSON, a too-large
body, a missing model). The command line is predictor/sidecar/cli.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from predictor.sidecar.cache import ModelRef, ResolvedModel
from predictor.sidecar.loading import PredictItem, ServedModel
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
from predictor.sidecar.settings import SidecarSettings
from predictor.sidecar.state import SidecarState
from registry.online import Feedback

ENDPOINTS = ("/v1/predict", "/v1/feedback", "/health", "/ready", "/metrics", "/openapi.json", "/docs")


class _BodyLimitAndMetrics:
    """ASGI middleware: 413 for bodies over the limit (declared or streamed), and request count/latency."""

    def __init__(self, app, max_body_bytes: int, metrics: SidecarMetrics):
        self.app, self.max_body, self.metrics = app, max_body_bytes, metrics

    async def _reject(self, send, status: int, detail: str) -> None:
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




def create_app(settings: SidecarSettings, ref: ModelRef, resolved: ResolvedModel) -> ASGIApp:
    """The FastAPI app; the model loads in the background after startup (``/ready`` says when)."""
    metrics = SidecarMetrics()
    state = SidecarState(settings, ref, resolved, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.batcher.start()
        tasks = [asyncio.create_task(state.initial_load()), asyncio.create_task(state.housekeeping())]
        if ref.follows_alias and settings.reload_interval > 0:
            tasks.append(asyncio.create_task(state.watch_alias()))
        yield
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await state.batcher.stop()
        state.publish(state.aggregator.flush_due(force=True))
        await asyncio.to_thread(state.window_logger.close, 5.0)
        if state.feedback_writer is not None:
            await asyncio.to_thread(state.feedback_writer.close, 5.0)

    app = FastAPI(title="lengthwise prediction sidecar", version="1", lifespan=lifespan,
                  description="Response-length predictions (bucket, probabilities, expected and quantile length) for an "
                              "LLM gateway, and online error tracking from the actual lengths it feeds back.")
    app.state.sidecar = state
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    _add_routes(app, state)
    return _BodyLimitAndMetrics(app, settings.max_body_bytes, metrics)  # settings hold a limit of at least 1 KiB


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        where = bad_json.get("loc", ("body", "?"))[-1]
        return JSONResponse({"detail": f"invalid JSON: {bad_json.get('ctx', {}).get('error', 'decode error')} "
                                       f"(at character {where})"}, status_code=400)
    return JSONResponse({"detail": _readable(errors)}, status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    detail = exc.detail
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        detail = "request body is not valid UTF-8 JSON"
    return JSONResponse({"detail": str(detail)}, status_code=exc.status_code, headers=getattr(exc, "headers", None))


def _add_routes(app: FastAPI, state: SidecarState) -> None:
    """The endpoints; their function names are the OpenAPI operation ids."""

    @app.post("/v1/predict", response_model=PredictResponse, responses=_error_responses(400, 413, 422, 503),
              summary="predict response lengths for one prompt, several prompts or a chat conversation")
    async def predict(req: PredictRequest):
        return await _predict(state, req)

    @app.post("/v1/feedback", response_model=FeedbackResponse, responses=_error_responses(400, 404, 413, 422, 503),
              summary="report the actual output length of a predicted request (online error tracking)")
    async def feedback(req: FeedbackRequest):
        return _feedback(state, req)

    @app.get("/health", response_model=Health, summary="the process is alive; the served model's target and drift alarms")
    async def health():
        m = state.model
        return {"status": "ok", "model_name": m.name if m else None, "model_version": m.version if m else None,
                "target": m.target if m else "unknown: no model loaded yet",
                "drift": {d.model_version: vars(d) for d in state.drift.values()}}

    @app.get("/ready", response_model=Ready, responses=_error_responses(503), summary="a model is loaded and serving")
    async def ready():
        m = _require_model(state)
        return {"status": "ready", "model_name": m.name, "model_version": m.version, "model_uri": state.ref.uri,
                "target": m.target, "from_cache_only": m.resolved.from_cache_only}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _require_model(state: SidecarState) -> ServedModel:
    m = state.model
    if m is None:
        raise HTTPException(503, "no model loaded yet" + (f" (last load failed: {state.load_error})" if state.load_error else ""))
    return m


async def _predict(state: SidecarState, req: PredictRequest) -> JSONResponse:
    """Batch the request's conversations with whatever else is waiting; remember each prediction for its feedback."""
    t0 = time.perf_counter()
    _require_model(state)
    convs = req.conversations()
    results = await state.batcher.submit([PredictItem(c, req.quantile) for c in convs])
    ms = (time.perf_counter() - t0) * 1000.0
    preds, truncated = [], 0
    for i, (d, model) in enumerate(results):
        if req.request_id is None:
            pid = uuid.uuid4().hex
        else:
            pid = req.request_id if len(results) == 1 else f"{req.request_id}/{i}"
        d["prediction_id"] = pid
        d["latency_ms"] = ms
        state.remember(pid, d, model, convs[i])
        truncated += d["truncated"]
        preds.append(d)
    state.metrics.predictions.inc(len(preds))
    if truncated:
        state.metrics.truncated.inc(truncated)
    last = results[-1][1]
    return JSONResponse({"predictions": preds, "model_name": last.name, "model_version": last.version, "latency_ms": ms})


def _feedback(state: SidecarState, req: FeedbackRequest) -> JSONResponse:
    """Score an actual length against the prediction served here (or sent inline) and store it as a training row
    (served ones only: an inline prediction's prompt was never seen here); a retry is not counted twice."""
    entry = state.served.get(req.request_id)
    if entry is not None:
        source, name, version, scheme = "served", entry.name, entry.version, entry.scheme
        bucket, expected, qtok = entry.bucket, entry.expected, entry.quantile_tokens
    elif req.prediction is not None:
        m = _require_model(state)
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
    fb = Feedback(name, version, bucket, actual_bucket, expected, qtok, req.actual_tokens, req.finish_reason, scheme.n)
    accepted = not (entry is not None and entry.used)  # a retried feedback is not counted twice
    stored = False
    if accepted:
        if entry is not None:
            entry.used = True
        state.record(fb)
        stored = state.store(req.request_id, entry, fb)
        state.metrics.feedback.labels(source).inc()
    else:
        state.metrics.feedback.labels("duplicate").inc()
    return JSONResponse({"accepted": accepted, "request_id": req.request_id, "source": source, "model_name": name,
                         "model_version": version, "predicted_bucket": bucket, "actual_bucket": actual_bucket,
                         "error_tokens": float(expected - req.actual_tokens), "censored": fb.censored, "stored": stored})
