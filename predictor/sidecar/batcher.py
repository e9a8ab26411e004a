"""Dynamic micro-batching: concurrent requests share one forward pass.

Each HTTP request puts its prompts on a queue and awaits their results. One collector task takes
what is queued, waits at most ``max_wait_s`` after the oldest item arrived for more to join (so a lone
request is delayed by no more than that), cuts at ``max_batch`` items, and runs the batch in a worker
thread so the event loop keeps accepting requests meanwhile. It waits only when there is evidence of
concurrency (more than one item queued, or the previous batch held more than one): a request arriving
at an idle sidecar runs at once instead of paying the wait for company that is not coming. Under load
the queue refills while a batch runs, so the next batch forms without waiting. ``workers`` sets how
many batches run at once: on a small CPU, two single-threaded forward passes side by side do more
work per core than one pass split across two threads (no synchronisation inside each operator).

An item may carry the time its caller stops waiting (``submit(items, expires_at=...)``, the event
loop's clock). One still queued at that time is not run: its caller gets :class:`Expired` instead.
Without this, a sidecar slower than its arrivals spends its CPU on predictions whose callers have
already fallen back, so its queue, and every later caller's wait, only grows.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Expired(Exception):
    """The item's caller stopped waiting before a worker was free to run it."""


class MicroBatcher(Generic[T, R]):
    """``await batcher.submit(items)`` returns ``run_batch``'s results for exactly those items.

    ``run_batch(items) -> results`` (same length and order) runs in one of ``workers`` threads; an
    exception fails every request of that batch. A batch is cut only when a worker is free, so while
    all workers are busy the queue grows into the next batch. ``on_batch(size, seconds)`` observes
    each batch, ``on_expired(n)`` each drop of items whose caller's time was up.
    """

    def __init__(self, run_batch: Callable[[list[T]], Sequence[R]], max_batch: int = 32, max_wait_s: float = 0.002,
                 workers: int = 1, on_batch: Callable[[int, float], None] | None = None,
                 on_expired: Callable[[int], None] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="inference")
        self._on_batch = on_batch or (lambda size, seconds: None)
        self._on_expired = on_expired or (lambda n: None)
        self._pending: deque[tuple[T, asyncio.Future, float, float]] = deque()  # item, future, arrival, expiry
        self._wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._last_size = 0

    def start(self) -> None:
        """Start the collector on the running event loop."""
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(self.workers)
        self._task = asyncio.get_running_loop().create_task(self._collect(), name="micro-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._running:
            await asyncio.wait(self._running, timeout=10)
        for _, fut, _, _ in self._pending:
            if not fut.done():
                fut.set_exception(RuntimeError("the predictor is shutting down"))
        self._pending.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def queued(self) -> int:
        return len(self._pending)

    async def submit(self, items: Sequence[T], expires_at: float = math.inf) -> list[R]:
        """The results of ``items``; :class:`Expired` if they are still queued at ``expires_at`` (``loop.time()``)."""
        if self._task is None or self._wakeup is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        loop = asyncio.get_running_loop()
        now = loop.time()
        futures = [loop.create_future() for _ in items]
        self._pending.extend((item, fut, now, expires_at) for item, fut in zip(items, futures))
        self._wakeup.set()
        return list(await asyncio.gather(*futures))

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wakeup is not None and self._slots is not None
        while True:
            await self._slots.acquire()  # a free worker first: meanwhile arrivals join the next batch
            try:
                batch = await self._next_batch(loop)
            except BaseException:
                self._slots.release()
                raise
            task = loop.create_task(self._run(loop, batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _next_batch(self, loop: asyncio.AbstractEventLoop) -> list[tuple[T, asyncio.Future, float, float]]:
        assert self._wakeup is not None
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline = self._pending[0][2] + self.max_wait_s
            busy = len(self._pending) > 1 or self._last_size > 1
            while busy and len(self._pending) < self.max_batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            now, batch, expired = loop.time(), [], 0
            for _ in range(min(self.max_batch, len(self._pending))):
                b = self._pending.popleft()
                if b[1].done():  # the client went away: skip its work
                    continue
                if b[3] <= now:  # its caller's time is up: it has fallen back already
                    b[1].set_exception(Expired())
                    expired += 1
                    continue
                batch.append(b)
            if expired:
                self._on_expired(expired)
            if batch:
                self._last_size = len(batch)
                return batch

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[tuple[T, asyncio.Future, float, float]]) -> None:
        assert self._slots is not None
        t0 = time.perf_counter()
        try:
            results = await loop.run_in_executor(self._executor, self.run_batch, [b[0] for b in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch returned {len(results)} results for {len(batch)} items")
        except Exception as exc:  # noqa: BLE001 - delivered to every waiting request
            for _, fut, _, _ in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        finally:
            self._slots.release()
            self._on_batch(len(batch), time.perf_counter() - t0)
        for (_, fut, _, _), res in zip(batch, results):
            if not fut.done():
                fut.set_result(res)
