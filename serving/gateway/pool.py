"""The engines behind the gateway: which are healthy, how loaded, which models they serve.

Health comes from two sides. A probe loop asks every engine's ``/health`` every ``health_interval_s``;
``unhealthy_after`` failed probes in a row take it out of placement, one good probe brings it back (and
refreshes its model list). And a request that cannot connect, or loses its connection, asks for a probe
at once, so a crashed engine is skipped within milliseconds rather than a probe interval. When an engine
is taken out, its calls in flight are cancelled: requests that had not sent anything to their client
are then retried elsewhere instead of waiting on an engine that may never answer (a hung process keeps
its sockets open).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from serving.gateway.metrics import GatewayMetrics
from serving.gateway.placement import Placed, make_placement
from serving.gateway.settings import GatewaySettings

log = logging.getLogger("serving.gateway")


@dataclass(eq=False)
class Engine:
    name: str
    url: str
    healthy: bool = False
    outstanding: int = 0
    outstanding_tokens: int = 0
    failures: int = 0  # consecutive failed probes
    models: set[str] = field(default_factory=set)
    calls: set[asyncio.Task] = field(default_factory=set)  # in flight; cancelled when the engine is taken out
    last_error: str | None = None


class EnginePool:
    def __init__(self, urls: Sequence[str], settings: GatewaySettings, metrics: GatewayMetrics):
        self.settings, self.metrics = settings, metrics
        self.engines = [Engine(f"engine-{i}", u) for i, u in enumerate(urls)]
        self.placement = make_placement(settings.placement)
        self.known_models: set[str] = set()  # every model any engine ever served (kept while engines are down)
        self.client = httpx.AsyncClient(timeout=settings.health_timeout_s)
        self._loop_task: asyncio.Task | None = None
        self._probing: dict[str, asyncio.Task] = {}
        for e in self.engines:
            metrics.engine_healthy.labels(e.name).set(0)
            metrics.engine_outstanding.labels(e.name).set(0)

    # --- health --------------------------------------------------------------------------------
    async def _probe(self, e: Engine) -> tuple[bool, bool]:
        """(healthy, hard failure): a refused connection or an error status is hard, a slow answer is not."""
        try:
            r = await self.client.get(e.url + "/health")
            if r.status_code == 200:
                return True, False
            e.last_error = f"/health answered {r.status_code}"
        except httpx.TimeoutException:
            e.last_error = f"/health slower than {self.settings.health_timeout_s:g} s"
            return False, False
        except httpx.HTTPError as exc:
            e.last_error = f"{type(exc).__name__}: {exc}".strip(" :")
        return False, True

    async def _refresh_models(self, e: Engine) -> None:
        try:
            r = await self.client.get(e.url + "/v1/models")
            e.models = {m["id"] for m in r.json()["data"]}
            self.known_models |= e.models
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
                log.info("%s (%s) is healthy; serves %s", e.name, e.url, ", ".join(sorted(e.models)) or "?")
                self.metrics.engine_healthy.labels(e.name).set(1)
        else:
            e.failures += 1
            if e.healthy and ((immediate and hard) or e.failures >= self.settings.unhealthy_after):
                self.take_out(e)
        return ok

    def take_out(self, e: Engine) -> None:
        e.healthy = False
        self.metrics.engine_healthy.labels(e.name).set(0)
        log.warning("%s (%s) is unhealthy (%s); skipping it, %d call(s) in flight cancelled", e.name, e.url,
                    e.last_error, len(e.calls))
        for task in list(e.calls):
            task.cancel()

    def suspect(self, e: Engine) -> None:
        """A request failed on ``e``: probe it now (once at a time) instead of at the next interval."""
        if e.name not in self._probing and e.healthy:
            task = asyncio.get_running_loop().create_task(self.check(e, immediate=True))
            self._probing[e.name] = task
            task.add_done_callback(lambda _t, n=e.name: self._probing.pop(n, None))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            for e, res in zip(self.engines, await asyncio.gather(*(self.check(e) for e in self.engines), return_exceptions=True)):
                if isinstance(res, Exception):  # a probe must never end the loop that keeps the pool honest
                    log.error("health check of %s failed unexpectedly: %r", e.name, res)

    async def start(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self.engines))
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())

    async def aclose(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for t in list(self._probing.values()):
            t.cancel()
        await self.client.aclose()

    # --- placement and load ---------------------------------------------------------------------
    @property
    def models(self) -> set[str]:
        return self.known_models

    def choose(self, placed: Placed, exclude: frozenset[str]) -> Engine | None:
        i = self.placement.choose(self.engines, placed, exclude)
        return None if i is None else self.engines[i]

    def acquire(self, e: Engine, tokens: int) -> None:
        e.outstanding += 1
        e.outstanding_tokens += tokens
        self.metrics.engine_outstanding.labels(e.name).set(e.outstanding)

    def release(self, e: Engine, tokens: int) -> None:
        e.outstanding -= 1
        e.outstanding_tokens -= tokens
        self.metrics.engine_outstanding.labels(e.name).set(e.outstanding)

    def status(self) -> list[dict]:
        return [{"name": e.name, "url": e.url, "healthy": e.healthy, "outstanding": e.outstanding,
                 "models": sorted(e.models), **({"last_error": e.last_error} if not e.healthy and e.last_error else {})}
                for e in self.engines]
