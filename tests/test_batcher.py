"""The micro-batcher on its own: results go back to the right request, batches respect the size bound,
a lone request is not held for company, and a failing batch fails only its own requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from predictor.sidecar.batcher import MicroBatcher

pytestmark = pytest.mark.unit


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_share_bounded_batches_and_get_their_own_results():
    sizes: list[int] = []
    gate = threading.Event()

    def square(items: list[int]) -> list[int]:
        gate.wait(5)  # the first batch holds the worker while the rest queue up
        sizes.append(len(items))
        return [x * x for x in items]

    async def main():
        b = MicroBatcher(square, max_batch=8, max_wait_s=0.01)
        b.start()
        tasks = [asyncio.create_task(b.submit([i, i + 100])) for i in range(20)]
        await asyncio.sleep(0.05)
        gate.set()
        out = await asyncio.gather(*tasks)
        await b.stop()
        return out

    out = run(main())
    assert out == [[i * i, (i + 100) ** 2] for i in range(20)]
    assert sum(sizes) == 40 and max(sizes) <= 8 and len(sizes) < 40


def test_lone_request_is_not_held_for_the_wait_bound():
    async def main():
        b = MicroBatcher(lambda xs: xs, max_batch=32, max_wait_s=0.5)
        b.start()
        t = time.perf_counter()
        await b.submit(["x"])
        took = time.perf_counter() - t
        await b.stop()
        return took

    assert run(main()) < 0.25


def test_under_load_a_request_waits_at_most_the_bound():
    async def main():
        b = MicroBatcher(lambda xs: xs, max_batch=1000, max_wait_s=0.05)
        b.start()
        await asyncio.gather(*(b.submit([i]) for i in range(4)))  # the last batch held several: load is present
        t = time.perf_counter()
        await b.submit(["late"])
        took = time.perf_counter() - t
        await b.stop()
        return took

    assert 0.04 <= run(main()) < 0.5


def test_a_failing_batch_fails_its_requests_and_the_batcher_goes_on():
    calls = []

    def flaky(items):
        calls.append(list(items))
        if "boom" in items:
            raise ValueError("bad batch")
        return items

    async def main():
        b = MicroBatcher(flaky, max_batch=1, max_wait_s=0)
        b.start()
        with pytest.raises(ValueError, match="bad batch"):
            await b.submit(["boom"])
        ok = await b.submit(["fine"])
        await b.stop()
        return ok

    assert run(main()) == ["fine"]


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        MicroBatcher(lambda xs: xs, max_batch=0)
    with pytest.raises(ValueError):
        MicroBatcher(lambda xs: xs, max_wait_s=-1)


def test_workers_run_batches_side_by_side():
    both = threading.Barrier(2, timeout=5)  # passes only if two batches are inside run_batch at the same time

    def meet(items):
        both.wait()
        return items

    async def main():
        b = MicroBatcher(meet, max_batch=1, max_wait_s=0, workers=2)
        b.start()
        out = await asyncio.gather(b.submit(["a"]), b.submit(["b"]))
        await b.stop()
        return out

    assert run(main()) == [["a"], ["b"]]


def test_items_whose_caller_stopped_waiting_are_dropped_unrun():
    """A sidecar slower than its arrivals must not spend its CPU on predictions whose callers have fallen back."""
    from predictor.sidecar.batcher import Expired

    seen: list[str] = []
    gate = threading.Event()

    def run_batch(items: list[str]) -> list[str]:
        gate.wait(5)  # the first batch holds the only worker while the others queue
        seen.extend(items)
        return items

    async def main():
        drops: list[int] = []
        b = MicroBatcher(run_batch, max_batch=8, max_wait_s=0.0, on_expired=drops.append)
        b.start()
        loop = asyncio.get_running_loop()
        first = asyncio.create_task(b.submit(["first"]))
        await asyncio.sleep(0.05)
        gone = asyncio.create_task(b.submit(["gone"], expires_at=loop.time() + 0.05))
        waits = asyncio.create_task(b.submit(["waits"], expires_at=loop.time() + 30))
        forever = asyncio.create_task(b.submit(["forever"]))
        await asyncio.sleep(0.2)  # past "gone"'s time while the worker is still busy
        gate.set()
        results = await asyncio.gather(first, gone, waits, forever, return_exceptions=True)
        await b.stop()
        return results, sum(drops)

    (first, gone, waits, forever), expired = run(main())
    assert first == ["first"] and waits == ["waits"] and forever == ["forever"]
    assert isinstance(gone, Expired) and expired == 1
    assert "gone" not in seen and sorted(seen) == ["first", "forever", "waits"]
