"""Refined predictions of running requests: at chosen points of each answer, the sidecar reads the prompt and the
answer so far, and the request's engine gets its prediction of the tokens still to come.

Why: a prompt alone cannot say which of its possible answers the engine will sample; the first tokens of the answer
do. The gateway relays every token, so it is where the answer so far can be read.

How: with ``refine_at`` set, each request carries a ``ref`` in ``vllm_xargs`` (its gateway request id). While its
stream is relayed, at each point of ``refine_at`` (tokens of the answer, as the stream counts them), the gateway asks
the sidecar (``POST /v1/predict/remaining``, the answer so far) and posts its answer, a
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
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
from pydantic import ValidationError

from serving.engine.channel import REFINE_PATH
from serving.gateway.assemble import assembles
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.requests import ClientRequest
from serving.gateway.settings import GatewaySettings
from serving.gateway.sse import StreamRelay
from serving.policy.hints import Refinement, Refinements

log = logging.getLogger("serving.gateway")

GATHER_LIMIT = 64  # refinements in one call to the sidecar or an engine, at most
ENGINE_TIMEOUT_S = 5.0  # an engine's port slower than this (its engine core busy for that long) is an engine_error


class Gather:
    """Calls to one endpoint gathered for up to ``window_s`` (or until ``limit`` wait) and sent as one: under load, one
    HTTP call carries many refinements, which is most of what a refinement costs the gateway. ``send`` takes the items
    and returns one outcome per item; it never raises (a failure is each item's outcome)."""

    def __init__(self, send: Callable[[list[Any]], Awaitable[list[Any]]], window_s: float, limit: int,
                 tasks: set[asyncio.Task]) -> None:
        self.send, self.window, self.limit, self.tasks = send, window_s, limit, tasks
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None

    def submit(self, item: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.pending.append((item, fut))
        if len(self.pending) >= self.limit:
            self.flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.window, self.flush)
        return fut

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _send(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        outcomes = await self.send([item for item, _ in batch])
        for (_, fut), outcome in zip(batch, outcomes, strict=True):
            if not fut.done():
                fut.set_result(outcome)


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
        self.keepalive_s = s.keepalive_s
        self.engine_headers = ({"Authorization": f"Bearer {s.engine_api_key.get_secret_value()}"} if s.engine_api_key
                               else {})
        self.sidecar_headers = {**(sidecar_headers or {}), "x-lengthwise-timeout-ms": f"{s.refine_timeout_ms:g}"}
        self._sessions: dict[str, aiohttp.ClientSession] = {}  # made in the event loop, at the first call
        self.inflight: set[asyncio.Task] = set()
        self.sends: set[asyncio.Task] = set()  # gathered calls in flight
        window = s.refine_window_ms / 1000.0
        self.to_sidecar = Gather(self._ask_sidecar, window, GATHER_LIMIT, self.sends)
        self.to_engine: dict[str, Gather] = {}  # by plug-in URL

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
        """One refinement: the sidecar's answer within the timeout, then the engine's receipt (each call gathered with
        others bound the same way)."""
        asked = self.to_sidecar.submit({**watch.ask, "answer_so_far": {"text": text, "tokens": tokens},
                                        "request_id": watch.ref})
        try:
            outcome, prediction = await asyncio.wait_for(asyncio.shield(asked), self.timeout)
        except TimeoutError:
            return "late"
        if outcome != "ok":
            return outcome
        try:
            update = _refinement(prediction, watch.ref, tokens)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.debug("refinement: sidecar answer not understood: %s", exc)
            return "sidecar_error"
        port = self.ports.get(watch.engine)
        if port is None:
            return "no_port"
        url = refine_url(port)
        gather = self.to_engine.get(url)
        if gather is None:
            gather = self.to_engine[url] = Gather(lambda updates, url=url: self._post_engine(url, updates),
                                                  self.to_sidecar.window, GATHER_LIMIT, self.sends)
        return await gather.submit(update)

    def _session(self, which: str) -> aiohttp.ClientSession:
        """The sidecar's or the engines' HTTP session. aiohttp rather than the httpx of the gateway's other calls: a
        call costs the gateway about a third of the CPU (measured: 0.45 against 1.4 ms a call on the 2-core machine),
        and refinements are many small calls beside the answers they ride on. The sidecar closes connections idle for
        5 s (uvicorn's), so they are reused for less than that; the plug-in's port keeps its own open."""
        session = self._sessions.get(which)
        if session is None or session.closed:
            sidecar = which == "sidecar"
            connector = aiohttp.TCPConnector(limit=16 if sidecar else 64,
                                             keepalive_timeout=self.keepalive_s if sidecar else 60.0)
            session = self._sessions[which] = aiohttp.ClientSession(
                connector=connector, headers=self.sidecar_headers if sidecar else self.engine_headers,
                timeout=aiohttp.ClientTimeout(total=max(1.0, self.timeout * 4) if sidecar else ENGINE_TIMEOUT_S))
        return session

    async def _post(self, which: str, url: str, body: str) -> tuple[int, str]:
        async with self._session(which).post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            return r.status, await r.text()

    async def _ask_sidecar(self, items: list[dict]) -> list[tuple[str, dict | None]]:
        """One call of ``POST /v1/predict/remaining`` for ``items``: each item's ("ok", its prediction) or (outcome,
        None)."""
        assert self.url is not None
        try:
            status, text = await self._post("sidecar", self.url + "/v1/predict/remaining", json.dumps({"items": items}))
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("refinement: sidecar unreachable: %s", exc)
            return [("sidecar_error", None)] * len(items)
        if status != 200:
            log.debug("refinement: sidecar answered %d: %s", status, text[:200])
            outcome = "late" if status == 504 else "refused" if status < 500 else "sidecar_error"
            return [(outcome, None)] * len(items)
        try:
            results = json.loads(text)["results"]
            if len(results) != len(items):
                raise ValueError(f"{len(results)} results for {len(items)} items")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("refinement: sidecar answer not understood: %s", exc)
            return [("sidecar_error", None)] * len(items)
        return [("refused", None) if "error" in x else ("ok", x) for x in results]

    async def _post_engine(self, url: str, updates: list[Refinement]) -> list[str]:
        """One call of the plug-in's ``POST /v1/refine`` for ``updates``: each one's outcome."""
        body = Refinements(refinements=updates).model_dump_json(exclude_none=True)
        try:
            status, text = await self._post("engines", url, body)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.debug("refinement: plug-in port %s unreachable: %s", url, exc)
            return ["engine_error"] * len(updates)
        if status != 200:
            log.warning("refinement: plug-in port %s answered %d: %s", url, status, text[:200])
            return ["engine_error"] * len(updates)
        try:
            queued = set(json.loads(text)["queued"])
        except (ValueError, KeyError, TypeError):
            return ["engine_error"] * len(updates)
        return ["delivered" if u.ref in queued else "gone" for u in updates]

    async def aclose(self) -> None:
        for task in [*self.inflight, *self.sends]:
            task.cancel()
        await asyncio.gather(*self.inflight, *self.sends, return_exceptions=True)
        for session in self._sessions.values():
            await session.close()


def _refinement(p: dict, ref: str, tokens: int) -> Refinement:
    """The sidecar's prediction ``p`` as the plug-in takes it; a distribution the plug-in would refuse is left out (the
    point still serves)."""
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
