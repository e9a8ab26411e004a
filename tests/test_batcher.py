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


@pytest.mark.alone  # a 100 ms deadline in wall time: beside the other lane it would time that lane too
def test_items_still_queued_near_their_callers_deadline_are_spilled_in_time():
    """With a spill (the package's fast tier), an item the busy worker cannot reach before its caller's time is up is
    answered by the spill before that time, never also run by a batch; items with time to spare, or none set, wait for
    the worker; an item the spill cannot answer gives Expired, and only that one."""
    from predictor.sidecar.batcher import Expired

    seen: list[str] = []
    gate = threading.Event()

    def run_batch(items: list[str]) -> list[str]:
        gate.wait(5)  # the first batch holds the only worker while the others queue
        seen.extend(items)
        return [f"model:{x}" for x in items]

    def spill(items: list[str]) -> list[str | None]:
        return [None if x == "uncovered" else f"fast:{x}" for x in items]  # None: it cannot answer that one

    async def main():
        spills: list[int] = []
        b = MicroBatcher(run_batch, max_batch=256, max_wait_s=0.0, spill=spill, spill_margin_s=0.02,
                         on_spill=spills.append)
        b.start()
        loop = asyncio.get_running_loop()
        # a large first batch: the pace it shows while held (under a ms an item) leaves the late items looking on time
        first = asyncio.create_task(b.submit([f"first{i}" for i in range(200)]))
        await asyncio.sleep(0.02)
        t0 = loop.time()
        late = asyncio.create_task(b.submit(["late-a", "late-b"], expires_at=t0 + 0.1))
        uncovered = asyncio.create_task(b.submit(["uncovered"], expires_at=t0 + 0.1))
        spare = asyncio.create_task(b.submit(["spare"], expires_at=t0 + 30))
        forever = asyncio.create_task(b.submit(["forever"]))
        done_late = await late
        answered_in = loop.time() - t0
        await asyncio.sleep(0.1)
        gate.set()
        results = await asyncio.gather(first, uncovered, spare, forever, return_exceptions=True)
        await b.stop()
        return done_late, answered_in, results, sum(spills)

    late, answered_in, (first, uncovered, spare, forever), spilled = run(main())
    assert late == ["fast:late-a", "fast:late-b"] and 0.07 <= answered_in < 0.1
    assert isinstance(uncovered, Expired) and spilled == 3
    assert first == [f"model:first{i}" for i in range(200)] and spare == ["model:spare"] and forever == ["model:forever"]
    assert sorted(seen[200:]) == ["forever", "spare"]  # nothing spilled was run by the worker too


def test_an_item_a_batch_has_taken_is_not_spilled():
    """Once a batch runs an item, its deadline passing mid-run does not answer it twice: the batch's answer stands."""
    def slow(items: list[str]) -> list[str]:
        time.sleep(0.15)
        return [f"model:{x}" for x in items]

    async def main():
        spills: list[int] = []
        b = MicroBatcher(slow, max_batch=8, max_wait_s=0.0, spill=lambda xs: [f"fast:{x}" for x in xs],
                         spill_margin_s=0.02, on_spill=spills.append)
        b.start()
        out = await b.submit(["x"], expires_at=asyncio.get_running_loop().time() + 0.05)
        await b.stop()
        return out, sum(spills)

    assert run(main()) == (["model:x"], 0)


def test_spill_margin_is_checked():
    with pytest.raises(ValueError, match="spill_margin_s"):
        MicroBatcher(lambda xs: xs, spill=lambda xs: xs, spill_margin_s=-1)


def test_a_request_the_queue_would_make_late_is_spilled_on_arrival():
    """Once batches have shown their pace (50 ms an item here), a request arriving behind a queue it cannot clear before
    its caller's timeout goes to the spill at once, not at the deadline; one with time enough waits for the worker."""
    gate = threading.Event()

    def slow(items: list[str]) -> list[str]:
        if items != ["pace"]:
            gate.wait(5)
        time.sleep(0.05 * len(items))
        return [f"model:{x}" for x in items]

    async def main():
        b = MicroBatcher(slow, max_batch=1, max_wait_s=0.0, spill=lambda xs: [f"fast:{x}" for x in xs], spill_margin_s=0.01)
        b.start()
        loop = asyncio.get_running_loop()
        await b.submit(["pace"])  # one batch: 50 ms an item
        backlog = [asyncio.create_task(b.submit([f"q{i}"])) for i in range(4)]  # 200 ms of work, no deadline
        await asyncio.sleep(0.01)
        t0 = loop.time()
        late = await b.submit(["late"], expires_at=t0 + 0.1)
        answered_in = loop.time() - t0
        roomy = asyncio.create_task(b.submit(["roomy"], expires_at=t0 + 5))
        gate.set()
        rest = await asyncio.gather(*backlog, roomy)
        await b.stop()
        return late, answered_in, rest

    late, answered_in, rest = run(main())
    assert late == ["fast:late"] and answered_in < 0.05  # at once: not held until the 90 ms spill time
    assert rest == [[f"model:q{i}"] for i in range(4)] + [["model:roomy"]]


def test_before_any_batch_ends_the_running_batch_sets_the_pace_for_spilling_on_arrival():
    """On a sidecar just started, a burst's first batch is still running when a caller with a deadline arrives: what that
    batch has taken so far (50 ms for its one item here) is a floor on the pace, so the twenty items queued ahead send
    the caller to the spill at once, not at its deadline; a caller with time enough still waits for the worker."""
    gate = threading.Event()

    def held(items: list[str]) -> list[str]:
        gate.wait(5)
        return [f"model:{x}" for x in items]

    async def main():
        b = MicroBatcher(held, max_batch=1, max_wait_s=0.0, spill=lambda xs: [f"fast:{x}" for x in xs], spill_margin_s=0.01)
        b.start()
        loop = asyncio.get_running_loop()
        backlog = [asyncio.create_task(b.submit([f"q{i}"])) for i in range(21)]  # q0 runs, held; twenty queue
        await asyncio.sleep(0.05)
        t0 = loop.time()
        late = await b.submit(["late"], expires_at=t0 + 0.1)
        answered_in = loop.time() - t0
        roomy = asyncio.create_task(b.submit(["roomy"], expires_at=t0 + 60))
        gate.set()
        rest = await asyncio.gather(*backlog, roomy)
        await b.stop()
        return late, answered_in, rest

    late, answered_in, rest = run(main())
    assert late == ["fast:late"] and answered_in < 0.05  # at once: not held until the 90 ms spill time
    assert rest == [[f"model:q{i}"] for i in range(21)] + [["model:roomy"]]


def test_a_pace_measured_in_a_slow_moment_does_not_keep_requests_on_the_spill():
    """One slow batch (a cold start, a busy CPU: 300 ms an item here) would send every later caller with a 100 ms timeout
    to the spill, and the encoder, never run again, would never show it is fast now. A request spilled on arrival
    while the encoder is idle is answered by the spill and also run there as a probe: the next caller gets the model."""
    slow = [True]

    def encoder(items: list[str]) -> list[str]:
        time.sleep(0.3 if slow[0] else 0.001)
        return [f"model:{x}" for x in items]

    async def main():
        b = MicroBatcher(encoder, max_batch=4, max_wait_s=0.0, spill=lambda xs: [f"fast:{x}" for x in xs], spill_margin_s=0.01)
        b.start()
        loop = asyncio.get_running_loop()
        await b.submit(["cold"])  # 300 ms an item: the pace now
        slow[0] = False
        first = await b.submit(["a"], expires_at=loop.time() + 0.1)  # the stale pace says late: the spill answers
        await asyncio.sleep(0.2)  # the probe of "a" runs on the idle encoder (1 ms)
        second = await b.submit(["b"], expires_at=loop.time() + 0.1)
        await b.stop()
        return first, second

    first, second = run(main())
    assert first == ["fast:a"] and second == ["model:b"]
