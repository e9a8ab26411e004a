"""Server-sent events between engine and client: read the engine's ``data:`` events, pass them on as they are,
except for the usage chunk the gateway asked for on its own behalf.

Why parse at all: the actual output length (``usage.completion_tokens``) arrives in the stream's last
chunk, and the time to the first generated token is seen only here. Where the gateway refines predictions
(:mod:`serving.gateway.refine`) the relay also keeps the answer's text so far.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from serving.gateway.feedback import finish_reason_of


async def sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The ``data`` payload of each event (multi-line data joined with newlines, as the SSE spec says)."""
    buf: list[str] = []
    async for line in lines:
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith("data:"):
            buf.append(line[5:].removeprefix(" "))
    if buf:
        yield "\n".join(buf)


def _texts(choices: list) -> int:
    """Choices of one event that carry generated output: vLLM streams one token per choice and event by default."""
    n = 0
    for c in choices:
        if not isinstance(c, dict):
            continue
        delta = c.get("delta")
        if c.get("text") or (isinstance(delta, dict) and (delta.get("content") or delta.get("reasoning")
                                                          or delta.get("reasoning_content") or delta.get("tool_calls"))):
            n += 1
    return n


def _first_choice_text(choices: list) -> str:
    """The text the first choice (``index`` 0) of one event adds to its answer."""
    for c in choices:
        if isinstance(c, dict) and c.get("index", 0) == 0:
            delta = c.get("delta")
            text = c.get("text") if "text" in c else delta.get("content") if isinstance(delta, dict) else None
            return text if isinstance(text, str) else ""
    return ""


class StreamRelay:
    """Turns engine events into client bytes; remembers usage, when the first token passed and how many passed, and
    with ``keep_text`` the first choice's answer so far (:attr:`answer`)."""

    def __init__(self, wants_usage: bool, keep_text: bool = False):
        self.wants_usage = wants_usage
        self._text: list[str] | None = [] if keep_text else None
        self.completion_tokens: int | None = None
        self.finish_reason: str | None = None  # the engine's, from the chunk that ends the answer
        self.first_token_at: float | None = None
        self.token_events = 0  # choices with output seen so far: the tokens generated, as the stream tells them
        self.events = 0
        self.done = False

    def relay(self, data: str) -> bytes | None:
        """Bytes for the client, or None to send nothing for this event."""
        if data.strip() == "[DONE]":
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            obj = json.loads(data)
        except ValueError:
            return f"data: {data}\n\n".encode()
        if not isinstance(obj, dict):
            return f"data: {data}\n\n".encode()
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.completion_tokens = usage["completion_tokens"]
        choices = obj.get("choices")
        self.finish_reason = finish_reason_of(obj) or self.finish_reason
        texts = _texts(choices) if isinstance(choices, list) else 0
        if texts and self._text is not None:
            self._text.append(_first_choice_text(choices))
        if texts:
            self.token_events += texts
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()
        if not self.wants_usage and "usage" in obj:
            if not choices:
                return None  # the usage-only chunk we requested for ourselves
            del obj["usage"]
            data = json.dumps(obj, separators=(",", ":"))
        self.events += 1
        return f"data: {data}\n\n".encode()

    @property
    def answer(self) -> str:
        """The first choice's text so far ("" unless kept)."""
        if not self._text:
            return ""
        if len(self._text) > 1:
            self._text[:] = ["".join(self._text)]
        return self._text[0]
