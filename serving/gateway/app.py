"""The gateway's FastAPI app: OpenAI's completions and chat endpoints in front of the engine pool.

Per request (SPEC §2): validate → predict (sidecar or fallback) → deadline → hints into ``vllm_xargs`` →
count the prompt's tokens → place on an engine (the placement core over each engine's view) → forward (streaming or not, retried while nothing was sent) → feedback in the
background. The response carries the engine's body unchanged plus headers saying what the gateway
decided: ``x-lengthwise-request-id`` (also the engine's request id), ``x-lengthwise-engine``,
``x-lengthwise-pred-len``, ``x-lengthwise-prediction`` (``sidecar`` or ``fallback:<reason>``),
``x-lengthwise-deadline`` (Unix seconds) and ``x-lengthwise-prompt-tokens`` (``<count>:<method>``, what
placement used). With ``--prefill-url`` a prefill engine computes the prompt's KV first (:mod:`serving.gateway.prefill`)
and ``x-lengthwise-prefill-engine`` / ``x-lengthwise-prefill-ms`` say where and how long.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.gateway.errors import ApiError, error_body
from serving.gateway.feedback import FeedbackPoster
from serving.gateway.forward import Forwarder, Outcome
from serving.gateway.hints import engine_body
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.pool import EnginePool
from serving.gateway.prediction import Predictor
from serving.gateway.prefill import PrefillHop
from serving.gateway.requests import PATHS, Kind, parse_json, validate
from serving.gateway.settings import GatewaySettings
from serving.gateway.slo import client_slo, deadline, default_slo
from serving.gateway.tokens import PromptCounter
from serving.placement import Job

log = logging.getLogger("serving.gateway")
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes (declared or streamed) with a 413."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(settings: GatewaySettings, engine_urls: list[str] | None = None,
               plugin_metrics: dict[str, str] | None = None, prefill_urls: list[str] | None = None) -> FastAPI:
    """The app over ``engine_urls`` (default: ``settings.engine_urls``) and, disaggregated, the prefill engines at
    ``prefill_urls`` (default: ``settings.prefill_urls``); engines must already be starting or up.

    ``plugin_metrics`` maps an engine URL to its scheduler plug-in's metrics URL, re-exported on ``/metrics``.
    """
    metrics = GatewayMetrics()
    pool = EnginePool(engine_urls or settings.engine_urls, settings, metrics)
    predictor = Predictor(settings.predictor_url, settings.predictor_timeout_ms, settings.fallback_tokens, metrics)
    feedback = FeedbackPoster(settings.predictor_url if settings.feedback else None, metrics)
    forwarder = Forwarder(pool, settings, metrics)
    prefill_urls = prefill_urls or settings.prefill_urls
    hop = PrefillHop(EnginePool(prefill_urls, settings, metrics, prefill=True), settings, metrics) if prefill_urls else None
    names = {e.url: e.name for e in [*pool.engines, *(hop.pool.engines if hop else [])]}
    plugin_targets = {names[u]: m for u, m in (plugin_metrics or {}).items() if u in names}
    slo = default_slo(settings)
    prompts = PromptCounter()
    rids = itertools.count()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        tokenizer = asyncio.get_running_loop().create_task(prompts.load(settings.model))
        await asyncio.gather(pool.start(), *([hop.pool.start()] if hop else []))  # the CLI waited for their /health
        if settings.model and pool.models and settings.model not in pool.models:
            log.warning("--model %s is not among the models the engines serve (%s)", settings.model, ", ".join(sorted(pool.models)))
        log.info("gateway ready: %d engine(s)%s, predictor %s, placement %s, prompt tokens: %s", len(pool.engines),
                 f" decoding after {len(hop.pool.engines)} prefill engine(s)" if hop else "",
                 settings.predictor_url or "none (fallback only)", settings.placement, prompts.method)
        yield
        tokenizer.cancel()
        await feedback.aclose()
        await pool.aclose()
        await forwarder.aclose()
        if hop:
            await hop.aclose()
        await predictor.aclose()

    app = FastAPI(title="lengthwise gateway", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible endpoint in front of vLLM engines running the lengthwise scheduler.")
    app.state.pool, app.state.metrics = pool, metrics

    def count(endpoint: str, status: int) -> None:
        metrics.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(status)).inc()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        count(request.url.path, exc.status_code)
        msg = {404: f"no such endpoint: {request.method} {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(msg, code="not_found" if exc.status_code == 404 else None),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        count(request.url.path, 500)
        return JSONResponse(error_body(f"internal gateway error ({type(exc).__name__}); see the gateway log", "server_error"),
                            status_code=500)

    async def _unless_client_leaves(request: Request, call) -> Response | None:
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

    async def generate(request: Request, kind: Kind) -> Response:
        t0 = time.perf_counter()
        arrival = time.time()
        endpoint = PATHS[kind]
        rid = "lw-" + uuid.uuid4().hex
        try:
            req = validate(kind, parse_json(await read_body(request, settings.max_body_bytes)), pool.models)
            client_terms = client_slo(request.headers)
            hint = request.headers.get("x-lengthwise-pred-len") if settings.trust_client_predictions else None
            pred = predictor.from_client(req, hint) if hint is not None else await predictor.predict(req, rid)
            metrics.predictions.labels(pred.source).inc()
            dl = deadline(arrival, pred.tokens, client_terms, slo)
            body, dropped = engine_body(req, pred, dl)
            if dropped:
                metrics.client_hints_dropped.inc(len(dropped))
                log.debug("request %s: client vllm_xargs %s replaced by the gateway's", rid, dropped)
            headers = {"X-Request-Id": rid}
            if "authorization" in request.headers:
                headers["Authorization"] = request.headers["authorization"]

            def on_done(out: Outcome) -> None:
                count(endpoint, out.status)
                metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
                if out.first_token_at is not None:
                    metrics.ttft.labels(endpoint).observe(out.first_token_at - t0)
                if out.status == 200 and out.completion_tokens is not None:
                    metrics.output_tokens.inc(out.completion_tokens)
                    feedback.submit(pred, out.completion_tokens, req.outputs)

            prompt_tokens, method = prompts.count(req)
            metrics.prompt_token_counts.labels(method).inc()
            job = Job(next(rids), prompt_tokens, float(pred.tokens * req.outputs), arrival=time.monotonic())
            prefilled = None
            if hop:
                prefilled = await hop.run(req, body, headers, job)
                if isinstance(prefilled, Response):  # the prefill engine refused the request: its answer is the client's
                    count(endpoint, prefilled.status_code)
                    prefilled.headers["x-lengthwise-request-id"] = rid
                    return prefilled
                body = prefilled.body
                if prefilled.prompt_tokens is not None:  # the engine's own count: exact, for the decode placement
                    prompt_tokens = job.prompt_len = prefilled.prompt_tokens
                    method = "prefill"
            if req.stream:  # a stream notices its client leaving itself (Starlette cancels the relay)
                resp = await forwarder.forward(req, body, headers, job, on_done)
            else:
                resp = await _unless_client_leaves(request, forwarder.forward(req, body, headers, job, on_done))
                if resp is None:
                    count(endpoint, 499)
                    log.info("request %s: the client went away before its answer; the engine call was cancelled", rid)
                    return Response(status_code=499)
        except ApiError as exc:
            count(endpoint, exc.status)
            resp = exc.response()
            resp.headers["x-lengthwise-request-id"] = rid
            return resp
        resp.headers.update({
            "x-lengthwise-request-id": rid, "x-lengthwise-pred-len": str(pred.tokens),
            "x-lengthwise-prediction": pred.source if pred.reason is None else f"fallback:{pred.reason}",
            "x-lengthwise-deadline": f"{dl:.3f}", "x-lengthwise-prompt-tokens": f"{prompt_tokens}:{method}"})
        if prefilled is not None:
            resp.headers.update({"x-lengthwise-prefill-engine": prefilled.engine,
                                 "x-lengthwise-prefill-ms": f"{prefilled.seconds * 1000:.1f}"})
        return resp

    @app.post("/v1/completions", summary="OpenAI completions (streaming or not), scheduled by predicted length")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions", summary="OpenAI chat completions (streaming or not), scheduled by predicted length")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    @app.get("/v1/models", summary="the models the engines serve")
    async def models() -> Response:
        for e in pool.engines:
            if e.healthy:
                try:
                    r = await pool.client.get(e.url + "/v1/models")
                except Exception:  # noqa: BLE001 - try the next engine
                    pool.suspect(e)
                    continue
                count("/v1/models", r.status_code)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        count("/v1/models", 503)
        return ApiError(503, "no healthy engine to list models from", code="engine_unavailable").response()

    @app.get("/health", summary="the gateway is up; engine health in the body")
    async def health() -> Response:
        up = sum(e.healthy for e in pool.engines)
        count("/health", 200)
        extra = {"prefill_engines": hop.pool.status()} if hop else {}
        serving = up and (hop is None or any(e.healthy for e in hop.pool.engines))  # disaggregated, both kinds are needed
        return JSONResponse({"status": "ok" if serving else "degraded", "healthy_engines": up, "engines": pool.status(), **extra,
                             "predictor_url": settings.predictor_url, "placement": settings.placement,
                             "placement_state": pool.placer.state(), "prompt_tokens": prompts.method})

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        body = metrics.render()
        if plugin_targets:
            from serving.gateway.plugin_metrics import scrape

            extra, failed = await scrape(pool.client, plugin_targets)
            for name in failed:
                metrics.plugin_scrape_errors.labels(name).inc()
            body = metrics.render() + extra if failed else body + extra
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app
