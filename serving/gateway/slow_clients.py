"""Clients too slow to send a request or to read its answer: each is given a time, then its connection is closed.

Why: a connection costs the gateway a file descriptor and memory however little the client does with it, and a client
that stops reading a stream holds more: the request's places in flight and its sequences on an engine. Measured
before these bounds, with one client key: 150 connections that sent headers (``Content-Length`` 16 MB) and 20 bytes of
body stayed open 49 s and more, counted nowhere (the gateway's open files went from 21 to 173); a connection that
sends nothing at all, or its headers a byte at a time, stayed open for ever (uvicorn arms its keep-alive timer only
after a response, and with httptools bounds neither the time nor the size of a request's head); and a stream whose
client reads nothing blocks its writer for ever, with the engine's sequence and the places held.

Four bounds, each ended by closing the connection (``settings.py``, ``docs/serving.md``):

- a new connection that sends nothing gets the keep-alive time (``client_keepalive_s``), as an idle kept-alive one does,
  and one idle that long with an answer still unread in its buffer is aborted;
- a request's head (request line and headers) must arrive within ``client_header_timeout_s`` of its first byte and
  hold at most :data:`MAX_HEAD_BYTES`: else 408 or 431 (:func:`guarded_protocol`, ``lengthwise serve``'s HTTP server);
- its body must arrive within ``client_body_timeout_s`` of its head: else 408 (``app.read_body``);
- a streamed answer whose client takes none of it for ``client_stall_timeout_s`` (its connection's buffers full: each
  write waits) is cut: the relay ends, which cancels the engine's request (vLLM aborts a request whose connection
  closes) and frees its places, and the connection is aborted, its unsent bytes dropped (:class:`ClientStream`).

What they do not cover: many connections that each stay within these times (a per-address connection limit belongs in
the load balancer or firewall in front). A non-streamed answer the client does not read is written whole into the
connection's buffer at once: its places and engine are free by then, and the keep-alive time ends the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from serving.gateway.errors import error_body

log = logging.getLogger("serving.gateway")

MAX_HEAD_BYTES = 64 << 10  # a request's line and headers: an OpenAI request's are well under 4 KiB (h11's own cap: 16 KiB)
ABORT = "lengthwise.abort"  # the ASGI scope extension (guarded_protocol's) that aborts the request's connection


class ClientStalled(Exception):
    """A write to the client waited longer than the stall timeout."""


class ClientStream(StreamingResponse):
    """A streamed answer that the client must keep taking: a write that waits more than ``stall_s`` (the connection's
    buffers are full: the client reads nothing) ends it.

    Then ``on_stall`` runs (metrics, the log), the body iterator is closed (the relay's own ``finally`` cancels the
    engine call and frees the places, as for a client that left), and the connection is aborted where the server lets
    the app do that (:data:`ABORT`, which :func:`guarded_protocol` provides): its unsent bytes dropped, its file
    descriptor closed at once. A plain close would wait for the client to read them first, which it does not.
    """

    def __init__(self, content: Any, *, stall_s: float, on_stall: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.stall_s, self.on_stall = stall_s, on_stall
        self._abort: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._abort = scope.get("extensions", {}).get(ABORT)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except ClientStalled:
            self.on_stall()
            if self._abort is not None:
                self._abort()
                await asyncio.sleep(0)  # the server sees the connection lost, so the unfinished answer is no error of ours
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:  # a stream cut anywhere ends its relay now, not when the generator is collected
                await close()

    async def _send(self, send: Send, message: Message) -> None:
        try:
            async with asyncio.timeout(self.stall_s):
                await send(message)
        except TimeoutError:
            raise ClientStalled from None


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP response in OpenAI's error shape that closes its connection, written where no app answers."""
    body = json.dumps(error_body(message, code=code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def guarded_protocol(header_timeout_s: float, on_refused: Callable[[str], None], base: type | None = None) -> type:
    """uvicorn's HTTP protocol (``base``, default its auto choice: httptools where installed, else h11) with the bounds
    on what comes before the app: the idle time of a new connection, and the time and size of each request's head.
    ``on_refused`` gets the reason (``slow_headers``, ``headers_too_large``) of each connection closed for them. It
    also gives each request's scope the :data:`ABORT` extension.

    It reads only what both of uvicorn's protocols keep: ``cycle`` (the request whose head is complete; its
    ``response_complete`` and ``scope``), ``transport`` and the keep-alive timer. Bytes that arrive while no request is
    in progress (none yet, or the last one answered) begin a request's head, which must then complete in time: a
    client still sending the body of a request answered without reading it (a 401) is cut by the same rule.
    """
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base

    class GuardedProtocol(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # uvicorn arms the keep-alive timer only after a response: a connection that never sends stays for ever
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            super().data_received(data)
            cycle = self.cycle
            if cycle is not before and cycle is not None:  # a request's head is complete: the app has it now
                self._head_done()
                cycle.scope.setdefault("extensions", {})[ABORT] = self.transport.abort
            elif cycle is None or cycle.response_complete:  # a head still coming
                self._head_bytes += len(data)
                if self._head_bytes > MAX_HEAD_BYTES:
                    self._refuse(431, "Request Header Fields Too Large", f"the request's line and headers exceed "
                                 f"{MAX_HEAD_BYTES} bytes", "headers_too_large")
                elif self._head_timer is None and not self.transport.is_closing():
                    self._head_timer = self.loop.call_later(header_timeout_s, self._head_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._head_done()
            super().connection_lost(exc)

        def timeout_keep_alive_handler(self) -> None:
            if self.transport.get_write_buffer_size():  # an answer its client never read: a close would wait on it
                self.transport.abort()
            else:
                super().timeout_keep_alive_handler()

        def _head_done(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            self._head_bytes = 0

        def _head_late(self) -> None:
            self._head_timer = None
            self._refuse(408, "Request Timeout", f"the request's line and headers did not arrive within "
                         f"{header_timeout_s:g} s", "slow_headers")

        def _refuse(self, status: int, reason: str, message: str, why: str) -> None:
            self._head_done()
            if self.transport.is_closing():
                return
            on_refused(why)
            log.debug("connection from %s closed: %s", (self.client or ("?",))[0], message)
            self.transport.write(_raw_error(status, reason, message, "request_timeout" if status == 408 else why))
            if self.transport.get_write_buffer_size():  # the client reads nothing either: nothing to wait for
                self.transport.abort()
            else:
                self.transport.close()

    return GuardedProtocol
