"""One rule for bearer keys, shared by everything that checks one: the gateway's client keys, the engines' guard and the
sidecar's token.

``Authorization: Bearer KEY``, as vLLM's ``AuthenticationMiddleware`` reads it: the scheme in any case, the key everything
after the first space. A key's SHA-256 is compared with every configured key's by :func:`hmac.compare_digest`, none
skipped after a match, so neither the time of an answer nor its text says how much of a guess was right.

Nothing here imports another module of the project (only the standard library), so the sidecar, the gateway and the
engines' guard, each in its own layer, share it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


def bearer(header: str | bytes | None) -> str | None:
    """The key an ``Authorization`` header value carries as a bearer token (None: no header, another scheme)."""
    if isinstance(header, bytes):
        header = header.decode("latin-1")
    scheme, _, token = (header or "").partition(" ")
    return token if scheme.lower() == "bearer" else None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class BearerKeys:
    """The configured keys, held as digests; which of them a header carries."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    @property
    def count(self) -> int:
        return len(self._digests)

    def which(self, header: str | bytes | None) -> int | None:
        """The index of the configured key ``header`` carries (None: none of them), every key compared."""
        token = bearer(header)
        if token is None:
            return None
        got, found = _digest(token), None
        for i, want in enumerate(self._digests):
            if hmac.compare_digest(got, want) and found is None:
                found = i
        return found

    def allows(self, header: str | bytes | None) -> bool:
        return self.which(header) is not None
