"""A client holding one valid key against ``lengthwise serve``: it fills every place, multiplies one place's work with
``n``, sends a body (or headers) that never arrives, or stops reading its stream. Each is bounded now
(serving/gateway/admission.py, serving/gateway/slow_clients.py); these tests fail on a gateway without the bounds.

Real parts: a ``lengthwise serve`` process with three client keys and 2 s timeouts, over a stand-in engine
(tests/standin_engine.py: a real HTTP server that holds or floods streams on demand, and sees when the gateway closes
its connection); the clients are raw sockets where HTTP clients would not misbehave as an attacker does.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time

import httpx
import psutil
import pytest

from tests.gateway_proc import Gateway, start_gateway
from tests.sidecar_proc import wait_for
from tests.standin_engine import MODEL, StandInEngine

TIMEOUT_S = 2.0  # the gateway's header, body and stall timeouts here
KEYS = ("key-a", "key-b", "key-c")
LIMIT = 8  # --max-outstanding: a key's share is 4


@pytest.fixture(scope="module")
def engine():
    e = StandInEngine()
    yield e
    e.stop()


@pytest.fixture(scope="module")
def gw(engine, tmp_path_factory) -> Gateway:
    logs = tmp_path_factory.mktemp("slow-clients")
    keys = logs / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    g = start_gateway(logs, "--engine-url", engine.url, "--api-key-file", str(keys), "--max-outstanding", str(LIMIT),
                      "--max-n", "16", "--client-header-timeout", str(TIMEOUT_S), "--client-body-timeout",
                      str(TIMEOUT_S), "--client-stall-timeout", str(TIMEOUT_S), "--timeout-keep-alive", "3",
                      "--health-interval", "0.5", env={"LENGTHWISE_API_KEY": "", "LENGTHWISE_ENGINE_API_KEY": ""})
    yield g
    g.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _inflight(gw: Gateway) -> int:
    return gw.get("/health").json()["inflight"]


def _settled(gw: Gateway, engine: StandInEngine) -> None:
    engine.release()
    wait_for(lambda: _inflight(gw) == 0 and engine.streams == 0, timeout=20, what="every place and stream ended")


async def _hold(client: httpx.AsyncClient, gw: Gateway, key: str, **fields) -> httpx.Response:
    """A stream the stand-in holds open after its first event (its headers are back: it holds its places)."""
    req = client.build_request("POST", gw.url + "/v1/completions", headers=_auth(key), json={
        "model": MODEL, "prompt": "hold", "max_tokens": 16, "stream": True, **fields})
    return await client.send(req, stream=True)


# --- places: a share per key, a place per sequence -------------------------------------------------------------------
def test_one_key_fills_only_its_share_and_another_key_is_still_served(gw, engine):
    async def go() -> tuple[list[int], httpx.Response, int, int]:
        async with httpx.AsyncClient(timeout=30) as client:
            held = [await _hold(client, gw, "key-a") for _ in range(LIMIT // 2)]
            past = await client.post(gw.url + "/v1/completions", headers=_auth("key-a"), json={
                "model": MODEL, "prompt": "one more", "max_tokens": 4})
            other = await _hold(client, gw, "key-b")
            inflight = _inflight(gw)
            for r in [*held, other]:
                await r.aclose()
            return [r.status_code for r in held], past, other.status_code, inflight

    try:
        held, past, other, inflight = asyncio.run(go())
        assert held == [200] * 4 and other == 200 and inflight == 5
        err = past.json()["error"]
        assert past.status_code == 429 and past.headers["retry-after"] == "1"
        assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "this API key holds its share" in err["message"] and "4 of 8" in err["message"]
        assert gw.metric("lengthwise_gateway_rejected_total", reason="key_share") == 1
        assert gw.get("/health").json()["max_outstanding_per_key"] == 4
    finally:
        _settled(gw, engine)


def test_a_place_is_a_sequence_n_beams_and_best_of_included(gw, engine):
    async def go() -> tuple[list[int], list[int], httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as client:
            # first, at 0 in flight: more sequences than the bound, then than a key's share (400s: never admissible)
            wide = await client.post(gw.url + "/v1/completions", headers=_auth("key-c"), json={
                "model": MODEL, "prompt": "x", "max_tokens": 4, "n": 9})
            share = await client.post(gw.url + "/v1/completions", headers=_auth("key-c"), json={
                "model": MODEL, "prompt": ["x", "y", "z"], "max_tokens": 4, "n": 2})
            held, seen = [], []
            for key, fields in (("key-a", {"n": 4}), ("key-b", {"n": 2, "use_beam_search": True}),
                                ("key-c", {"best_of": 2})):
                held.append(await _hold(client, gw, key, **fields))
                seen.append(_inflight(gw))
            full = await client.post(gw.url + "/v1/completions", headers=_auth("key-c"), json={
                "model": MODEL, "prompt": "one more", "max_tokens": 4})
            for r in held:
                await r.aclose()
            return [r.status_code for r in held], seen, full, wide, share

    try:
        held, seen, full, wide, share = asyncio.run(go())
        assert held == [200] * 3 and seen == [4, 6, 8]  # n=4, then a beam width of 2, then best_of 2
        assert full.status_code == 429 and "limit of 8 sequences in flight" in full.json()["error"]["message"]
        assert wide.status_code == 400 and "9 sequences (n=9)" in wide.json()["error"]["message"]
        assert share.status_code == 400 and "6 sequences (3 prompts x n=2)" in share.json()["error"]["message"]
        assert "one API key may hold in flight here (4)" in share.json()["error"]["message"]
        assert gw.metric("lengthwise_gateway_rejected_total", reason="overload") == 1
        assert gw.metric("lengthwise_gateway_rejected_total", reason="too_many_sequences") == 2
        assert [b.get("n", 1) for b in engine.bodies[-3:]] == [4, 2, 1]  # each went to the engine as sent
    finally:
        _settled(gw, engine)


# --- clients too slow to send ------------------------------------------------------------------------------------------
def _connect(gw: Gateway, rcvbuf: int | None = None) -> socket.socket:
    host, port = gw.url.removeprefix("http://").split(":")
    s = socket.socket()
    if rcvbuf is not None:  # set before connecting: it sets the window the gateway may fill
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect((host, int(port)))
    return s


def _until_closed(s: socket.socket, timeout: float) -> tuple[bytes, float, bool]:
    """What the gateway sent until it closed the connection, when that was (on the monotonic clock), and whether it
    was closed within ``timeout``."""
    got, deadline = b"", time.monotonic() + timeout
    s.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got, time.monotonic(), True
        if not chunk:
            return got, time.monotonic(), True
        got += chunk
    return got, time.monotonic(), False


def _held(gw: Gateway, s: socket.socket) -> bool:
    """Whether the gateway process holds a socket (a file descriptor) of the connection ``s`` is the client's end of."""
    port = s.getsockname()[1]
    return any(c.raddr and c.raddr.port == port for c in psutil.Process(gw.proc.pid).net_connections(kind="tcp"))


def _head(key: str, length: int, path: str = "/v1/completions") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


@pytest.mark.parametrize("trickle", [False, True], ids=["stops", "trickles"])
def test_a_body_that_is_not_whole_in_time_gets_408_and_its_connection_is_closed(gw, trickle):
    before = gw.metric("lengthwise_gateway_rejected_total", reason="slow_body")
    s = _connect(gw)
    try:
        t0 = time.monotonic()
        s.sendall(_head("key-a", 16_000_000) + b'{"model": "m", "pro')  # 16 MB announced, 20 bytes sent
        while trickle and time.monotonic() < t0 + 10 * TIMEOUT_S and not select.select([s], [], [], 0.3)[0]:
            s.sendall(b" ")  # a byte every 0.3 s: never idle for long
        got, closed_at, closed = _until_closed(s, 10 * TIMEOUT_S)
        held = _held(gw, s)
    finally:
        s.close()
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert not held  # its file descriptor is closed
    assert closed and TIMEOUT_S * 0.9 < closed_at - t0 < TIMEOUT_S + 5, closed_at - t0  # slack for a busy machine
    err = json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]
    assert err["code"] == "request_timeout" and f"did not arrive within {TIMEOUT_S:g} s" in err["message"]
    assert gw.metric("lengthwise_gateway_rejected_total", reason="slow_body") == before + 1
    assert _inflight(gw) == 0  # a request whose body never came held no place
    print(f"\nslow body ({'trickles' if trickle else 'stops'}): 408 and closed {closed_at - t0:.2f} s after its headers")


@pytest.mark.parametrize("sent,status,reason", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n", b"408", "slow_headers"),  # slowloris: the head never ends
    (b"GET /health HTTP/1.1\r\nHost: gw\r\n" + b"X-Pad: " + b"a" * (80 << 10), b"431", "headers_too_large"),
], ids=["slow", "huge"])
def test_a_head_that_is_not_whole_in_time_or_too_big_closes_its_connection(gw, sent, status, reason):
    before = gw.metric("lengthwise_gateway_rejected_total", reason=reason)
    s = _connect(gw)
    try:
        t0 = time.monotonic()
        s.sendall(sent)
        got, closed_at, closed = _until_closed(s, 10 * TIMEOUT_S)
    finally:
        s.close()
    assert closed and got.startswith(b"HTTP/1.1 " + status), got[:200]
    assert closed_at - t0 < TIMEOUT_S + 5, closed_at - t0
    assert gw.metric("lengthwise_gateway_rejected_total", reason=reason) == before + 1
    print(f"\n{reason}: {status.decode()} and closed {closed_at - t0:.2f} s after its first byte")


def test_a_connection_that_sends_nothing_is_closed_after_the_keep_alive_time(gw):
    s = _connect(gw)
    try:
        t0 = time.monotonic()
        got, closed_at, closed = _until_closed(s, 15)
    finally:
        s.close()
    assert closed and got == b"" and 2.5 < closed_at - t0 < 8, closed_at - t0  # --timeout-keep-alive 3


# --- a client that stops reading -----------------------------------------------------------------------------------------
def test_a_stream_whose_client_reads_nothing_is_cut_its_engine_call_closed_and_its_places_freed(gw, engine):
    raw = json.dumps({"model": MODEL, "prompt": "flood", "max_tokens": 100_000, "stream": True, "n": 2}).encode()
    cut_before = engine.cut
    s = _connect(gw, rcvbuf=4096)
    try:
        t0 = time.monotonic()
        s.sendall(_head("key-a", len(raw)) + raw)  # then reads nothing
        wait_for(lambda: engine.streams == 1, timeout=10, what="the engine's stream")
        assert _inflight(gw) == 2  # its two sequences
        wait_for(lambda: gw.metric("lengthwise_gateway_client_stalled_total") == 1, timeout=10 * TIMEOUT_S,
                 what="the stalled stream counted")
        stalled = time.monotonic() - t0
        wait_for(lambda: _inflight(gw) == 0 and engine.streams == 0, timeout=10, what="its places and engine call freed")
        assert engine.cut == cut_before + 1  # the gateway closed its engine connection: vLLM aborts the request
        assert not _held(gw, s)  # aborted, though its client has read nothing yet
        _, _, closed = _until_closed(s, 10)  # what was buffered for it, then the end: the connection was aborted
        assert closed
    finally:
        s.close()
    assert TIMEOUT_S <= stalled < TIMEOUT_S + 8, stalled
    print(f"\nstalled stream: counted and cut {stalled:.1f} s after it was sent (stall timeout {TIMEOUT_S:g} s)")
    # the gateway serves on: a stream read to its end
    with httpx.stream("POST", gw.url + "/v1/completions", headers=_auth("key-a"), timeout=30, json={
            "model": MODEL, "prompt": "hold", "max_tokens": 4, "stream": True}) as r:
        engine.release()
        assert r.status_code == 200 and "data: [DONE]" in list(r.iter_lines())


def test_an_answer_left_unread_past_the_keep_alive_time_ends_its_connection(gw):
    """A non-streamed answer is written whole at once (its places are free by then); a client that never reads it would
    keep the connection, since a plain close waits for the bytes to go out."""
    raw = json.dumps({"model": MODEL, "prompt": "big", "max_tokens": 4}).encode()
    answered = gw.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="200")
    s = _connect(gw, rcvbuf=4096)
    try:
        s.sendall(_head("key-a", len(raw)) + raw)  # then reads nothing
        wait_for(lambda: gw.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="200")
                 > answered, timeout=10, what="the answer sent")
        t0 = time.monotonic()
        assert _inflight(gw) == 0 and _held(gw, s)
        wait_for(lambda: not _held(gw, s), timeout=15, what="the gateway's end of the connection closed")
        ended = time.monotonic() - t0
    finally:
        s.close()
    assert 2 < ended < 10, ended  # --timeout-keep-alive 3


def test_a_stream_read_to_its_end_is_not_cut(gw, engine):
    """A client that reads, however slowly its engine answers, is never taken for a stalled one."""
    before = gw.metric("lengthwise_gateway_client_stalled_total")
    with httpx.stream("POST", gw.url + "/v1/completions", headers=_auth("key-b"), timeout=30, json={
            "model": MODEL, "prompt": "hold", "max_tokens": 4, "stream": True}) as r:
        time.sleep(2 * TIMEOUT_S)  # the engine sends nothing meanwhile: no write waits
        engine.release()
        lines = list(r.iter_lines())
    assert r.status_code == 200 and "data: [DONE]" in lines
    assert gw.metric("lengthwise_gateway_client_stalled_total") == before
