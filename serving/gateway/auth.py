"""Who may call the gateway: OpenAI's bearer keys, checked as ``vllm serve --api-key`` checks them.

A client sends ``Authorization: Bearer KEY``, read and compared by the one rule the sidecar and the engines' guard share
(:mod:`predictor.bearer`: vLLM's parsing, SHA-256 digests compared in constant time, every key compared). A refusal is
a 401 in OpenAI's error shape (``code: invalid_api_key``) with ``WWW-Authenticate: Bearer``; it never echoes what the
client sent.

Without keys the gateway is open, as before. ``/health`` and ``/metrics`` stay open with keys (load balancers and
Prometheus probe them without credentials) unless ``protect_health``; ``OPTIONS`` is never checked (vLLM's rule).

Keys come from ``--api-key`` (repeatable), ``--api-key-file`` (one per line) and ``LENGTHWISE_API_KEY``; they are held
as :class:`pydantic.SecretStr`, so no log line, error or settings dump shows them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import SecretStr

from predictor.bearer import BearerKeys
from serving.gateway.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # open unless --protect-health
KEY_ENV = "LENGTHWISE_API_KEY"


class KeyCheck:
    """The configured keys and the rule of which paths need one (:class:`predictor.bearer.BearerKeys` compares them)."""

    def __init__(self, keys: Iterable[SecretStr], protect_health: bool = False,
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self._keys = BearerKeys(k.get_secret_value() for k in keys)
        self.protect_health, self.open_paths = protect_health, open_paths

    @property
    def enabled(self) -> bool:
        return self._keys.count > 0

    @property
    def count(self) -> int:
        return self._keys.count

    def needs_key(self, method: str, path: str) -> bool:
        if not self.enabled or method == "OPTIONS":
            return False
        return self.protect_health or path not in self.open_paths

    def allows(self, headers: Mapping[str, str]) -> bool:
        """Whether ``headers`` carry a configured key as a bearer token."""
        return self._keys.allows(headers.get("authorization"))

    def which(self, headers: Mapping[str, str]) -> int | None:
        """The index of the configured key ``headers`` carry (None: none): what tells one client's feedback and urgency
        from another's."""
        return self._keys.which(headers.get("authorization"))

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
