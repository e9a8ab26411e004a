"""The sidecar's bearer token: where it comes from, and the ASGI middleware that asks for it.

Why a token at all: ``/v1/feedback`` turns what a caller says into online error windows, drift alarms, MLflow
monitoring runs and training rows, and ``/v1/predict`` spends CPU; on a shared network only the gateway should reach
them. With a token set, every path but the probes (``/health``, ``/ready``, ``/metrics``: load balancers and
Prometheus carry no token, unless ``--protect-health``) and the API description needs ``Authorization: Bearer
<token>``, read and compared by the rule the gateway and the engines share (:mod:`predictor.bearer`); a missing or
wrong one gets the sidecar's usual ``{"detail": ...}`` error with status 401, before the body is read. The token is
never logged or echoed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from predictor.bearer import BearerKeys

if TYPE_CHECKING:  # the command line reads tokens without importing the web stack
    from starlette.types import ASGIApp, Receive, Scope, Send

TOKEN_ENV = "LENGTHWISE_SIDECAR_TOKEN"
PROBES = ("/health", "/ready", "/metrics")
API_DOCS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # the contract, no data: always open
REFUSED = "missing or wrong token: this sidecar wants 'Authorization: Bearer <token>'"


class TokenError(ValueError):
    """The token settings cannot give a token (an unreadable or empty file, an empty value, two sources)."""


def read_token_file(path: str | Path) -> str:
    """The token in ``path`` (surrounding whitespace and the final newline stripped)."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenError(f"--token-file: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise TokenError(f"--token-file: {path} is empty")
    return token


def load_token(token: str | None, token_file: str | None, environ: dict[str, str] | None = None) -> str | None:
    """The token from ``--token``, else ``--token-file``, else $LENGTHWISE_SIDECAR_TOKEN; None: the sidecar is open."""
    if token is not None and token_file is not None:
        raise TokenError("give --token or --token-file, not both")
    if token is not None:
        if not token.strip():
            raise TokenError("--token is empty")
        return token.strip()
    if token_file is not None:
        return read_token_file(token_file)
    return (environ if environ is not None else os.environ).get(TOKEN_ENV, "").strip() or None


async def send_error(send: Send, status: int, detail: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    """A whole JSON ``{"detail": ...}`` response, the one error shape every sidecar endpoint answers with."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class BearerAuth:
    """ASGI middleware: 401 for a request without the token, on every path but the open ones; ``on_refused(path)``
    counts each refusal."""

    def __init__(self, app: ASGIApp, token: str, protect_health: bool, on_refused: Callable[[str], None]):
        self.app, self.token, self.on_refused = app, BearerKeys([token]), on_refused
        self.open = frozenset(API_DOCS if protect_health else (*API_DOCS, *PROBES))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open:
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope.get("headers") or [] if k == b"authorization"), None)
        if self.token.allows(header):
            await self.app(scope, receive, send)
            return
        self.on_refused(scope["path"])
        await send_error(send, 401, REFUSED, ((b"www-authenticate", b"Bearer"),))
