"""Send a request to an engine and bring the answer back; retry elsewhere while the client has seen nothing.

The rule that keeps accepted requests from being lost: until the first byte of an answer has gone to
the client, a failed engine (refused or broken connection, a 503, a 5xx from an engine that then fails
its health probe, or an engine taken out by the health checks while the request waited in its queue)
costs only a retry on another engine, each engine at most once. When none is left the client gets a
503 in OpenAI's error format, never a hang. Some failures need not be the engine's: a kept-alive
connection that the engine's server closed as idle just as the request went out on it ("disconnected
without sending a response"), the same connection reset, and a connect timeout on a busy machine. If the
engine then passes a health probe, the request goes to it again, once at once; and once every engine was
tried, up to ``transient_retries`` more times after a growing pause, to whichever such engine passes a
probe then.
Connections idle longer than ``keepalive_s`` (below vLLM's own 5 s keep-alive) are not reused, which
makes that race rare. A stream that already sent tokens cannot be replayed (the
client holds half an answer), so it ends with an error event and ``[DONE]``.

Engine answers other than these pass through: a 4xx from vLLM is the client's error, told in vLLM's words, cut to a
bounded size (:func:`~serving.gateway.redact.engine_error`: vLLM quotes the client's input back, 712 KB of it for
100,000 ``stop_token_ids``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from serving.gateway.admission import overloaded
from serving.gateway.assemble import Assembler, as_stream
from serving.gateway.concurrency import Served
from serving.gateway.errors import ApiError, sse_error
from serving.gateway.feedback import finish_reason_of
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.pool import Engine, EnginePool, engine_client
from serving.gateway.quarantine import CrashQuarantine, Fingerprint, Pass, Probation
from serving.gateway.redact import engine_error, quote
from serving.gateway.refine import Refiner, Watch
from serving.gateway.requests import ClientRequest
from serving.gateway.settings import GatewaySettings
from serving.gateway.slow_clients import ClientStream
from serving.gateway.sse import StreamRelay, sse_data
from serving.placement import Job

log = logging.getLogger("serving.gateway")


class _Retry(Exception):
    """This engine failed before the client saw anything: try another.

    ``echo`` is what the engine said (an excerpt of its answer), which may quote the request: it goes into the client's
    error message, and into the log only with ``--log-prompts``.
    """

    def __init__(self, reason: str, detail: str, echo: str = ""):
        super().__init__(f"{detail}: {echo}" if echo else detail)
        self.reason, self.detail = reason, detail


@dataclass
class Outcome:
    """What the app needs after the answer is complete: for metrics and feedback."""

    status: int
    engine: str | None
    completion_tokens: int | None = None
    finish_reason: str | None = None  # the engine's, for feedback: "length" means the answer was capped
    first_token_at: float | None = None  # time.perf_counter() when the first generated token passed (streams)


class Forwarder:
    def __init__(self, pool: EnginePool, settings: GatewaySettings, metrics: GatewayMetrics,
                 quarantine: CrashQuarantine | None = None):
        self.pool, self.settings, self.metrics = pool, settings, metrics
        self.quarantine = quarantine or CrashQuarantine(0)
        self.probation = Probation()
        self.refiner: Refiner | None = None  # set by the gateway where it refines predictions of running requests
        s = settings
        self.per_engine = s.outstanding_bounds(len(pool.engines))[0]
        self.client = engine_client(
            s, httpx.Timeout(s.engine_timeout_s, connect=s.connect_timeout_s, pool=None),
            httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=s.keepalive_s))

    async def aclose(self) -> None:
        await self.client.aclose()

    async def forward(self, req: ClientRequest, body: dict, headers: dict[str, str], job: Job,
                      on_done: Callable[[Outcome], None], fingerprint: Fingerprint | None = None) -> Response:
        """The client's response; ``on_done`` runs once when it is complete (streams: after the last event).

        ``job`` is the request as placement sees it: placed on an engine's view for each attempt, it leaves
        that view when the attempt fails (and is placed afresh for the next) or when the answer is complete.
        An engine that dies under the request is charged to its ``fingerprint``; after two deaths it is sent again only
        on probation, and one on probation whose engine dies is refused (:mod:`serving.gateway.quarantine`).
        """
        suspicion = _Suspicion(fingerprint)
        await suspicion.probation_if_suspect(self.quarantine, self.probation)

        def finished(out: Outcome) -> None:
            suspicion.leave()
            on_done(out)

        try:
            resp = await self._attempts(req, body, headers, job, finished, suspicion)
        except BaseException:
            suspicion.leave()
            raise
        if isinstance(resp, StreamingResponse):  # its turn lasts until its last event (or a stream never read)
            resp.background = then_run(resp.background, suspicion.leave)
        else:
            suspicion.leave()
        return resp

    async def _attempts(self, req: ClientRequest, body: dict, headers: dict[str, str], job: Job,
                        on_done: Callable[[Outcome], None], suspicion: _Suspicion) -> Response:
        """:meth:`forward`'s tries, engine after engine."""
        tried: list[str] = []
        failure: tuple[Engine, _Retry] | None = None
        again: Engine | None = None  # the engine that dropped a kept-alive connection and then passed a probe
        transient: dict[str, Engine] = {}  # engines whose last failure of this request a live engine can cause
        returns = 0  # goes back to those, once every engine was tried
        full: frozenset[str] = frozenset()  # engines at --max-outstanding-per-engine: not chosen
        others = self.pool.not_serving(req.model)  # engines of other models: never chosen
        restarts_awaited, lives = 0, {}  # an engine tried in one life is a new process in the next: tried afresh
        while True:
            engine = again
            tried = [n for n in tried if self.pool.life(n) == lives[n]]
            if engine is None and len(tried) < self.settings.max_attempts:
                # the per-engine bound is admission: a request already accepted that lost its engine is retried on
                # any live one, full or not, rather than failed
                full = self.pool.full(self.per_engine) - others if not tried else frozenset()
                engine = self.pool.place(job, frozenset(tried) | full | others)
            if engine is None and returns < self.settings.transient_retries:
                engine = await self._return_to(job, transient, returns)
                returns += engine is not None
            if engine is None and restarts_awaited < self.settings.max_attempts:
                back = await self._restarted(others)  # nothing was sent: better late than a 503
                if back is not None:
                    restarts_awaited += 1
                    continue
            if engine is None:
                break
            if failure is not None:
                self.metrics.engine_retries.labels(failure[0].name, failure[1].reason).inc()
                log.info("request %s: retrying on %s after %s failed (%s)", headers.get("X-Request-Id"), engine.name,
                         failure[0].name, failure[1] if self.settings.log_prompts else failure[1].detail)
            if again is None and engine.name not in tried:
                tried.append(engine.name)
                lives[engine.name] = engine.life
            retried_here, again = engine is (failure[0] if failure else None), None
            done = _Learner(engine, on_done, self.metrics)
            try:
                if req.stream:
                    return await self._stream(engine, req, body, headers, job, done, suspicion)
                if self.refiner is not None and self.refiner.reads_whole(req):
                    return await self._assembled(engine, req, body, headers, job, done)
                return await self._unary(engine, req, body, headers, job, done)
            except _Retry as exc:
                failure = (engine, exc)
                # a connection that broke on a live engine (an idle connection's race) is no death: probe before blaming
                alive = exc.reason in MAYBE_ALIVE and await self.pool.verify(engine)
                if not alive and self._charge(engine, exc.reason, suspicion):
                    log.warning("request %s: refused for a while and not sent again: its engine died while it ran alone "
                                "among suspects (%s)", headers.get("X-Request-Id"), exc.detail)
                    self.metrics.rejected.labels("quarantined").inc()
                    assert suspicion.fingerprint is not None
                    self.quarantine.check(suspicion.fingerprint)  # raises
                await suspicion.probation_if_suspect(self.quarantine, self.probation)  # its next try: alone among suspects
                if exc.reason not in SECOND_CHANCE:
                    transient.pop(engine.name, None)
                    continue
                transient[engine.name] = engine
                if not retried_here and alive:
                    self.pool.place_on(job, engine)
                    again = engine
        if failure is None and any(e.healthy and e.name in full for e in self.pool.engines):
            self.metrics.rejected.labels("engine_full").inc()
            bounds = sorted({e.limit.bound if e.limit else self.per_engine for e in self.pool.engines if e.name in full})
            raise overloaded(f"{'/'.join(map(str, bounds))} requests in flight on every engine")
        if failure is None and others:
            mine = [e.name for e in self.pool.engines if e.name not in others]
            msg = (f"no healthy engine serves '{quote(req.model)}' ({', '.join(mine) or 'none lists it now'}: down); the other "
                   "models are served")
        elif failure is None:
            msg = "no healthy engine is available" + (f" (all {len(self.pool.engines)} are down)" if self.pool.engines else "")
        else:
            msg = (f"no healthy engine left for this request: tried {', '.join(tried)}; last error from "
                   f"{failure[0].name}: {failure[1]}")
        raise ApiError(503, msg + "; retry later", code="engine_unavailable", headers={"Retry-After": "1"})

    def _charge(self, engine: Engine, reason: str, suspicion: _Suspicion) -> bool:
        """The request's engine died under it (:data:`DEATHS`, or a 5xx after which it failed its probe): a suspect now,
        or refused if it was on probation. True when it is refused."""
        fp = suspicion.fingerprint
        if fp is None or not (reason in DEATHS or (reason.startswith("status_5") and reason != "status_503")):
            return False
        self.metrics.crash_charges.labels(engine.name).inc()
        return self.quarantine.charge(fp, (engine.name, engine.life), suspicion.on_probation)

    async def _restarted(self, others: frozenset[str]) -> Engine | None:
        """An engine of this model that is starting again after it exited (:mod:`serving.launch.supervise`), once it is
        back within ``restart_wait_s``; None when none is starting or none came back in time."""
        starting = [e for e in self.pool.engines if e.restarting and e.name not in others]
        deadline = time.monotonic() + self.settings.restart_wait_s
        while starting and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            back = [e for e in starting if e.healthy]
            if back:
                return back[0]
            starting = [e for e in starting if not e.down_for_good]  # one that stays down is not waited for
        return None

    async def _return_to(self, job: Job, transient: dict[str, Engine], returns: int) -> Engine | None:
        """Every engine was tried: after a pause, the least busy of those that failed this request only in a way a live
        engine can (``SECOND_CHANCE``) and pass a probe now, with ``job`` placed on it again; None if none does.

        Why: on a starved machine one engine can time out a connect and then reset a retry while the other engine dies
        under the same request; the live engine is the request's only way to an answer, and a pause lets it recover.
        """
        live = [e for e in transient.values() if e.healthy]
        if not live:  # the probes already took them out: no pause for nothing
            return None
        await asyncio.sleep(min(self.settings.retry_backoff_s * 2 ** returns, 8.0))
        for engine in sorted(live, key=lambda e: e.outstanding):  # the load after the pause
            if await self.pool.verify(engine):  # False too for one taken out during the pause
                self.pool.place_on(job, engine)
                return engine
        return None

    # --- one attempt ---------------------------------------------------------------------------
    def _url(self, engine: Engine, req: ClientRequest) -> str:
        return engine.url + req.path

    async def _guarded(self, engine: Engine, coro) -> object:
        """Run ``coro`` as a call the pool cancels if the engine is taken out; translate failures into _Retry."""
        task = asyncio.get_running_loop().create_task(coro)
        engine.calls.add(task)
        task.add_done_callback(engine.calls.discard)
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:  # our own caller is gone: the call goes too
            task.cancel()
            raise
        if task.cancelled():
            raise _Retry("engine_down", f"{engine.name} was taken out by its health checks ({engine.last_error})")
        exc = task.exception()
        if exc is None:
            return task.result()
        raise self._classify(engine, exc) from exc

    def _classify(self, engine: Engine, exc: BaseException) -> BaseException:
        if isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout)):
            return ApiError(504, f"{engine.name} did not answer within {self.settings.engine_timeout_s:g} s",
                            code="engine_timeout")
        if isinstance(exc, httpx.TransportError):
            return _transport_retry(self.pool, engine, exc, self.settings.connect_timeout_s)
        return exc

    async def _retry_status(self, engine: Engine, status: int) -> bool:
        """A 503 is retried; another 5xx only if the engine then fails a probe (it crashed under the request)."""
        if status == 503:
            return True
        if status >= 500:
            return not await self.pool.check(engine, immediate=True)
        return False

    def _headers(self, engine: Engine) -> dict[str, str]:
        return {"x-lengthwise-engine": engine.name}

    async def _unary(self, engine, req, body, headers, job, on_done) -> Response:
        self.pool.placer.sent(job)  # the engine may start it at once; nothing comes back until the answer is whole
        try:
            r: httpx.Response = await self._guarded(engine, self.client.post(self._url(engine, req), json=body, headers=headers))
        except BaseException:
            self.pool.drop(engine, job)
            raise
        engine.progressed()
        if r.status_code != 200:
            self.pool.drop(engine, job)
            if await self._retry_status(engine, r.status_code):
                raise _Retry(f"status_{r.status_code}", f"{engine.name} answered {r.status_code}", r.text[:200])
        out = Outcome(r.status_code, engine.name)
        if r.status_code == 200:
            try:
                answer = r.json()
                out.finish_reason = finish_reason_of(answer)
                out.completion_tokens = int(answer["usage"]["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                pass
            self.pool.finish(engine, job, out.completion_tokens)
        on_done(out)
        content = r.content if r.status_code == 200 else engine_error(r.content, r.status_code)
        return Response(content, status_code=r.status_code, headers=self._headers(engine),
                        media_type=r.headers.get("content-type", "application/json"))

    async def _assembled(self, engine: Engine, req: ClientRequest, body: dict, headers: dict[str, str], job: Job,
                         on_done: _Learner) -> Response:
        """A non-streamed request read from ``engine`` as a stream, so that its answer so far can be refined on
        (:mod:`serving.gateway.assemble`). The client gets the answer whole and nothing before it, so a failure at any
        point is still a retry (raised), as for :meth:`_unary`."""
        assert self.refiner is not None
        call = _EngineStream(self, engine, job, self._url(engine, req), as_stream(body), headers)
        watch = self.refiner.watch(req, body, engine.name)
        relay, whole = StreamRelay(True, keep_text=watch is not None), Assembler(req.kind == "chat")
        complete = False
        try:
            msg = await call.messages.get()
            while True:
                match msg:
                    case _Data(data) if _is_error_event(data):
                        if not await self.pool.check(engine, immediate=True):
                            raise _Retry("error_event", f"{engine.name} failed the request and its health probe", data[:200])
                        on_done(Outcome(500, engine.name))
                        return Response(engine_error(data.encode(), 500), status_code=500, headers=self._headers(engine),
                                        media_type="application/json")
                    case _Data(data):
                        call.passed(relay, data)
                        whole.add(data)
                        if watch is not None:
                            watch.seen(relay)
                    case _End() if relay.events:
                        complete = True
                        break
                    case _:  # a refusal, a failure, or a stream closed before any event: as if nothing had come
                        return await self._unstarted(engine, msg, on_done)
                msg = await call.messages.get()
        finally:
            call.release(relay.completion_tokens, complete)
        on_done(Outcome(200, engine.name, relay.completion_tokens, relay.finish_reason))
        return Response(json.dumps(whole.answer(), separators=(",", ":")).encode(), status_code=200,
                        headers=self._headers(engine), media_type="application/json")

    async def _stream(self, engine: Engine, req: ClientRequest, body: dict, headers: dict[str, str], job: Job,
                      on_done: _Learner, suspicion: _Suspicion | None = None) -> Response:
        """Stream from ``engine``: retried (raised) while nothing came, else relayed as the engine's events arrive."""
        call = _EngineStream(self, engine, job, self._url(engine, req), body, headers)
        try:
            first = await call.messages.get()
        except BaseException:
            call.release()
            raise
        if not isinstance(first, _Data):
            call.release()
            return await self._unstarted(engine, first, on_done)
        if _is_error_event(first.data) and not await self.pool.check(engine, immediate=True):
            call.release()
            raise _Retry("error_event", f"{engine.name} failed the request and its health probe", first.data[:200])
        rid = headers.get("X-Request-Id")
        watch = self.refiner.watch(req, body, engine.name) if self.refiner is not None else None
        relay = StreamRelay(req.wants_usage, keep_text=watch is not None)
        return ClientStream(self._relay(call, relay, first, rid, on_done, suspicion, watch),
                            stall_s=self.settings.client_stall_timeout_s, on_stall=lambda: self._stalled(rid),
                            media_type="text/event-stream", headers={**self._headers(engine), "Cache-Control": "no-cache"},
                            background=BackgroundTask(call.release))

    def _stalled(self, rid: str | None) -> None:
        """A stream's client took none of it for the stall timeout (:class:`~serving.gateway.slow_clients.ClientStream`):
        the stream is cut, which cancels its engine request and frees its places."""
        self.metrics.client_stalled.inc()
        log.warning("stream %s cut: its client took none of it for %g s; its engine request is cancelled", rid,
                    self.settings.client_stall_timeout_s)

    async def _unstarted(self, engine: Engine, first: _Status | _End | _Failed, on_done: Callable[[Outcome], None]) -> Response:
        """A stream whose first message is not an event: the engine's non-200 answer for the client, or a retry (raised)."""
        match first:
            case _Status(code, content):
                if await self._retry_status(engine, code):
                    raise _Retry(f"status_{code}", f"{engine.name} answered {code}", content[:200].decode(errors="replace"))
                on_done(Outcome(code, engine.name))
                return Response(engine_error(content, code), status_code=code, headers=self._headers(engine),
                                media_type="application/json")
            case _End():
                raise _Retry("empty", f"{engine.name} closed the stream without an event")
            case _Failed("timeout", detail):
                raise ApiError(504, detail, code="engine_timeout")
            case _Failed(reason, detail) if reason == GATEWAY_FAILED:  # no engine is to blame: no other one is tried
                raise ApiError(500, detail + "; see the gateway log", code="gateway_error")
            case _Failed(reason, detail):
                raise _Retry(reason, detail)

    async def _relay(self, call: _EngineStream, relay: StreamRelay, first: _Data, rid: str | None,
                     on_done: _Learner, suspicion: _Suspicion | None = None,
                     watch: Watch | None = None) -> AsyncIterator[bytes]:
        """The client's events: the engine's as they come (``first`` already read), ended properly whatever ends them;
        ``watch`` starts the stream's refinements as its answer passes their points.

        The call leaves the engine's view when the stream ends: finished if the answer was complete, else dropped.
        """
        out = Outcome(200, call.engine.name)
        complete = False
        try:
            msg: _Message = first
            while True:
                match msg:
                    case _Data(data):
                        chunk = call.passed(relay, data)
                        on_done.progress(relay)
                        if watch is not None:
                            watch.seen(relay)
                        if chunk:
                            yield chunk
                    case _End():
                        complete = True
                        if not relay.done:  # an engine that closed without [DONE] still ends the client's stream properly
                            yield b"data: [DONE]\n\n"
                        break
                    case _Failed(detail=why) | _Status(content=why):  # (a _Status only ever comes first)
                        if relay.done:
                            complete = True
                            break
                        self.metrics.stream_errors.labels(call.engine.name).inc()
                        if suspicion is not None and isinstance(msg, _Failed) and not (
                                msg.reason in MAYBE_ALIVE and await self.pool.verify(call.engine)):
                            self._charge(call.engine, msg.reason, suspicion)
                        said = why if isinstance(msg, _Failed) or self.settings.log_prompts else f"status {msg.code}"
                        log.warning("stream %s cut after %d events: %s", rid, relay.events, said)
                        yield sse_error(f"the engine failed after part of the answer was sent: {why}")
                        break
                msg = await call.messages.get()
        finally:
            call.release(relay.completion_tokens, complete)
            out.completion_tokens = relay.completion_tokens
            out.finish_reason = relay.finish_reason
            out.first_token_at = relay.first_token_at
            on_done(out)


class _Suspicion:
    """A request's fingerprint and, once it is a suspect, its turn on probation (:mod:`serving.gateway.quarantine`)."""

    __slots__ = ("fingerprint", "turn")

    def __init__(self, fingerprint: Fingerprint | None) -> None:
        self.fingerprint, self.turn = fingerprint, None

    @property
    def on_probation(self) -> bool:
        return self.turn is not None

    async def probation_if_suspect(self, quarantine: CrashQuarantine, probation: Probation) -> None:
        """Wait for a turn on probation when the request is a suspect (and holds none yet)."""
        if self.turn is None and self.fingerprint is not None and quarantine.suspect(self.fingerprint):
            self.turn: Pass | None = await probation.enter()

    def leave(self) -> None:
        if self.turn is not None:
            self.turn.leave()


def then_run(first: BackgroundTask | None, then: Callable[[], None]) -> BackgroundTask:
    """A response's background task followed by ``then`` (which runs even when the first one fails)."""
    async def both() -> None:
        try:
            if first is not None:
                await first()
        finally:
            then()

    return BackgroundTask(both)


class _Learner:
    """One attempt's ``on_done``, which first shows the answer to its engine's learnt bound
    (:mod:`serving.gateway.concurrency`): when it was sent, its first token, its end, and the engine's requests in flight
    over its life; a stream already missing at its checkpoint is shown then instead, once."""

    __slots__ = ("checked", "engine", "judged", "metrics", "on_done", "since")

    def __init__(self, engine: Engine, on_done: Callable[[Outcome], None], metrics: GatewayMetrics) -> None:
        self.engine, self.on_done, self.metrics = engine, on_done, metrics
        now = time.perf_counter()
        self.since = (now, engine.clock.area(now)) if engine.limit is not None else (now, 0.0)
        self.checked = engine.limit is None or not engine.limit.checkpoint  # no early judgement to make
        self.judged = engine.limit is None  # nothing to learn without a learnt bound

    def _served(self, first_token_at: float | None, tokens: int) -> Served:
        now = time.perf_counter()
        return Served(self.since[0], first_token_at, now, tokens, self.engine.clock.average(self.since, now))

    def progress(self, relay: StreamRelay) -> None:
        """A stream's event passed: at its checkpoint, judge it now if it already misses."""
        if self.checked or (limit := self.engine.limit) is None or relay.token_events <= limit.checkpoint:
            return
        self.checked = True
        self.judged = limit.early(self._served(relay.first_token_at, relay.token_events))
        if self.judged:
            self.metrics.engine_bound.labels(self.engine.name).set(limit.bound)

    def __call__(self, out: Outcome) -> None:
        if not self.judged and out.status == 200 and out.completion_tokens and (limit := self.engine.limit) is not None:
            limit.observe(self._served(out.first_token_at, out.completion_tokens))
            self.metrics.engine_bound.labels(self.engine.name).set(limit.bound)
        self.on_done(out)


# --- what a streamed engine call tells its reader -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Status:
    """The engine answered other than 200, with this body; the pump's first and last message."""

    code: int
    content: bytes


@dataclass(frozen=True, slots=True)
class _Data:
    """One server-sent event's data."""

    data: str


@dataclass(frozen=True, slots=True)
class _End:
    """The engine closed its stream."""


GATEWAY_FAILED = "gateway_error"  # a stream's failure on the gateway's side, not the engine's


@dataclass(frozen=True, slots=True)
class _Failed:
    """The call failed: ``reason`` is a retry reason (see :func:`_transport_retry`), ``engine_down``, ``timeout`` or
    :data:`GATEWAY_FAILED`."""

    reason: str
    detail: str


_Message = _Status | _Data | _End | _Failed


class _EngineStream:
    """One streamed engine call: a task that reads the engine's stream into ``messages``, cancelled with the call when
    the engine is taken out, and the call's one release from the engine's view."""

    def __init__(self, fw: Forwarder, engine: Engine, job: Job, url: str, body: dict, headers: dict[str, str]) -> None:
        self.fw, self.pool, self.engine, self.job = fw, fw.pool, engine, job
        self.messages: asyncio.Queue[_Message] = asyncio.Queue()
        self.released = False
        self.task = asyncio.get_running_loop().create_task(self._pump(url, body, headers))
        engine.calls.add(self.task)
        self.task.add_done_callback(engine.calls.discard)
        self.task.add_done_callback(self._cancelled)

    def _taken_out(self) -> _Failed:
        return _Failed("engine_down", f"{self.engine.name} was taken out by its health checks ({self.engine.last_error})")

    async def _pump(self, url: str, body: dict, headers: dict[str, str]) -> None:
        """Read the engine's stream into ``messages``: a _Status, or _Data ... then _End or _Failed."""
        engine, put, s = self.engine, self.messages.put_nowait, self.fw.settings
        try:
            async with self.fw.client.stream("POST", url, json=body, headers=headers) as r:
                if r.status_code != 200:
                    put(_Status(r.status_code, await r.aread()))
                    return
                async for data in sse_data(r.aiter_lines()):
                    engine.progressed()
                    put(_Data(data))
            put(_End())
        except asyncio.CancelledError:
            put(self._taken_out())
            raise
        except (httpx.ReadTimeout, httpx.WriteTimeout):
            put(_Failed("timeout", f"{engine.name} sent nothing for {s.engine_timeout_s:g} s"))
        except httpx.TransportError as exc:  # never reached the engine, or lost it: another may take the request
            retry = _transport_retry(self.pool, engine, exc, s.connect_timeout_s)
            put(_Failed(retry.reason, str(retry)))
        except Exception as exc:  # ours (the body, the client): said, or the reader waits forever
            log.exception("stream to %s failed in the gateway", engine.name)
            put(_Failed(GATEWAY_FAILED, f"the gateway failed to relay the stream ({type(exc).__name__})"))

    def _cancelled(self, task: asyncio.Task) -> None:
        """A pump cancelled before it ran never reached its own handler: say so, or the reader waits forever."""
        if task.cancelled():
            self.messages.put_nowait(self._taken_out())

    def passed(self, relay: StreamRelay, data: str) -> bytes | None:
        """Relay one event and count the tokens it carried on the job (its first one starts the job)."""
        before = relay.token_events
        chunk = relay.relay(data)
        self.pool.tokens(self.job, relay.token_events - before)
        return chunk

    def release(self, generated: int | None = None, complete: bool = False) -> None:
        """End the call once: a complete answer leaves the engine's view as finished, anything else as dropped."""
        if not self.released:
            self.released = True
            self.task.cancel()
            if complete:
                self.pool.finish(self.engine, self.job, generated)
            else:
                self.pool.drop(self.engine, self.job)


# failures that say the engine died (or hung) with the request on it, and a 5xx after which the engine failed its probe:
# the request is a suspect (serving/gateway/quarantine.py); a refused connection or an idle connection's race is not
DEATHS = frozenset({"engine_down", "reset", "broken", "error_event"})
SECOND_CHANCE = frozenset({"dropped", "reset", "connect_timeout"})  # failures a healthy engine can cause: probe, then retry it
MAYBE_ALIVE = SECOND_CHANCE | {"broken"}  # failures after which the engine is probed before it is blamed or retried


def _transport_retry(pool: EnginePool, engine: Engine, exc: httpx.TransportError, connect_timeout_s: float) -> _Retry:
    """Why a connection failed, as a retry reason.

    ``dropped``: the engine closed the connection before answering anything, possibly an idle kept-alive connection
    it closed as the request went out on it; ``reset``: the same race when the engine's close found the request
    unread in its buffer, which makes the kernel reset the connection (a read or write error here), or an engine
    that died; ``connect_timeout``: no connection within ``connect_timeout_s``, which a busy machine can cause. For
    these the caller probes the engine before giving up on it (``SECOND_CHANCE``): a dead engine fails the probe.
    Callers use the reason only while the client has seen nothing. ``connect`` (refused) and ``broken`` (lost
    mid-answer) ask for a probe at once in the background.
    """
    if isinstance(exc, httpx.ConnectTimeout):
        return _Retry("connect_timeout", f"cannot connect to {engine.name} within {connect_timeout_s:g} s")
    if isinstance(exc, httpx.RemoteProtocolError) and "without sending a response" in str(exc):
        return _Retry("dropped", f"connection to {engine.name} broke: {type(exc).__name__} {exc}".strip())
    pool.suspect(engine)
    if isinstance(exc, (httpx.ReadError, httpx.WriteError)):
        return _Retry("reset", f"connection to {engine.name} was reset: {type(exc).__name__} {exc}".strip())
    if isinstance(exc, httpx.ConnectError):
        return _Retry("connect", f"cannot connect to {engine.name}: {type(exc).__name__}")
    return _Retry("broken", f"connection to {engine.name} broke: {type(exc).__name__} {exc}".strip())


def _is_error_event(data: str) -> bool:
    if not data.startswith("{") or '"error"' not in data:
        return False
    try:
        return isinstance(json.loads(data).get("error"), dict)
    except ValueError:
        return False
