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

With a ``spill`` function (the package's fast tier: predictor.slices) a saturated sidecar gives the callers it cannot
serve in time a cheap prediction rather than none (the caller's constant fallback), in a thread of its own. It decides
on arrival: when the queue ahead, at the per-item time recent batches took, would keep the request past its caller's
timeout less ``spill_margin_s``, the request goes to the spill at once (so it does not wait for nothing, and the
encoder keeps to what it can finish in time). A request that was expected to make it but is still queued
``spill_margin_s`` before its timeout is spilled then.

The pace is learnt only from batches the encoder runs, so a pace measured in a slow moment (a cold first batch, a CPU
taken by other work) would send every later request to the spill and never be measured again. So a request spilled
on arrival while the encoder is idle is also run there as a probe, its result discarded: the pace it measures
replaces the stale one, at the cost of encoder time nobody else wanted. (Not one whose deadline is within the margin:
no encoder answer could be in time for it, whatever the pace.)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Expired(Exception):
    """The item's caller stopped waiting before a worker was free to run it."""


@dataclass(eq=False)
class _Entry:
    """One queued item: its caller's future, when it arrived and when its caller stops waiting (the loop's clock), and
    whether a batch or the spill has taken it."""

    item: Any
    fut: asyncio.Future
    arrival: float
    expiry: float
    taken: bool = field(default=False)
    probe: bool = field(default=False)  # run only to measure the pace: nobody waits for its result


class MicroBatcher(Generic[T, R]):
    """``await batcher.submit(items)`` returns ``run_batch``'s results for exactly those items.

    ``run_batch(items) -> results`` (same length and order) runs in one of ``workers`` threads; an
    exception fails every request of that batch. A batch is cut only when a worker is free, so while
    all workers are busy the queue grows into the next batch. ``on_batch(size, seconds)`` observes
    each batch, ``on_expired(n)`` each drop of items whose caller's time was up. ``spill(items) -> results`` (same
    contract as ``run_batch``, but None for an item it cannot answer: that caller gets :class:`Expired`) answers the items
    it would be late for; ``on_spill(n)`` observes each spill.
    """

    def __init__(self, run_batch: Callable[[list[T]], Sequence[R]], max_batch: int = 32, max_wait_s: float = 0.002,
                 workers: int = 1, on_batch: Callable[[int, float], None] | None = None,
                 on_expired: Callable[[int], None] | None = None,
                 spill: Callable[[list[T]], Sequence[R]] | None = None, spill_margin_s: float = 0.01,
                 on_spill: Callable[[int], None] | None = None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        if spill_margin_s < 0:
            raise ValueError(f"spill_margin_s must be >= 0, got {spill_margin_s}")
        self.run_batch = run_batch
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.workers = workers
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="inference")
        self._on_batch = on_batch or (lambda size, seconds: None)
        self._on_expired = on_expired or (lambda n: None)
        self.spill, self.spill_margin_s = spill, spill_margin_s
        self._on_spill = on_spill or (lambda n: None)
        self._spill_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spill") if spill else None
        self._spilled: deque[_Entry] = deque()  # handed to the spill, not yet answered
        self._spill_task: asyncio.Task | None = None
        self._pending: deque[_Entry] = deque()
        self._item_s = 0.0  # seconds per item of recent batches (a moving average): the queue's expected pace
        self._wakeup: asyncio.Event | None = None
        self._slots: asyncio.Semaphore | None = None
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._in_flight: dict[int, tuple[float, int]] = {}  # running batch -> (its start on the loop's clock, its size)
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
        if self._spill_task is not None:
            await asyncio.wait([self._spill_task], timeout=10)
        if self._running:
            await asyncio.wait(self._running, timeout=10)
        for e in self._pending:
            if not e.fut.done():
                e.fut.set_exception(RuntimeError("the predictor is shutting down"))
        self._pending.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._spill_executor is not None:
            self._spill_executor.shutdown(wait=False, cancel_futures=True)

    @property
    def queued(self) -> int:
        return len(self._pending)

    async def submit(self, items: Sequence[T], expires_at: float = math.inf) -> list[R]:
        """The results of ``items``; :class:`Expired` if they are still queued at ``expires_at`` (``loop.time()``)."""
        if self._task is None or self._wakeup is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        loop = asyncio.get_running_loop()
        now = loop.time()
        entries = [_Entry(item, loop.create_future(), now, expires_at) for item in items]
        if self.spill is not None and math.isfinite(expires_at):
            if now + self.expected_wait_s(len(entries)) > expires_at - self.spill_margin_s:
                self._spill_due(entries)  # it would be late: the spill answers now, the queue is spared
                # an idle encoder that a deadline past the margin leaves time to: measure the pace again
                if not self._in_flight and not self._pending and expires_at - self.spill_margin_s > now:
                    self._probe(entries, loop)
                return list(await asyncio.gather(*(e.fut for e in entries)))
            loop.call_at(max(now, expires_at - self.spill_margin_s), self._spill_due, entries)
        self._pending.extend(entries)
        self._wakeup.set()
        return list(await asyncio.gather(*(e.fut for e in entries)))

    def expected_wait_s(self, n: int) -> float:
        """How long ``n`` more items would take to be answered at the queue's pace: until a worker is free (the running
        batch nearest its end, when all are busy), then their own batch, which takes everything queued ahead of them up
        to ``max_batch`` and ends when all of it does, after the batches of any items beyond that, shared by the
        workers.

        The pace is the seconds per item of recent batches, floored by what a batch still running has already taken
        per item: before the first batch ends (a burst on a sidecar just started) that floor is all that is known, and
        without it a request behind thousands of queued prompts would look on time and wait for its deadline's spill
        instead of going to the spill on arrival; later it catches a pace slowed since (a busy CPU). 0 when nothing has
        run: nothing is spilled on arrival."""
        now = asyncio.get_running_loop().time()
        running = max(((now - start) / size for start, size in self._in_flight.values()), default=0.0)
        item_s = max(self._item_s, running)
        if item_s == 0.0:
            return 0.0
        free_in = 0.0
        if len(self._in_flight) >= self.workers:
            free_in = min(max(0.0, start + size * item_s - now) for start, size in self._in_flight.values())
        k = len(self._pending) + n
        own = min(k, self.max_batch)
        return free_in + own * item_s + (k - own) * item_s / self.workers

    def _probe(self, entries: list[_Entry], loop: asyncio.AbstractEventLoop) -> None:
        """Queue copies of ``entries`` for the encoder, whose results (or failure) nobody reads."""
        probes = [_Entry(e.item, loop.create_future(), e.arrival, math.inf, probe=True) for e in entries]
        for p in probes:
            p.fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
        self._pending.extend(probes)
        self._wakeup.set()

    def _spill_due(self, entries: list[_Entry]) -> None:
        """The items of one submit still queued near their caller's deadline (or that would be late): handed to the spill
        queue, whose one thread answers whatever has gathered there in one call."""
        due = [e for e in entries if not e.taken and not e.fut.done()]
        if not due:
            return
        for e in due:
            e.taken = True
        self._on_spill(len(due))
        self._spilled.extend(due)
        if self._spill_task is None or self._spill_task.done():
            self._spill_task = asyncio.get_running_loop().create_task(self._drain_spill())

    async def _drain_spill(self) -> None:
        """Answer the spill queue in batches of at most ``max_batch`` until it is empty."""
        loop = asyncio.get_running_loop()
        while self._spilled:
            n = min(self.max_batch, len(self._spilled))
            batch = [self._spilled.popleft() for _ in range(n)]
            await self._deliver(loop, self._spill_executor, self.spill, batch, none_expires=True)  # type: ignore[arg-type]

    @staticmethod
    async def _deliver(loop: asyncio.AbstractEventLoop, executor: ThreadPoolExecutor | None,
                       fn: Callable[[list[T]], Sequence[R]], entries: list[_Entry], none_expires: bool = False) -> None:
        """Run ``fn`` on the entries' items in ``executor`` and settle each entry's future with its result (with
        ``none_expires``, :class:`Expired` for a None result), or every future with the exception."""
        try:
            results = await loop.run_in_executor(executor, fn, [e.item for e in entries])
            if len(results) != len(entries):
                raise RuntimeError(f"{getattr(fn, '__name__', 'the batch')} returned {len(results)} results for "
                                   f"{len(entries)} items")
        except Exception as exc:  # noqa: BLE001 - delivered to every waiting request
            for e in entries:
                if not e.fut.done():
                    e.fut.set_exception(exc)
            return
        for e, res in zip(entries, results):
            if not e.fut.done():
                if res is None and none_expires:
                    e.fut.set_exception(Expired())
                else:
                    e.fut.set_result(res)

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

    async def _next_batch(self, loop: asyncio.AbstractEventLoop) -> list[_Entry]:
        assert self._wakeup is not None
        while True:
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            deadline = self._pending[0].arrival + self.max_wait_s
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
                if b.taken or b.fut.done():  # spilled, or the client went away: skip its work
                    continue
                if b.expiry <= now:  # its caller's time is up: it has fallen back already
                    b.fut.set_exception(Expired())
                    expired += 1
                    continue
                b.taken = True
                batch.append(b)
            if expired:
                self._on_expired(expired)
            if batch:
                self._last_size = len(batch)
                return batch

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Entry]) -> None:
        assert self._slots is not None
        t0 = time.perf_counter()
        key = id(batch)
        self._in_flight[key] = (loop.time(), len(batch))
        try:
            await self._deliver(loop, self._executor, self.run_batch, batch)
        finally:
            self._in_flight.pop(key, None)
            self._slots.release()
            took = time.perf_counter() - t0
            fresh = self._item_s == 0.0 or all(e.probe for e in batch)  # a probe's pace replaces a stale one
            self._item_s = took / len(batch) if fresh else 0.8 * self._item_s + 0.2 * took / len(batch)
            self._on_batch(len(batch), took)
