"""The gateway's FastAPI app: OpenAI's completions and chat endpoints in front of the engine pool.

A thin adapter: the routes call a :class:`~serving.gateway.gateway.Gateway`, which holds the engines, the predictor and
one method per step of the request path below; the app adds what is HTTP's alone (reading the body within its limit,
noticing a client that leaves, the lifespan, the error handlers for everything that is not an OpenAI error).

Per request (docs/architecture.md): validate → predict (sidecar or fallback) → deadline → hints into ``vllm_xargs`` →
count the prompt's tokens → place on an engine (the placement core over each engine's view) → forward (streaming or not,
retried while nothing was sent) → feedback in the background. The response carries the engine's body unchanged plus headers
saying what the gateway decided: ``x-lengthwise-request-id`` (also the engine's request id), ``x-lengthwise-engine``,
``x-lengthwise-pred-len``, ``x-lengthwise-prediction`` (``sidecar``, ``sidecar:fast-tier``, ``profile`` or
``fallback:<reason>``), ``x-lengthwise-deadline`` (Unix seconds) and ``x-lengthwise-prompt-tokens`` (``<count>:<method>``, what
placement used). With ``--prefill-url`` a prefill engine computes the prompt's KV first (:mod:`serving.gateway.prefill`)
and ``x-lengthwise-prefill-engine`` / ``x-lengthwise-prefill-ms`` say where and how long.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from serving.gateway import openapi
from serving.gateway.errors import ApiError, error_body
from serving.gateway.gateway import Call, Gateway
from serving.gateway.openapi import ChatCompletionRequest, CompletionRequest, ErrorBody, generation_responses, request_body
from serving.gateway.redact import quote
from serving.gateway.requests import Kind
from serving.gateway.settings import GatewaySettings
from serving.gateway.target import TargetCheck

log = logging.getLogger("serving.gateway")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The body, refusing more than ``limit`` bytes (declared or streamed) with a 413, and one not whole within
    ``timeout_s`` with a 408 that closes the connection.

    Why a time for the whole body, not per read: a client that sends one byte every few seconds never idles long, and
    would hold its connection (a file descriptor, its buffers) for as long as it likes (:mod:`serving.gateway.slow_clients`).
    """
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s ({size} bytes came); send it "
                       "whole at once", code="request_timeout", headers={"Connection": "close"}) from None
    return b"".join(chunks)


async def unless_client_leaves(request: Request, call: Coroutine[Any, Any, Response]) -> Response | None:
    """Await ``call``, or cancel it and return None when the client disconnects first.

    Why: a non-streamed answer is sent only when complete, so nothing else notices a client that gave up
    (a timeout, a closed tab); its engine would go on generating an answer nobody reads. Cancelling the
    call closes the engine connection, and vLLM aborts the request when its client disconnects.
    """
    answer = asyncio.ensure_future(call)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({answer, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        answer.cancel()
        raise
    finally:
        watch.cancel()
    if not answer.done():  # the client left first
        answer.cancel()
        await asyncio.gather(answer, return_exceptions=True)
        return None
    return answer.result()


class KeyMiddleware:
    """The API-key check (:meth:`Gateway.authorize`) in front of every route, 404s included: pure ASGI, so a refused
    request costs no body read and streams and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app, self.gw = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.gw.keys.enabled:
            path = scope["path"]
            try:
                self.gw.authorize(scope["method"], path, Headers(scope=scope))
            except ApiError as exc:
                self.gw.count(path, exc.status)
                await exc.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: GatewaySettings, engine_urls: list[str] | None = None,
               plugin_metrics: dict[str, str] | None = None, prefill_urls: list[str] | None = None,
               predictor_target: TargetCheck | None = None, model_targets: dict[str, TargetCheck] | None = None,
               serves: dict[str, list[str]] | None = None, engines: list | None = None) -> FastAPI:
    """The app over a :class:`~serving.gateway.gateway.Gateway` with these arguments (see there)."""
    return gateway_app(Gateway(settings, engine_urls, plugin_metrics, prefill_urls, predictor_target, model_targets,
                               serves, engines))


def gateway_app(gw: Gateway, title: str = "lengthwise gateway",
                description: str = "OpenAI-compatible endpoint in front of vLLM engines running the lengthwise scheduler."
                ) -> FastAPI:
    """The FastAPI app over ``gw`` (this gateway, or a subclass that forwards elsewhere, as the Ray Serve ingress does):
    its routes call the gateway's methods, and the app adds the lifespan, the error handlers, the published contract
    (:mod:`serving.gateway.openapi`) and the HTTP around each request."""
    settings = gw.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        yield
        await gw.aclose()

    app = FastAPI(title=title, version="1", lifespan=lifespan, docs_url=None, redoc_url=None, description=description)
    app.state.gateway, app.state.pool, app.state.metrics = gw, gw.pool, gw.metrics
    app.add_middleware(KeyMiddleware, gateway=gw)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        gw.count(request.url.path, exc.status_code)
        path = quote(request.url.path)
        msg = {404: f"no such endpoint: {quote(request.method)} {path}",
               405: f"method {quote(request.method)} is not allowed on {path}"}.get(exc.status_code, quote(str(exc.detail)))
        return JSONResponse(error_body(msg, code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        gw.count(request.url.path, 500)
        return JSONResponse(error_body(f"internal gateway error ({type(exc).__name__}); see the gateway log", "server_error"),
                            status_code=500)

    async def generate(request: Request, kind: Kind) -> Response:
        call = Call(kind)
        try:
            raw = await read_body(request, settings.max_body_bytes, settings.client_body_timeout_s)
            return await gw.serve(call, raw, request.headers, lambda answer: unless_client_leaves(request, answer))
        except ApiError as exc:
            if exc.status == 408:
                gw.metrics.rejected.labels("slow_body").inc()
            return gw.refused(call, exc)
        except Exception as exc:  # a defect of ours: answered here, so the client's connection stays usable
            # (the app-wide handler answers too, but then re-raises into the server, which closes the connection)
            log.exception("internal error on %s %s", request.method, request.url.path)
            return gw.refused(call, ApiError(500, f"internal gateway error ({type(exc).__name__}); see the gateway log"))

    responses = generation_responses()
    openapi.install(app, settings.max_n)

    @app.post("/v1/completions", summary="OpenAI completions (streaming or not), scheduled by predicted length",
              openapi_extra=request_body(CompletionRequest, settings.max_n), responses=responses)
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions", summary="OpenAI chat completions (streaming or not), scheduled by predicted length",
              openapi_extra=request_body(ChatCompletionRequest, settings.max_n), responses=responses)
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    unavailable = {401: {"model": ErrorBody, "description": "missing or wrong API key"},
                   503: {"model": ErrorBody, "description": "no engine can answer now"}}

    @app.get("/v1/models", summary="the models the engines serve", responses=unavailable)
    async def models() -> Response:
        return await gw.models()

    @app.get("/health", summary="ok, or degraded with reasons (engines, predictor); 503 only when no engine can serve",
             responses={401: unavailable[401], 503: {"description": "no engine can serve (the same body, status down)"}})
    async def health(request: Request) -> Response:
        body = gw.health(request.headers)
        return JSONResponse(body, status_code=gw.health_status(body))

    @app.get("/metrics", summary="Prometheus metrics (text exposition format)", response_class=PlainTextResponse,
             responses={401: unavailable[401]})
    async def prometheus() -> Response:
        return Response(await gw.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
