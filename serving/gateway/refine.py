"""Refined predictions of running requests: at chosen points of each answer, the sidecar reads the prompt and the
answer so far, and the request's engine gets its prediction of the tokens still to come.

Why: a prompt alone cannot say which of its possible answers the engine will sample; the first tokens of the answer
do. The gateway relays every token, so it is where the answer so far can be read.

How: with ``refine_at`` set, each request carries a ``ref`` in ``vllm_xargs`` (its gateway request id). While its
stream is relayed, at each point of ``refine_at`` (tokens of the answer, as the stream counts them), the gateway asks
the sidecar (``POST /v1/predict`` with ``answer_so_far``) and posts its answer, a
:class:`~serving.policy.hints.Refinement`, to the plug-in port of the engine the request runs on (``POST /v1/refine``
on the port of its ``/metrics``, with the engine key as bearer: :mod:`serving.engine.channel`). The relay never waits
for either: a refinement runs beside it.

A refinement that cannot be timely is skipped, never queued, and counted in ``lengthwise_gateway_refinements_total``:
over ``refine_max_inflight`` in flight, or the same request's previous one still in flight (``busy``); a sidecar
slower than ``refine_timeout_ms`` (``late``: its answer, when it comes, is dropped); a sidecar that refuses
(``refused``: for instance a version trained on prompts alone) or fails (``sidecar_error``); an engine that no longer
runs the request (``gone``: it finished, or its engine started again) or does not answer (``engine_error``). A
request whose engine's plug-in port is unknown (attached without ``--engine-metrics-url``) gets none (``no_port``).
The request itself never waits, fails or changes for any of these.

A non-streamed request is read from its engine as a stream and given to its client whole
(:mod:`serving.gateway.assemble`), where its answer is the sum of its stream's parts (``refine_unary``, on by default).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import httpx
from pydantic import ValidationError

from serving.engine.channel import REFINE_PATH
from serving.gateway.assemble import assembles
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.requests import ClientRequest
from serving.gateway.settings import GatewaySettings
from serving.gateway.sse import StreamRelay
from serving.policy.hints import Refinement

log = logging.getLogger("serving.gateway")


def refine_url(metrics_url: str) -> str:
    """The plug-in's refinement endpoint beside its ``/metrics`` (one port serves both)."""
    base = metrics_url.rstrip("/")
    return base.removesuffix("/metrics") + REFINE_PATH


class Refiner:
    """The gateway's refinements: one :class:`Watch` per relayed stream, and the calls they start."""

    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, ports: Mapping[str, str],
                 sidecar_headers: Mapping[str, str] | None = None) -> None:
        """``ports``: engine name -> its plug-in ``/metrics`` URL, read at each refinement (an engine started again
        gets a new one)."""
        s = settings
        self.points = tuple(sorted(set(s.refine_at)))
        self.url = s.predictor_url
        self.timeout = s.refine_timeout_ms / 1000.0
        self.max_inflight = s.refine_max_inflight
        self.unary = s.refine_unary
        self.metrics, self.ports = metrics, ports
        engine_auth = {"Authorization": f"Bearer {s.engine_api_key.get_secret_value()}"} if s.engine_api_key else {}
        self.engine_headers = engine_auth
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(max(1.0, self.timeout * 4)),
            limits=httpx.Limits(max_connections=self.max_inflight, max_keepalive_connections=16,
                                keepalive_expiry=s.keepalive_s),
            headers={**(sidecar_headers or {}), "x-lengthwise-timeout-ms": f"{s.refine_timeout_ms:g}"})
        self.inflight: set[asyncio.Task] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.points) and self.url is not None

    def reads_whole(self, req: ClientRequest) -> bool:
        """Whether a non-streamed ``req`` is read from its engine as a stream, to be refined
        (:func:`serving.gateway.assemble.assembles`)."""
        return self.enabled and self.unary and req.predict_input is not None and assembles(req)

    def watch(self, req: ClientRequest, body: dict, engine: str) -> Watch | None:
        """A stream's watch, or None when it gets no refinements (off, no ref, no text to predict from, no port)."""
        ref = (body.get("vllm_xargs") or {}).get("ref")
        if not self.enabled or ref is None or req.predict_input is None:
            return None
        if engine not in self.ports:
            self.metrics.refinements.labels("no_port").inc()
            return None
        ask = {**req.predict_input, **({"model": req.model} if req.model else {})}
        return Watch(self, ref, engine, ask)

    def _start(self, watch: Watch, text: str, tokens: int) -> asyncio.Task | None:
        if len(self.inflight) >= self.max_inflight:
            self.metrics.refinements.labels("busy").inc()
            return None
        task = asyncio.get_running_loop().create_task(self._one(watch, text, tokens, time.perf_counter()))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)
        return task

    async def _one(self, watch: Watch, text: str, tokens: int, t0: float) -> None:
        outcome = await self._refine(watch, text, tokens)
        self.metrics.refinements.labels(outcome).inc()
        if outcome == "delivered":
            self.metrics.refinement_delay.observe(time.perf_counter() - t0)

    async def _refine(self, watch: Watch, text: str, tokens: int) -> str:
        assert self.url is not None
        body = {**watch.ask, "answer_so_far": {"text": text, "tokens": tokens}}
        # shielded, as the first prediction's call is (serving/gateway/prediction.py): a call cancelled as its answer
        # arrives loses its connection; a late one runs on to its answer, which is dropped
        call = asyncio.ensure_future(self.client.post(self.url + "/v1/predict", json=body))
        try:
            r = await asyncio.wait_for(asyncio.shield(call), self.timeout)
        except TimeoutError:
            call.add_done_callback(_consume)
            return "late"
        except httpx.HTTPError as exc:
            log.debug("refinement: sidecar unreachable: %s", exc)
            return "sidecar_error"
        if r.status_code != 200:
            log.debug("refinement: sidecar answered %d: %s", r.status_code, r.text[:200])
            return "refused" if r.status_code < 500 else "sidecar_error"
        try:
            update = _refinement(r.json(), watch.ref, tokens)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.debug("refinement: sidecar answer not understood: %s", exc)
            return "sidecar_error"
        port = self.ports.get(watch.engine)
        if port is None:
            return "no_port"
        try:
            e = await self.client.post(refine_url(port), content=update.model_dump_json(exclude_none=True),
                                       headers={**self.engine_headers, "Content-Type": "application/json"},
                                       timeout=max(1.0, self.timeout * 4))
        except httpx.HTTPError as exc:
            log.debug("refinement: %s's plug-in port unreachable: %s", watch.engine, exc)
            return "engine_error"
        if e.status_code == 202:
            return "delivered"
        if e.status_code == 404:
            return "gone"
        log.warning("refinement: %s's plug-in port answered %d: %s", watch.engine, e.status_code, e.text[:200])
        return "engine_error"

    async def aclose(self) -> None:
        for task in list(self.inflight):
            task.cancel()
        await asyncio.gather(*self.inflight, return_exceptions=True)
        await self.client.aclose()


def _consume(task: asyncio.Future) -> None:
    """A late call's end: its outcome read, so nothing is logged as never retrieved."""
    if not task.cancelled():
        task.exception()


def _refinement(answer: dict, ref: str, tokens: int) -> Refinement:
    """The sidecar's answer as the plug-in takes it; a distribution the plug-in would refuse is left out (the point
    still serves)."""
    p = answer["predictions"][0]
    point = {"ref": ref, "generated_tokens": tokens, "pred_len": float(p["expected_tokens"])}
    try:
        return Refinement.model_validate({**point, "pred_edges": p.get("edges"), "pred_probs": p.get("probs")})
    except ValidationError:
        return Refinement.model_validate(point)


class Watch:
    """One stream's refinement points: :meth:`seen` after each relayed event starts the one it has reached."""

    __slots__ = ("ask", "engine", "next", "ref", "refiner", "task")

    def __init__(self, refiner: Refiner, ref: str, engine: str, ask: dict) -> None:
        self.refiner, self.ref, self.engine, self.ask = refiner, ref, engine, ask
        self.next = 0  # index of the next point in refiner.points
        self.task: asyncio.Task | None = None

    def seen(self, relay: StreamRelay) -> None:
        points, tokens = self.refiner.points, relay.token_events
        if self.next >= len(points) or tokens < points[self.next]:
            return
        while self.next < len(points) and tokens >= points[self.next]:
            self.next += 1  # an event that passes several points asks once, for where the answer is
        if self.task is not None and not self.task.done():
            self.refiner.metrics.refinements.labels("busy").inc()
            return
        self.task = self.refiner._start(self, relay.answer, tokens)


__all__ = ["Refiner", "Watch", "refine_url"]
