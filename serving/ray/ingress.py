"""The OpenAI-compatible ingress deployment: the HTTP gateway's request steps, with the engines behind a Ray handle.

Per request the ingress runs :meth:`Gateway.serve <serving.gateway.gateway.Gateway.serve>` itself (admission →
validate → SLO headers → prompt tokens → predict through the sidecar → deadline → hints in ``vllm_xargs`` → the
engine's headers → the request as placement sees it → forward → feedback and headers). Only the last step differs:
:meth:`RayGateway.forward` sends the engine body through the engine deployment's handle, with the request's
:class:`~serving.ray.routing.RouteHint` (its id, prompt tokens and predicted length) as the ``route`` keyword, where
:class:`~serving.ray.router.LengthwiseRequestRouter` reads it. Placement, retries on another engine and engine health
are Ray's here (its router, its replica health checks), not the gateway pool's, so the pool stays empty.

Streams are relayed with the gateway's SSE relay (:class:`~serving.gateway.sse.StreamRelay`: the usage chunk the
gateway asked for on its own behalf is dropped again, the actual length feeds the sidecar).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from ray import serve
from starlette.responses import StreamingResponse

from serving.gateway.app import gateway_app
from serving.gateway.errors import ApiError
from serving.gateway.feedback import finish_reason_of
from serving.gateway.forward import Outcome
from serving.gateway.gateway import Call, Gateway, Waiter
from serving.gateway.requests import ClientRequest
from serving.gateway.settings import GatewaySettings
from serving.gateway.sse import StreamRelay, sse_data
from serving.placement import Job
from serving.ray.routing import ROUTE_KWARG, RouteHint

log = logging.getLogger("serving.ray")


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
        hint = RouteHint(call.rid, job.prompt_len, job.pred_len)
        gen = self.engine.options(stream=True).generate.remote(
            req.path, json.dumps(body).encode(), {"content-type": "application/json", **headers}, **{ROUTE_KWARG: hint.as_dict()})
        if req.stream:
            return await self._stream(call, req, gen)
        return await wait(self._unary(call, req, gen))

    async def _start(self, gen: Any) -> tuple[int, dict[str, str]]:
        try:
            status, headers = await gen.__anext__()
        except StopAsyncIteration:
            raise ApiError(502, "the engine replica closed the answer before it began", code="engine_error") from None
        name = headers.get("x-lengthwise-engine", "?")
        self.served[name] = self.served.get(name, 0) + 1
        return status, headers

    async def _unary(self, call: Call, req: ClientRequest, gen: Any) -> Response:
        status, headers = await self._start(gen)
        content = b"".join([chunk async for chunk in gen])
        out = Outcome(status, headers.get("x-lengthwise-engine"))
        if status == 200:
            try:
                answer = json.loads(content)
                out.finish_reason = finish_reason_of(answer)
                out.completion_tokens = int(answer["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                pass
        self.finished(call, req, out)
        return Response(content, status_code=status, media_type=headers.get("content-type", "application/json"),
                        headers={"x-lengthwise-engine": out.engine or "?"})

    async def _stream(self, call: Call, req: ClientRequest, gen: Any) -> Response:
        status, headers = await self._start(gen)
        engine = headers.get("x-lengthwise-engine")
        if status != 200:  # vLLM's refusal, whole
            content = b"".join([chunk async for chunk in gen])
            self.finished(call, req, Outcome(status, engine))
            return Response(content, status_code=status, media_type=headers.get("content-type", "application/json"))
        relay = StreamRelay(req.wants_usage)

        async def events() -> AsyncIterator[bytes]:
            out = Outcome(200, engine)
            try:
                async for data in sse_data(_lines(gen)):
                    piece = relay.relay(data)
                    if piece is not None:
                        yield piece
            finally:
                out.completion_tokens, out.finish_reason = relay.completion_tokens, relay.finish_reason
                out.first_token_at = relay.first_token_at
                if not relay.done:
                    out.status = 499
                    gen.cancel()
                self.finished(call, req, out)

        return StreamingResponse(events(), status_code=200, media_type="text/event-stream",
                                 headers={"x-lengthwise-engine": engine or "?"})

    async def models(self) -> Response:
        status, body = await self.engine.get.remote("/v1/models")
        self.count("/v1/models", status)
        return Response(body, status_code=status, media_type="application/json")

    def health(self) -> dict[str, Any]:
        state, detail = self.predictor_state
        down = f"predictor {state}: {detail}; requests run on the fallback length"
        reasons = [] if state in ("ok", "none", "unchecked") else [down]
        body = {"status": "degraded" if reasons else "ok", "reasons": reasons, "backend": "ray",
                "healthy_engines": 1 if self.pool.known_models else 0, "served_by_engine": dict(self.served),
                "predictor_url": self.settings.predictor_url, "predictor": {"state": state, "detail": detail},
                "placement": self.settings.placement, "inflight": self.admission.inflight}
        self.count("/health", 200)
        return body


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
