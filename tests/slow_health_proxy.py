"""A real HTTP proxy in front of a real engine that can make the engine's ``/health`` slow (fault injection).

Why: a vLLM API server streaming many answers on a shared core can take seconds to answer ``/health`` while
its tokens keep flowing. That state is hard to produce on demand with the engine alone; this proxy passes
every byte of every other route through unchanged and delays only ``/health`` while ``slow`` is set.
With ``pace_s`` it also passes a streamed answer on at most one event per ``pace_s``, so a stream lasts as long
as the test needs, however fast the engine runs on the machine at hand.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Self

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from serving.launch.process import free_port


class SlowHealthProxy:
    def __init__(self, upstream: str, delay_s: float, pace_s: float = 0.0):
        self.upstream, self.delay_s, self.pace_s = upstream, delay_s, pace_s
        self.slow = threading.Event()
        self._client: httpx.AsyncClient | None = None
        self.slow_answers = 0  # /health calls delayed so far
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _forward(self, request: Request) -> Response:
        if request.url.path == "/health" and self.slow.is_set():
            self.slow_answers += 1
            await asyncio.sleep(self.delay_s)
        try:
            body = await request.body()
        except ClientDisconnect:  # the caller gave up (a probe past its timeout)
            return Response(status_code=499)
        if self._client is None:  # one client for the proxy's life: building one loads the CA bundle holding the GIL,
            self._client = httpx.AsyncClient(timeout=None)  # which stalled this event loop for seconds on a busy machine
        client = self._client
        # the engine's own key passes through (engines are started with one: a proxy must not strip it)
        headers = {k: request.headers[k] for k in ("content-type", "authorization") if k in request.headers}
        up = await client.send(client.build_request(request.method, self.upstream + request.url.path, content=body,
                                                    headers=headers), stream=True)

        async def close() -> None:
            await up.aclose()

        body_iter = up.aiter_raw()
        if self.pace_s and "text/event-stream" in up.headers.get("content-type", ""):
            body_iter = self._paced(up)
        return StreamingResponse(body_iter, status_code=up.status_code, background=BackgroundTask(close),
                                 media_type=up.headers.get("content-type"))

    async def _paced(self, up: httpx.Response):
        async for line in up.aiter_lines():
            yield (line + "\n").encode()
            if line.startswith("data:"):
                await asyncio.sleep(self.pace_s)

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
