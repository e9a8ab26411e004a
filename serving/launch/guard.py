"""The engines' key on every route of an engine the gateway starts, not only on vLLM's API prefixes.

Why: ``vllm serve --api-key`` (or ``VLLM_API_KEY``) guards paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
only, so ``POST /invocations`` served a completion without the key, with the caller's own ``pred_len`` and
``deadline`` in ``vllm_xargs``, and ``/tokenize``, ``/detokenize``, ``/scale_elastic_ep``, ``/load`` and the rest were
open to any process on the machine. vLLM's official hook for this is ``--middleware`` (an ASGI class it adds to its
app); the gateway starts its engines with ``--middleware serving.launch.guard.EngineKeyMiddleware``, which asks
every HTTP or WebSocket call for the key in ``VLLM_API_KEY`` (the same key vLLM's own check wants, held in the
engine's environment), by the rule the gateway and the sidecar share (:mod:`predictor.bearer`). Open: ``/health`` and
``/ping``, which answer "alive" and nothing more, vLLM's Prometheus ``/metrics`` (counts, no text of any request),
and ``OPTIONS``: probes and Prometheus carry no key. Attached engines can run
it too: ``vllm serve ... --middleware serving.launch.guard.EngineKeyMiddleware`` with ``VLLM_API_KEY`` set.
"""

from __future__ import annotations

import json
import os

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from predictor.bearer import BearerKeys

KEY_ENV = "VLLM_API_KEY"
OPEN = frozenset({"/health", "/ping", "/metrics"})  # probes and Prometheus carry no key; none of them does anything
MIDDLEWARE = f"{__name__}.EngineKeyMiddleware"


class EngineKeyMiddleware:
    """Pure ASGI: a call without the key gets a 401 before the engine's app sees it; without a key set, nothing is
    checked (an engine run open on purpose)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self.keys = BearerKeys([key] if key else [])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.keys.count:
            path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
            needs = scope.get("method") != "OPTIONS" and path not in OPEN
            if needs and not self.keys.allows(Headers(scope=scope).get("authorization")):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = json.dumps({"error": {"message": "this engine is reached through its gateway; missing or wrong "
                                             "key", "type": "invalid_request_error", "param": None,
                                             "code": "invalid_api_key"}}).encode()
                await send({"type": "http.response.start", "status": 401, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
