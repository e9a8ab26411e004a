"""Who may call the gateway: OpenAI's bearer keys, checked as ``vllm serve --api-key`` checks them.

A client sends ``Authorization: Bearer KEY``; the scheme is case-insensitive and the key is everything after the first
space, as in vLLM's ``AuthenticationMiddleware``. The key's SHA-256 is compared with each configured key's in constant
time (:func:`hmac.compare_digest`, every key compared, no early exit), so neither the time of an answer nor its text
says how much of a guess was right. A refusal is a 401 in OpenAI's error shape (``code: invalid_api_key``) with
``WWW-Authenticate: Bearer``; it never echoes what the client sent.

Without keys the gateway is open, as before. ``/health`` and ``/metrics`` stay open with keys (load balancers and
Prometheus probe them without credentials) unless ``protect_health``; ``OPTIONS`` is never checked (vLLM's rule).

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (one per line) and ``LENGTHWISE_API_KEY``; they are held
as :class:`pydantic.SecretStr`, so no log line, error or settings dump shows them.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import SecretStr

from serving.gateway.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # open unless --protect-health
KEY_ENV = "LENGTHWISE_API_KEY"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyCheck:
    """The configured keys (as digests) and the rule of which paths need one."""

    def __init__(self, keys: Iterable[SecretStr], protect_health: bool = False,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self._digests = [_digest(k.get_secret_value()) for k in keys]
        self.protect_health, self.open_paths = protect_health, open_paths

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    @property
    def count(self) -> int:
        return len(self._digests)

    def needs_key(self, method: str, path: str) -> bool:
        if not self._digests or method == "OPTIONS":
            return False
        return self.protect_health or path not in self.open_paths

    def allows(self, headers: Mapping[str, str]) -> bool:
        """Whether ``headers`` carry a configured key as a bearer token (every key compared, in constant time)."""
        return self.which(headers) is not None

    def which(self, headers: Mapping[str, str]) -> int | None:
        """The index of the configured key ``headers`` carry as a bearer token (None: none), every key compared in
        constant time; what tells one client's feedback and urgency from another's."""
        scheme, _, token = (headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        got = _digest(token)
        found = None
        for i, want in enumerate(self._digests):
            if hmac.compare_digest(got, want) and found is None:
                found = i
        return found

    def check(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        """Raise the 401 for a call to ``path`` that needs a key and does not carry one."""
        if self.needs_key(method, path) and not self.allows(headers):
            raise ApiError(401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def read_key_file(path: Path) -> list[str]:
    """The keys in ``path``: one per line; blank lines and lines starting with ``#`` are skipped.

    Raises ValueError with a message that names the file, never its content.
    """
    try:
        text = path.expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    keys = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    if not keys:
        raise ValueError(f"{path} holds no key (one per line)")
    return keys
