"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status.

Why one exception type: every check in the gateway raises :class:`ApiError` and one handler turns it into
the JSON the ``openai`` client parses, so a client error can never escape as a 500 or a traceback.
"""

from __future__ import annotations

import json
from typing import Any

INVALID = "invalid_request_error"  # OpenAI's type for every 4xx caused by the request
SERVER = "server_error"  # ... and for failures on our side (engines gone, timeouts)


class ApiError(Exception):
    """A request the gateway refuses or cannot serve; ``status`` is the HTTP status code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or (INVALID if status < 500 else SERVER)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self):
        from fastapi.responses import JSONResponse

        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, type: str = INVALID, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def sse_error(message: str, code: str = "engine_failed") -> bytes:
    """The event that ends a stream which already sent tokens; the ``openai`` client raises ``APIError`` on it."""
    return b"data: " + json.dumps(error_body(message, SERVER, None, code)).encode() + b"\n\ndata: [DONE]\n\n"
