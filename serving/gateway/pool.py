"""The engines behind the gateway: which are healthy, how loaded, which models they serve.

Health comes from two sides. A probe loop asks every engine's ``/health`` every ``health_interval_s``;
``unhealthy_after`` failed probes in a row take it out of placement, one good probe brings it back (and
refreshes its model list). A probe that is only slow does not count against an engine that is visibly
working: if any of its calls received bytes within the time its failing probes take
(``unhealthy_after`` × (``health_interval_s`` + ``health_timeout_s``)), it is busy, not hung (a vLLM API
server streaming many answers on a shared core can take seconds to answer ``/health``), and taking it out
would cut answers that are flowing; the probe is counted as ``engine_busy_probes``. A hung engine sends
nothing, so it is taken out at most that long after its last byte. And a request that cannot connect, or
loses its connection, asks for a probe at once, so a crashed engine is skipped within milliseconds rather than a probe
interval. When an engine is taken out, its calls in flight are cancelled: requests that had not sent anything to their client
are then retried elsewhere instead of waiting on an engine that may never answer (a hung process keeps
its sockets open).

Load comes from the gateway's own bookkeeping (each engine's :class:`EngineView`, see
:mod:`serving.gateway.placement`) and from each engine's vLLM ``/metrics``, read every
``load_interval_s`` (:mod:`serving.gateway.engine_load`). An engine taken out loses its view; when it
passes a probe again its load is read at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from serving.gateway.concurrency import EngineLimit, InFlightClock
from serving.gateway.engine_load import fetch_report
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.placement import EngineView, GatewayPlacement, PlacementConfig
from serving.gateway.settings import GatewaySettings
from serving.launch.engines import engine_names
from serving.placement import Job

log = logging.getLogger("serving.gateway")
DEAD = "/health answered 503"  # vLLM's API server says its engine core died (EngineDeadError)


@dataclass(eq=False)
class Engine:
    name: str
    url: str
    view: EngineView  # placement's view: the requests sent here, and those others sent (from its load report)
    healthy: bool = False
    failures: int = 0  # consecutive failed probes
    models: set[str] = field(default_factory=set)
    context: dict[str, int] = field(default_factory=dict)  # model -> its max_model_len, as /v1/models says
    calls: set[asyncio.Task] = field(default_factory=set)  # in flight; cancelled when the engine is taken out
    last_error: str | None = None
    last_progress: float = float("-inf")  # time.monotonic() when a call last received bytes from the engine
    clock: InFlightClock = field(default_factory=lambda: InFlightClock(time.perf_counter()))  # requests in flight x time
    limit: EngineLimit | None = None  # the learnt bound (--engine-bound slo); None: the fixed per-engine bound
    lora: bool = False  # serves LoRA adapters (an adapter's card in /v1/models, or LoRA's series on /metrics)
    life: int = 0  # how many times it came back (a restart, or passing probes again after being taken out)
    restarts: int = 0  # times the gateway started it again after it exited while serving
    restarting: str | None = None  # why it is down and starting again (exited with status N), while it is
    down_for_good: str | None = None  # why it stays down (its restart budget spent, a failed start)

    def progressed(self) -> None:
        """A call received bytes: the engine is working, whatever its /health says."""
        self.last_progress = time.monotonic()

    @property
    def outstanding(self) -> int:
        """Requests this gateway sent here and not yet answered in full."""
        return self.view.own


def engine_auth(settings: GatewaySettings) -> dict[str, str]:
    """The header every engine call carries when the engines want a key (``--engine-api-key``, or the random one of the
    engines started here)."""
    key = settings.engine_api_key
    return {"Authorization": f"Bearer {key.get_secret_value()}"} if key is not None else {}


class EngineTransport(httpx.AsyncHTTPTransport):
    """The engines' HTTP transport. A connection whose socket the engine closes while it is being made (an engine
    killed under load) can surface from httpcore and anyio as ``AttributeError: 'NoneType' object has no attribute
    'getpeername'`` instead of a connect error. It is one, and is raised as one here, so probes take the engine out and
    requests are retried elsewhere (it reached a client as a 500 when the engine-killed-under-load test hit it)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as exc:
            raise httpx.ConnectError(f"the connection closed as it was made ({exc})", request=request) from exc


def engine_client(settings: GatewaySettings, timeout: httpx.Timeout | float, limits: httpx.Limits) -> httpx.AsyncClient:
    """An HTTP client for the engines: their key (:func:`engine_auth`) and :class:`EngineTransport`."""
    return httpx.AsyncClient(timeout=timeout, headers=engine_auth(settings), transport=EngineTransport(limits=limits))


class EnginePool:
    def __init__(self, urls: Sequence[str], settings: GatewaySettings, metrics: GatewayMetrics,
                 placer: GatewayPlacement | None = None, prefill: bool = False,
                 serves: dict[str, list[str]] | None = None):
        """``prefill``: a pool of prefill engines (``prefill-0``, ...; decode engines are ``engine-0``, ...), placed by
        JSQ, whose placement counters stay out of the decode placement's. ``serves``: the names placed on an engine (by
        URL), out of those it lists: a base's engine lists the base's name whether or not a plan places it there."""
        self.settings, self.metrics = settings, metrics
        self.serves = {u: set(names) for u, names in (serves or {}).items()}
        names = engine_names(len(urls), prefill)
        if placer is None:
            cfg = PlacementConfig("jsq", stale_after_s=settings.stale_after_s) if prefill else settings.placement_config()
            placer = GatewayPlacement(names, cfg, lambda reason: metrics.placement_fallbacks.labels(reason).inc())
        self.placer = placer
        self.engines = [Engine(n, u, v) for n, u, v in zip(names, urls, self.placer.views)]
        if settings.engine_bound == "slo" and not prefill:
            ceiling = settings.outstanding_bounds(len(urls))[0]
            for e in self.engines:
                e.limit = EngineLimit(ceiling, *settings.slo_targets(), start=settings.engine_seqs,
                                      checkpoint=settings.engine_bound_checkpoint)
        self.known_models: set[str] = set()  # every model any engine ever served (kept while engines are down)
        self.client = engine_client(settings, settings.health_timeout_s, httpx.Limits(keepalive_expiry=settings.keepalive_s))
        self._tasks: list[asyncio.Task] = []
        self._probing: dict[str, asyncio.Task] = {}
        self._loading: set[asyncio.Task] = set()
        self._busy_window_s = settings.unhealthy_after * (settings.health_interval_s + settings.health_timeout_s)
        # engines started here: called when one's /health says its engine core died (it is stopped and started again)
        self.on_dead: Callable[[Engine], None] | None = None
        if not prefill:
            metrics.watch_placement(self.placer.stats)
        for e in self.engines:
            metrics.engine_healthy.labels(e.name).set(0)
            metrics.engine_outstanding.labels(e.name).set(0)
            if e.limit is not None:
                metrics.engine_bound.labels(e.name).set(e.limit.bound)
            metrics.engine_others.labels(e.name).set(0)

    # --- health --------------------------------------------------------------------------------
    async def _probe(self, e: Engine) -> tuple[bool, bool]:
        """(healthy, hard failure): a refused connection or an error status is hard, a slow answer is not."""
        try:
            r = await self.client.get(e.url + "/health")
            if r.status_code == 200:
                return True, False
            e.last_error = DEAD if r.status_code == 503 else f"/health answered {r.status_code}"
        except httpx.TimeoutException:
            e.last_error = f"/health slower than {self.settings.health_timeout_s:g} s"
            return False, False
        except httpx.HTTPError as exc:
            e.last_error = f"{type(exc).__name__}: {exc}".strip(" :")
        return False, True

    async def _refresh_models(self, e: Engine) -> None:
        try:
            r = await self.client.get(e.url + "/v1/models")
            if r.status_code == 401:
                log.warning("%s (%s) wants an API key for /v1/models: give it with --engine-api-key "
                            "(or LENGTHWISE_ENGINE_API_KEY)", e.name, e.url)
                return
            cards = r.json()["data"]
            listed = {m["id"] for m in cards}
            e.models = listed & self.serves.get(e.url, listed)
            e.context = {m["id"]: m["max_model_len"] for m in cards
                         if type(m.get("max_model_len")) is int and m["max_model_len"] > 0}
            for m in cards:  # a LoRA adapter's card has no context of its own: its base model's is the one it runs in
                parent = m.get("parent")
                if m["id"] not in e.context and isinstance(parent, str) and parent in e.context:
                    e.context[m["id"]] = e.context[parent]
            self.known_models |= e.models
            e.lora = e.lora or any(isinstance(m.get("parent"), str) and m["parent"] != m["id"] for m in cards)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s (%s): could not list its models: %s", e.name, e.url, exc)

    async def check(self, e: Engine, immediate: bool = False) -> bool:
        """Probe one engine and update its state; ``immediate``: one hard failure is enough to take it out."""
        ok, hard = await self._probe(e)
        if ok:
            e.failures = 0
            if not e.healthy:
                await self._refresh_models(e)
                e.healthy = True
                e.life += 1
                e.restarting = None
                self.placer.rejoin(e.view)
                log.info("%s (%s) is healthy; serves %s", e.name, e.url, ", ".join(sorted(e.models)) or "?")
                self.metrics.engine_healthy.labels(e.name).set(1)
                self._spawn_load([e])  # its view is empty: read its load now rather than at the next interval
        else:
            e.failures += 1
            if not hard and e.healthy and time.monotonic() - e.last_progress < self._busy_window_s:
                self.metrics.engine_busy_probes.labels(e.name).inc()  # slow, but answers are flowing: busy, not hung
            elif e.healthy and ((immediate and hard) or e.failures >= self.settings.unhealthy_after):
                self.take_out(e)
            if e.last_error == DEAD and self.on_dead is not None and not e.restarting and not e.down_for_good:
                e.restarting = "stopped: its engine core died (/health answered 503)"
                self.on_dead(e)
        return ok

    def take_out(self, e: Engine) -> None:
        e.healthy = False
        self.placer.take_out(e.view)  # its requests are re-placed (retried) or fail; none stays on its view
        self._gauges(e)
        self.metrics.engine_healthy.labels(e.name).set(0)
        log.warning("%s (%s) is unhealthy (%s); skipping it, %d call(s) in flight cancelled", e.name, e.url,
                    e.last_error, len(e.calls))
        for task in list(e.calls):
            task.cancel()

    def life(self, name: str) -> int:
        """How many times the engine ``name`` came (back) into placement: a new life is a new process, or the same one
        passing its probes again."""
        return next(e.life for e in self.engines if e.name == name)

    def exited(self, e: Engine, status: int | None) -> None:
        """The process of ``e`` (started here) exited while serving: out of placement now, its calls cancelled (those
        that sent the client nothing are retried elsewhere), rather than at the next failed probe."""
        e.restarting = e.restarting or f"exited with status {status}"
        e.last_error = f"exited with status {status}"
        self.metrics.engine_exits.labels(e.name).inc()
        if e.healthy:
            self.take_out(e)

    def relocate(self, e: Engine, url: str) -> None:
        """``e`` was started again at ``url``: the names placed on it follow it; the next probe takes it back in."""
        self.serves = {(url if u == e.url else u): names for u, names in self.serves.items()}
        e.url, e.failures = url, 0  # still "restarting" (waited for) until its first probe passes
        e.restarts += 1
        self.metrics.engine_restarts.labels(e.name).inc()

    def stays_down(self, e: Engine, why: str) -> None:
        e.restarting, e.down_for_good = None, why

    def suspect(self, e: Engine) -> asyncio.Task | None:
        """A request failed on ``e``: probe it now (once at a time) instead of at the next interval."""
        if e.healthy:
            self._probe_now(e, immediate=True)
        return self._probing.get(e.name)

    def suspect_down(self, e: Engine) -> None:
        """Probe an engine that is down now (one started again), rather than at the next interval."""
        self._probe_now(e, immediate=False)

    def _probe_now(self, e: Engine, immediate: bool) -> None:
        """One probe of ``e`` under way at a time: a second ask joins the first."""
        if e.name not in self._probing:
            task = asyncio.get_running_loop().create_task(self.check(e, immediate=immediate))
            self._probing[e.name] = task
            task.add_done_callback(lambda _t, n=e.name: self._probing.pop(n, None))

    async def verify(self, e: Engine) -> bool:
        """Probe ``e`` now (joining a probe already under way) and say whether it is still healthy."""
        task = self.suspect(e)
        if task is not None:
            await asyncio.shield(task)
        return e.healthy

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            for e, res in zip(self.engines, await asyncio.gather(*(self.check(e) for e in self.engines), return_exceptions=True)):
                if isinstance(res, Exception):  # a probe must never end the loop that keeps the pool honest
                    log.error("health check of %s failed unexpectedly: %r", e.name, res)

    # --- load reports --------------------------------------------------------------------------
    async def refresh_load(self, engines: Sequence[Engine] | None = None) -> None:
        """Read the vLLM metrics of ``engines`` (default: every healthy one) into their views."""
        targets = [e for e in (self.engines if engines is None else engines) if e.healthy]
        timeout = self.settings.health_timeout_s
        results = await asyncio.gather(*(fetch_report(self.client, e.url + "/metrics", timeout) for e in targets),
                                       return_exceptions=True)
        for e, r in zip(targets, results):
            if isinstance(r, BaseException):
                self.metrics.load_scrape_errors.labels(e.name).inc()
                log.debug("%s: no load report from %s/metrics: %r", e.name, e.url, r)
            elif e.healthy:  # not taken out while we read
                e.lora = e.lora or r.lora
                self.placer.report(e.view, r)
                self.metrics.engine_others.labels(e.name).set(e.view.others)

    def _spawn_load(self, engines: Sequence[Engine]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(self.refresh_load(engines))
        except RuntimeError:  # no loop (a check outside the app): the next interval reads it
            return
        self._loading.add(task)
        task.add_done_callback(self._loading.discard)

    async def _load_loop(self, e: Engine) -> None:
        """One engine's reports, on its own clock: a busy engine slow to answer /metrics must not age the others'
        reports past the stale limit (which would make every decision fall back to JSQ)."""
        while True:
            await asyncio.sleep(self.settings.load_interval_s)
            try:
                await self.refresh_load([e])
            except Exception as exc:  # noqa: BLE001 - like the health loop, this loop must outlive any one failure
                log.error("reading the load of %s failed unexpectedly: %r", e.name, exc)

    async def start(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.engines))
        await asyncio.gather(*self._loading, return_exceptions=True)  # first load reports before the first request
        if self.placer.load_aware and self.placer.limits is None:
            log.warning("placement %s: no engine reported its KV capacity (vllm:cache_config_info on /metrics); "
                        "requests are placed by JSQ until one does (lengthwise_gateway_placement_fallbacks_total"
                        "{reason=\"no_capacity\"})", self.placer.name)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._loop()), *(loop.create_task(self._load_loop(e)) for e in self.engines)]

    async def aclose(self) -> None:
        for t in [*self._tasks, *self._probing.values(), *self._loading]:
            t.cancel()
        await asyncio.gather(*self._tasks, *self._loading, return_exceptions=True)
        await self.client.aclose()

    # --- placement and load ---------------------------------------------------------------------
    @property
    def models(self) -> set[str]:
        return self.known_models

    def context(self, model: str) -> int | None:
        """The smallest context (max_model_len) an engine reported for ``model``; None when none did."""
        lens = [e.context[model] for e in self.engines if model in e.context]
        return min(lens) if lens else None

    def not_serving(self, model: str) -> frozenset[str]:
        """The engines that do not serve ``model`` (as their last model list said; one not listed yet may): placement
        never chooses them for its requests, so several models can share one gateway (and adapters their base's
        engines)."""
        return frozenset(e.name for e in self.engines if e.models and model not in e.models)

    def full(self, per_engine: int) -> frozenset[str]:
        """The engines with as many of this gateway's requests in flight as their bound: the learnt one
        (``--engine-bound slo``), else ``per_engine``."""
        return frozenset(e.name for e in self.engines if e.outstanding >= (e.limit.bound if e.limit else per_engine))

    def place(self, job: Job, exclude: frozenset[str]) -> Engine | None:
        """The engine for ``job`` (now on its view), or None when no healthy engine outside ``exclude`` is left."""
        i = self.placer.choose(job, exclude, time.monotonic())
        if i is None:
            return None
        e = self.engines[i]
        self._gauges(e)
        return e

    def place_on(self, job: Job, e: Engine) -> None:
        """``job`` goes to ``e`` again (its connection dropped before an answer, and ``e`` then passed a probe)."""
        self.placer.place_on(e.view, job)
        self._gauges(e)

    def tokens(self, job: Job, n: int) -> None:
        self.placer.tokens(job, n, time.monotonic())

    def finish(self, e: Engine, job: Job, generated: int | None) -> None:
        self.placer.finish(e.view, job, generated)
        self._gauges(e)

    def drop(self, e: Engine, job: Job) -> None:
        self.placer.drop(e.view, job)
        self._gauges(e)

    def _gauges(self, e: Engine) -> None:
        if e.limit is not None:  # only a learnt bound reads the clock
            e.clock.set(e.outstanding, time.perf_counter())
        self.metrics.engine_outstanding.labels(e.name).set(e.outstanding)
        self.metrics.engine_others.labels(e.name).set(e.view.others)

    def status(self) -> list[dict]:
        now = time.monotonic()
        return [{"name": e.name, "url": e.url, "healthy": e.healthy, "outstanding": e.outstanding,
                 "other_requests": e.view.others, "kv_tokens": e.view.capacity,
                 "load_report_age_s": None if e.view.report is None else round(now - e.view.report.at, 3),
                 "models": sorted(e.models), **({"bound": e.limit.state()} if e.limit is not None else {}),
                 **({"last_error": e.last_error} if not e.healthy and e.last_error else {}),
                 **({"restarts": e.restarts} if e.restarts else {}),
                 **({"restarting": e.restarting} if e.restarting else {}),
                 **({"down_for_good": e.down_for_good} if e.down_for_good else {})}
                for e in self.engines]
