"""What the gateway's answers show of the deployment and of the client's own input.

Why: an attacker with one client key read the deployment off the open pages and made the gateway echo megabytes. The
open ``/health`` named the sidecar (``models.<name>.predictor.url``, and in ``reasons`` when it was down); ``/v1/models``
showed the absolute directories of the model and its adapters (vLLM's cards carry them as ``root``); a 404 repeated a
60,000-character model name, and the engine's 400 for 100,000 ``stop_token_ids`` (712 KB, the list quoted back) was
relayed as it came. So:

- :func:`hide_deployment`: the open ``/health`` (keys enabled, the caller without one) holds no URL, host address or file
  path anywhere in its body, reasons included; ``url`` fields go, strings are scrubbed (:func:`scrub`).
- :func:`model_card`: a model card keeps what OpenAI clients read (``id``, ``object``, ``created``, ``owned_by``,
  ``parent``, ``max_model_len``) and vLLM's ``root`` as the served name; every other field goes.
- :func:`quote`: an error message quotes at most :data:`QUOTE_CHARS` characters of a client's value, with an ellipsis.
- :func:`engine_error`: an engine's error body longer than :data:`MAX_ERROR_BYTES` is relayed as OpenAI's error JSON with
  its message cut to :data:`MAX_MESSAGE_CHARS` characters (a body that is not one becomes one).
"""

from __future__ import annotations

import json
import re
from typing import Any

from serving.gateway.errors import INVALID, SERVER, error_body

QUOTE_CHARS = 64
MAX_ERROR_BYTES = 2048  # an engine's error body up to this size passes as it came
MAX_MESSAGE_CHARS = 512  # a longer one keeps this much of its message
ELLIPSIS = "…"

_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>(){},;]*")
_ADDRESS = re.compile(r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?\b|\blocalhost:\d+\b|\[[0-9A-Fa-f]*:[0-9A-Fa-f:.]*\](?::\d+)?")
# an absolute (or home) path of two parts or more; the gateway's and the sidecar's own routes (/v1/..., /health) are not
_PATH = re.compile(r"(?<![\w.:/~-])~?/(?!v1/)[^\s'\"<>()\[\]{},;:/]+/[^\s'\"<>()\[\]{},;:]*")
CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``value`` (a string, else its JSON) cut to ``limit`` characters, with an ellipsis when cut."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + ELLIPSIS


def scrub(text: str) -> str:
    """``text`` with every URL, host address and absolute file path replaced by ``<url>``, ``<address>``, ``<path>``."""
    text = _URL.sub("<url>", text)
    text = _ADDRESS.sub("<address>", text)
    return _PATH.sub("<path>", text)


def hide_deployment(node: Any) -> Any:
    """``node`` (a JSON value) with no ``url`` field (``*_url`` ones set to None) and every string scrubbed (:func:`scrub`)."""
    if isinstance(node, dict):
        return {scrub(k): None if k.endswith("_url") else hide_deployment(v) for k, v in node.items() if k != "url"}
    if isinstance(node, list):
        return [hide_deployment(v) for v in node]
    return scrub(node) if isinstance(node, str) else node


def model_card(card: dict[str, Any]) -> dict[str, Any]:
    """A vLLM model card without the directory it was loaded from: :data:`CARD_FIELDS`, ``root`` the served name."""
    out = {k: card[k] for k in CARD_FIELDS if k in card}
    out["root"] = card["id"]
    return out


def engine_error(content: bytes, status: int) -> bytes:
    """An engine's error body as the client gets it: as it came up to :data:`MAX_ERROR_BYTES`, else OpenAI's error JSON
    with each field cut (the message to :data:`MAX_MESSAGE_CHARS` characters)."""
    if len(content) <= MAX_ERROR_BYTES:
        return content
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = err.get("message")
        out = {"error": {"message": quote(message if isinstance(message, str) else "", MAX_MESSAGE_CHARS),
                         **{k: _field(err.get(k)) for k in ("type", "param", "code")}}}
    else:
        said = content[:4 * MAX_MESSAGE_CHARS].decode(errors="replace")
        out = error_body(f"the engine answered {status}: {quote(said, MAX_MESSAGE_CHARS)}", INVALID if status < 500 else SERVER,
                         code=status)
    return json.dumps(out, ensure_ascii=False).encode()


def _field(v: Any) -> Any:
    if v is None or isinstance(v, (int, float, bool)):
        return v
    return quote(v)
