"""A real HTTP proxy in front of a real engine that can make the engine's ``/health`` slow (fault injection).

Why: a vLLM API server streaming many answers on a shared core can take seconds to answer ``/health`` while
its tokens keep flowing. That state is hard to produce on demand with the engine alone; this proxy passes
every byte of every other route through unchanged and delays only ``/health`` while ``slow`` is set.
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

from tests.conftest import free_port


class SlowHealthProxy:
    def __init__(self, upstream: str, delay_s: float):
        self.upstream, self.delay_s = upstream, delay_s
        self.slow = threading.Event()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST"])])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _forward(self, request: Request) -> Response:
        if request.url.path == "/health" and self.slow.is_set():
            await asyncio.sleep(self.delay_s)
        try:
            body = await request.body()
        except ClientDisconnect:  # the caller gave up (a probe past its timeout)
            return Response(status_code=499)
        client = httpx.AsyncClient(timeout=None)
        up = await client.send(client.build_request(request.method, self.upstream + request.url.path, content=body,
                                                    headers={"content-type": request.headers.get("content-type", "")}),
                               stream=True)

        async def close() -> None:
            await up.aclose()
            await client.aclose()

        return StreamingResponse(up.aiter_raw(), status_code=up.status_code, background=BackgroundTask(close),
                                 media_type=up.headers.get("content-type"))

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
