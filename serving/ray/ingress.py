"""The OpenAI-compatible ingress deployment: the HTTP gateway's request steps, with the engines behind a Ray handle.

Per request the ingress runs :meth:`Gateway.serve <serving.gateway.gateway.Gateway.serve>` itself (admission →
validate → SLO headers → prompt tokens → predict through the sidecar → deadline → hints in ``vllm_xargs`` → the
engine's headers → the request as placement sees it → forward → feedback and headers). Only the last step differs:
:meth:`RayGateway.forward` sends the engine body through the engine deployment's handle, with the request's
:class:`~serving.ray.routing.RouteHint` (its id, prompt tokens and predicted length) as the ``route`` keyword, where
:class:`~serving.ray.router.LengthwiseRequestRouter` reads it. Placement and engine health are Ray's here (its
router, its replica health checks and restarts), not the gateway pool's, so the pool stays empty.

A replica that dies under a request (its actor or process gone: ``RayActorError``) is handled as the HTTP gateway
handles a failed engine: while the client has seen nothing (a non-streamed request before its whole answer, a stream
before its first event) the request is sent again, to whichever replica Ray's router picks now (it drops a dead replica
at once), up to ``max(2, engines)`` tries, then a 503 in OpenAI's error format; a stream that already sent events ends
with an error event and ``[DONE]``. Both are counted (``engine_retries`` and ``stream_errors`` on ``/health`` and in the
gateway's metrics).

Streams are relayed with the gateway's SSE relay (:class:`~serving.gateway.sse.StreamRelay`: the usage chunk the
gateway asked for on its own behalf is dropped again, the actual length feeds the sidecar).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from ray import serve
from ray.exceptions import RayActorError, RayError, WorkerCrashedError
from starlette.responses import StreamingResponse

from serving.gateway.app import gateway_app
from serving.gateway.errors import ApiError, sse_error
from serving.gateway.feedback import finish_reason_of
from serving.gateway.forward import Outcome
from serving.gateway.gateway import Call, Gateway, Waiter
from serving.gateway.redact import engine_error, hide_deployment, model_card
from serving.gateway.requests import ClientRequest
from serving.gateway.settings import GatewaySettings
from serving.gateway.sse import StreamRelay, sse_data
from serving.placement import Job
from serving.ray.router import ingress_rank
from serving.ray.routing import ROUTE_KWARG, RouteHint
from serving.ray.timing import router_timings

log = logging.getLogger("serving.ray")
REPLICA_GONE = (RayActorError, WorkerCrashedError)  # the replica (its actor, its process) is gone: retry elsewhere


async def _lines(chunks: AsyncIterator[Any]) -> AsyncIterator[str]:
    """The text lines of a byte stream (an SSE body), as :func:`serving.gateway.sse.sse_data` reads them."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if buf:
        yield buf.decode()


class RayGateway(Gateway):
    """The gateway's steps over an engine deployment handle instead of an engine pool."""

    def __init__(self, settings: GatewaySettings, engine: Any) -> None:
        super().__init__(settings.model_copy(update={"engine_urls": [], "prefill_urls": []}), engine_urls=[])
        self.engine = engine
        self.served: dict[str, int] = {}  # answers by engine replica
        self.retries = 0  # requests sent again because their replica died before the client saw anything
        self.stream_errors = 0  # streams cut by a replica that died after their first event

    async def start(self) -> None:
        """The tokenizer and the sidecar watchers as the HTTP gateway starts them; the models from an engine replica."""
        s, loop = self.settings, asyncio.get_running_loop()
        self._tokenizer = loop.create_task(self.prompts.load(s.model))
        if s.predictor_url:
            self._target_task = loop.create_task(self._watch_target())
            self._sidecar_task = loop.create_task(self._watch_sidecar())
        status, body = await self.engine.get.remote("/v1/models")
        if status == 200:
            self.pool.known_models = {m["id"] for m in json.loads(body)["data"]}
        log.info("ray ingress ready: models %s, predictor %s", sorted(self.pool.known_models), s.predictor_url or "none")

    async def forward(self, call: Call, req: ClientRequest, body: dict[str, Any], headers: dict[str, str], job: Job,
                      wait: Waiter) -> Response | None:
        hint = RouteHint(call.rid, job.prompt_len, job.pred_len).as_dict()
        raw, hdrs = json.dumps(body).encode(), {"content-type": "application/json", **headers}

        def send() -> Any:
            return self.engine.options(stream=True).generate.remote(req.path, raw, hdrs, **{ROUTE_KWARG: hint})

        # a stream too, until its first event: nothing notices its client leave before that
        return await wait(self._stream(call, req, send) if req.stream else self._unary(call, req, send))

    def _tries(self) -> int:
        return max(2, self.settings.engines)

    def _gone(self, exc: BaseException, engine: str | None, tries: int, rid: str) -> None:
        """A replica died under a request the client has seen nothing of: count it, or give up after ``tries``."""
        self.metrics.engine_retries.labels(engine or "?", "replica_died").inc()
        self.retries += 1
        if tries >= self._tries():
            raise ApiError(503, f"no engine replica could answer: {tries} died under this request (last: "
                                f"{type(exc).__name__}); retry later", code="engine_unavailable",
                           headers={"Retry-After": "1"}) from None
        log.warning("request %s: engine replica %s died before answering (%s); sending it again", rid, engine or "?",
                    type(exc).__name__)

    async def _start(self, gen: Any) -> tuple[int, dict[str, str]]:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            raise ApiError(502, "the engine replica closed the answer before it began", code="engine_error") from None

    def _served(self, engine: str | None) -> None:
        name = engine or "?"
        self.served[name] = self.served.get(name, 0) + 1

    async def _begin(self, call: Call, send: Callable[[], Any],
                     opening: Callable[[Any, int], Awaitable[Any]]) -> tuple[Any, int, dict[str, str], str | None, Any]:
        """Send until a replica gets as far as ``opening`` reads (the whole answer, or a stream's first event): the
        client has seen nothing before that, so a replica that dies on the way costs a retry elsewhere.

        Returns the answer's generator, status, headers, the replica that answered and what ``opening`` read."""
        tries = 0
        while True:
            tries += 1
            engine = None
            try:
                gen = send()
                status, headers = await self._start(gen)
                engine = headers.get("x-lengthwise-engine")
                opened = await opening(gen, status)
                self._served(engine)
                return gen, status, headers, engine, opened
            except REPLICA_GONE as exc:
                self._gone(exc, engine, tries, call.rid)

    async def _unary(self, call: Call, req: ClientRequest, send: Callable[[], Any]) -> Response:
        """The whole answer, sent again while a replica dies before it is complete."""
        async def whole(gen: Any, status: int) -> bytes:
            return b"".join([chunk async for chunk in gen])

        _, status, headers, engine, content = await self._begin(call, send, whole)
        out = Outcome(status, engine)
        if status == 200:
            try:
                answer = json.loads(content)
                out.finish_reason = finish_reason_of(answer)
                out.completion_tokens = int(answer["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                pass
        self.finished(call, req, out)
        content = content if status == 200 else engine_error(content, status)
        return Response(content, status_code=status, media_type=headers.get("content-type", "application/json"),
                        headers={"x-lengthwise-engine": out.engine or "?"})

    async def _stream(self, call: Call, req: ClientRequest, send: Callable[[], Any]) -> Response:
        """The stream, once its first event came (sent again while a replica dies before that); a replica that dies
        after that ends the client's stream with an error event and ``[DONE]`` (the client holds half an answer)."""
        async def first_event(gen: Any, status: int) -> Any:
            if status != 200:  # vLLM's refusal, whole
                return b"".join([chunk async for chunk in gen])
            events = sse_data(_lines(gen))
            return events, await anext(events, None)

        gen, status, headers, engine, opened = await self._begin(call, send, first_event)
        if status != 200:
            self.finished(call, req, Outcome(status, engine))
            return Response(engine_error(opened, status), status_code=status,
                            media_type=headers.get("content-type", "application/json"))
        events, first = opened
        relay = StreamRelay(req.wants_usage)

        async def relayed() -> AsyncIterator[bytes]:
            out = Outcome(200, engine)
            try:
                data = first
                while data is not None:
                    piece = relay.relay(data)
                    if piece is not None:
                        yield piece
                    data = await anext(events, None)
            except RayError as exc:
                if not relay.done:
                    out.status = 502
                    self.metrics.stream_errors.labels(engine or "?").inc()
                    self.stream_errors += 1
                    log.warning("stream %s cut after %d events: engine replica %s failed (%s)", call.rid, relay.events,
                                engine, type(exc).__name__)
                    yield sse_error(f"the engine replica failed after part of the answer was sent: {type(exc).__name__}")
            finally:
                out.completion_tokens, out.finish_reason = relay.completion_tokens, relay.finish_reason
                out.first_token_at = relay.first_token_at
                if not relay.done:
                    out.status = 499 if out.status == 200 else out.status
                    gen.cancel()
                self.finished(call, req, out)

        return StreamingResponse(relayed(), status_code=200, media_type="text/event-stream",
                                 headers={"x-lengthwise-engine": engine or "?"})

    async def models(self) -> Response:
        status, body = await self.engine.get.remote("/v1/models")
        self.count("/v1/models", status)
        if status == 200:  # without the directories the models were loaded from, as the HTTP gateway lists them
            try:
                listed = json.loads(body)
                listed["data"] = [model_card(c) for c in listed["data"]]
                body = json.dumps(listed).encode()
            except (ValueError, KeyError, TypeError):
                body = json.dumps({"object": "list", "data": []}).encode()
        return Response(body, status_code=status, media_type="application/json")

    def health(self, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The HTTP gateway's ``/health`` for the Ray backend (no engine addresses here; the sidecar's only to a caller
        with a key, or from a gateway without keys)."""
        shown = not self.keys.enabled or (headers is not None and self.keys.allows(headers))
        state, detail = self.predictor_state
        down = f"predictor {state}: {detail}; requests run on the fallback length"
        reasons = [] if state in ("ok", "none", "unchecked") else [down]
        body = {"status": "degraded" if reasons else "ok", "reasons": reasons, "backend": "ray",
                "healthy_engines": 1 if self.pool.known_models else 0, "served_by_engine": dict(self.served),
                "engine_retries": self.retries, "stream_errors": self.stream_errors, "routers": router_timings(),
                "predictor_url": self.settings.predictor_url if shown else None,
                "predictor": {"state": state, "detail": detail},
                "placement": self.settings.placement, "inflight": self.admission.inflight,
                "ingress": {"rank": ingress_rank(), "replicas": self.settings.replicas}}
        self.count("/health", 200)
        return body if shown else hide_deployment(body)


def create_ingress_app(settings: GatewaySettings, engine: Any) -> FastAPI:
    """The ingress's FastAPI app: the HTTP gateway's app (routes, error handling, published contract) over a
    :class:`RayGateway`."""
    return gateway_app(RayGateway(settings, engine), title="lengthwise gateway (Ray Serve)",
                       description="OpenAI-compatible endpoint in front of vLLM engine replicas on Ray Serve, placed by "
                                   "predicted length.")


@serve.ingress()
class Ingress:
    """The ingress deployment: ``settings`` the gateway's, ``engine`` the engine deployment's handle."""

    def __init__(self, settings: GatewaySettings, engine: Any) -> None:
        self.settings, self.engine, self.t0 = settings, engine, time.time()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_ingress_app(self.settings, self.engine)
