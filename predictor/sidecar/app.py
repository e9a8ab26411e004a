"""``predictor-sidecar``'s HTTP layer: the FastAPI app, its routes, error handlers and body-limit middleware.

The gateway asks ``POST /v1/predict`` for every request and posts the actual output length (and the engine's
finish reason: a capped answer is only a lower bound) to ``POST /v1/feedback`` when the answer is done; feedback
becomes online error windows, the drift alarm ``/health`` shows, and rows of the local feedback store
(monitoring/feedback_store.py) that retraining reads. The routes stay thin: concurrent requests are
micro-batched into shared forward passes (predictor/sidecar/batcher.py) and run in worker threads so the event
loop keeps answering; which model version serves, hot reload and feedback windows live in
predictor/sidecar/state.py, and which feedback may change anything in predictor/sidecar/feedback.py. With a token,
the middleware of predictor/sidecar/auth.py refuses callers without it. Errors are one readable ``{"detail": ...}``
whatever fails (bad JSON, a too-large body, a missing model, a missing token). The command line is
predictor/sidecar/cli.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from predictor.conditioning import condition_turns
from predictor.partial import with_answer
from predictor.sidecar.auth import BearerAuth, send_error
from predictor.sidecar.batcher import Expired
from predictor.sidecar.cache import ModelRef, ResolvedModel
from predictor.sidecar.feedback import Refused, take
from predictor.sidecar.loading import PredictItem, ServedModel
from predictor.sidecar.metrics import SidecarMetrics, endpoint_label
from predictor.sidecar.schemas import (
    ErrorResponse,
    FeedbackRequest,
    FeedbackResponse,
    Health,
    PredictRequest,
    PredictResponse,
    Ready,
    RemainingRequest,
    RemainingResponse,
)
from predictor.sidecar.settings import SidecarSettings
from predictor.sidecar.state import SidecarState


class _BodyLimitAndMetrics:
    """ASGI middleware: 413 for bodies over the limit (declared or streamed), and request count/latency."""

    def __init__(self, app, max_body_bytes: int, metrics: SidecarMetrics):
        self.app, self.max_body, self.metrics = app, max_body_bytes, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        endpoint = endpoint_label(scope["path"])
        status = 500
        too_large = False
        replaced = False
        limit_msg = f"request body exceeds {self.max_body} bytes"

        async def send_wrapper(msg) -> None:
            nonlocal status, replaced
            if too_large:  # swallow the app's answer to a cut-off body; say what really happened
                if msg["type"] == "http.response.start" and not replaced:
                    replaced, status = True, 413
                    await send_error(send, 413, limit_msg)
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
                await send_error(send, 413, limit_msg)
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
    inner: ASGIApp = app
    if settings.token is not None:
        inner = BearerAuth(app, settings.token.get_secret_value(), settings.protect_health, metrics.count_unauthorized)
    return _BodyLimitAndMetrics(inner, settings.max_body_bytes, metrics)  # settings hold a limit of at least 1 KiB


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

    @app.post("/v1/predict", response_model=PredictResponse, responses=_error_responses(400, 401, 413, 422, 503, 504),
              summary="predict response lengths for one prompt, several prompts or a chat conversation")
    async def predict(req: PredictRequest, x_lengthwise_timeout_ms: float | None = Header(
            None, gt=0, description="how long the caller waits; prompts still queued after that are dropped unrun (504)")):
        return await _predict(state, req, x_lengthwise_timeout_ms)

    @app.post("/v1/predict/remaining", response_model=RemainingResponse, responses=_error_responses(400, 401, 413, 422,
                                                                                                     503, 504),
              summary="predict what is left of several running answers at once (a version trained on answers so far)")
    async def predict_remaining(req: RemainingRequest, x_lengthwise_timeout_ms: float | None = Header(
            None, gt=0, description="how long the caller waits; items still queued after that are dropped unrun (504)")):
        return await _predict_remaining(state, req, x_lengthwise_timeout_ms)

    @app.post("/v1/feedback", response_model=FeedbackResponse, responses=_error_responses(400, 401, 404, 413, 422, 503),
              summary="report the actual output length of a predicted request (online error tracking)")
    async def feedback(req: FeedbackRequest):
        return _feedback(state, req)

    @app.get("/health", response_model=Health,
             summary="the process is alive; the served model's target, drift alarms, and why it is degraded")
    async def health():
        m = state.model
        reasons = [r for r in (state.registry_error, state.reload_error) if r]
        return {"status": "degraded" if reasons else "ok", "reasons": reasons, "model_name": m.name if m else None,
                "model_version": m.version if m else None, "target": m.target if m else "unknown: no model loaded yet",
                "drift": {d.model_version: vars(d) for d in state.drift.values()}}

    @app.get("/ready", response_model=Ready, responses=_error_responses(503), summary="a model is loaded and serving")
    async def ready():
        m = _require_model(state)
        return {"status": "ready", "model_name": m.name, "model_version": m.version, "model_uri": state.ref.uri,
                "target": m.target, "from_cache_only": m.resolved.from_cache_only,
                "conditioned_on_models": m.predictor.conditioned_models}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def prometheus():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _require_model(state: SidecarState) -> ServedModel:
    m = state.model
    if m is None:
        raise HTTPException(503, "no model loaded yet" + (f" (last load failed: {state.load_error})" if state.load_error else ""))
    return m


async def _predict(state: SidecarState, req: PredictRequest, timeout_ms: float | None = None) -> JSONResponse:
    """Batch the request's conversations with whatever else is waiting; remember each prediction for its feedback.

    With the caller's timeout (``x-lengthwise-timeout-ms``, which the gateway sends) prompts still queued when it has
    passed are not run: the caller has fallen back already, and a sidecar slower than its arrivals would otherwise
    spend its CPU on answers nobody reads while its queue grows."""
    t0 = time.perf_counter()
    served = _require_model(state)
    convs = req.conversations()  # as the client sent them: what feedback and retraining keep
    asked = _for_model(served, req.model, _with_answer(served, req, convs))
    results = await _submit(state, [PredictItem(c, req.quantile) for c in asked], timeout_ms)
    ms = (time.perf_counter() - t0) * 1000.0
    preds, truncated = [], 0
    for i, (d, model) in enumerate(results):
        if req.request_id is None:
            pid = uuid.uuid4().hex
        else:
            pid = req.request_id if len(results) == 1 else f"{req.request_id}/{i}"
        d["prediction_id"] = pid
        d["latency_ms"] = ms
        if req.answer_so_far is not None:  # of the tokens still to come: no feedback of a whole length scores it
            d["generated_tokens"] = req.answer_so_far.tokens
        else:
            state.remember(pid, d, model, convs[i], _served_model(state, served, req.model))
        truncated += d["truncated"]
        preds.append(d)
    state.metrics.predictions.inc(len(preds))
    if truncated:
        state.metrics.truncated.inc(truncated)
    last = results[-1][1]
    return JSONResponse({"predictions": preds, "model_name": last.name, "model_version": last.version, "latency_ms": ms})


async def _submit(state: SidecarState, items: list[PredictItem], timeout_ms: float | None) -> list:
    """``items`` through the batcher; 504 when the caller's timeout passes before a worker takes them."""
    expires = asyncio.get_running_loop().time() + timeout_ms / 1000.0 if timeout_ms else float("inf")
    try:
        return await state.batcher.submit(items, expires)
    except Expired:  # counted by the batcher, prompt by prompt
        raise HTTPException(504, f"expired in the sidecar's queue: the caller's {timeout_ms:g} ms passed before a worker "
                                 "was free (the sidecar is saturated; the caller has its fallback)") from None


async def _predict_remaining(state: SidecarState, req: RemainingRequest, timeout_ms: float | None = None) -> JSONResponse:
    """:func:`_predict` for several answers so far in one call: one submission to the batcher for them all. An item
    its own call would have had refused (a model the predictor never learned) is answered with its error; the others
    are predicted. Nothing is remembered for feedback: these are predictions of what is left, not of whole lengths."""
    t0 = time.perf_counter()
    served = _require_model(state)
    asked, where, results_out = [], [], []
    for item in req.items:
        try:
            convs = _for_model(served, item.model, _with_answer(served, item, item.conversations()))
        except HTTPException as exc:
            if exc.status_code == 422 and not served.predictor.remaining_length:
                raise  # the version itself cannot: the whole call is refused, as a single one would be
            results_out.append({"error": exc.detail, "status": exc.status_code})
            continue
        where.append(len(results_out))
        results_out.append(None)
        asked.append(PredictItem(convs[0], item.quantile))
    results = await _submit(state, asked, timeout_ms) if asked else []
    ms = (time.perf_counter() - t0) * 1000.0
    for i, (d, _model) in zip(where, results, strict=True):
        item = req.items[i]
        d.update(prediction_id=item.request_id or uuid.uuid4().hex, latency_ms=ms,
                 generated_tokens=item.answer_so_far.tokens if item.answer_so_far else None)
        results_out[i] = d
    state.metrics.predictions.inc(len(results))
    return JSONResponse({"results": results_out, "latency_ms": ms})


def _with_answer(served: ServedModel, req: PredictRequest,
                 convs: list[list[tuple[str, str]]]) -> list[list[tuple[str, str]]]:
    """The conversation followed by the answer so far when the request gives one (:mod:`predictor.partial`); a version
    trained on prompts alone refuses it (422): it would answer as if nothing had been written."""
    if req.answer_so_far is None:
        return convs
    if not served.predictor.remaining_length:
        raise HTTPException(422, f"model {served.name} version {served.version} predicts from the prompt alone: "
                                 "answer_so_far needs a version trained on answers so far (python -m "
                                 "serving.bench.predictor.remaining --register NAME)")
    return [with_answer(c, req.answer_so_far.text, req.answer_so_far.tokens) for c in convs]


def _for_model(served: ServedModel, model: str | None, convs: list[list[tuple[str, str]]]) -> list[list[tuple[str, str]]]:
    """The conversations as the served predictor reads them: a predictor conditioned on the model gets the request's
    model before each request, and refuses a model it never learned (422: its lengths would be a guess). A predictor for
    one model ignores ``model``; the gateway's target check says whether it is the right one."""
    models = served.predictor.conditioned_models
    if not models:
        return convs
    if model is None:
        raise HTTPException(422, f"model {served.name} version {served.version} predicts lengths for several models: "
                                 f"send the request's 'model' (one of {', '.join(models)})")
    if model not in models:
        raise HTTPException(422, f"model {served.name} version {served.version} was not trained on {model!r}'s lengths; "
                                 f"it predicts for {', '.join(models)}")
    return [condition_turns(c, model) for c in convs]


def _served_model(state: SidecarState, served: ServedModel, model: str | None) -> str | None:
    """The served model whose part of the online windows this prediction's feedback counts in: the request's ``model``
    when it is known good (a conditioned predictor took only one it learned; a sidecar with a token is called by the
    gateway, which named a model of its catalogue), else none, so no caller can fill the windows and the Prometheus
    series with names of its own."""
    if model is None or not (served.predictor.conditioned_models or state.trusted):
        return None
    return model


def _feedback(state: SidecarState, req: FeedbackRequest) -> JSONResponse:
    """Take the feedback (predictor/sidecar/feedback.py says which may change anything); a refusal is counted by
    reason and answered with its status and message."""
    try:
        return JSONResponse(take(state, req))
    except Refused as exc:
        if exc.reason is not None:
            state.metrics.feedback_rejected.labels(exc.reason).inc()
        raise HTTPException(exc.status, exc.detail) from None
