"""Requests that crash engines: found by sending a suspect alone, then refused for a while.

Why: an engine the gateway started comes back after it dies (:mod:`serving.launch.supervise`), and a request whose
engine died before it sent the client anything is sent again. A request that itself crashes engines would crash each
engine it is sent to, and again each time its client sends it, until the restart budget is spent and the engines stay
down: one client could stop the whole service. vLLM names no culprit when its engine core dies (every request on it
gets the same 500), so the gateway finds it the way one finds a flaky test, by isolation:

1. every request on an engine when it dies is charged with that death (its fingerprint, below) and sent again as
   usual: one death (a kill, the OOM killer) costs the requests on it nothing more;
2. a request charged with two deaths (it was sent again beside the culprit, or is the culprit) is sent again only *on
   probation*: alone among such suspects (:class:`Probation`, one at a time in the gateway; requests nobody suspects
   run beside it as usual), so a death while it is in flight points at it;
3. a suspect on probation whose engine dies is refused (a 400 that says so) for ``hold_s``; so are the requests of its
   kind once two different requests of that kind were refused: a client that varies its text for free cannot go on.

A culprit thus takes an engine down three times before it is refused (the restart budget allows for that); the
requests that shared its first deaths go through probation one by one and are answered: none is refused for being
in the wrong batch.

A fingerprint's *identity* is the request's body without what changes between sends of one request (``stream``,
``user``, ``seed``, ...). Its *kind* is its endpoint, model and the names of the options it sets beyond the everyday
ones, whatever their values: a crash comes far more often from options than from text (vLLM 0.32's engine core died on
``prompt_logprobs`` beside another request on an engine serving LoRA adapters). A request with no such option has no
kind to refuse: everyday requests are refused only one by one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from serving.gateway.errors import ApiError

# the fields of an everyday request, or the gateway's own: not part of a kind
EVERYDAY = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
                      "temperature", "top_p", "user", "request_id", "seed", "vllm_xargs"})
VOLATILE = frozenset({"stream", "stream_options", "user", "request_id", "seed", "vllm_xargs"})  # not in an identity
KIND_AFTER = 2  # requests of one kind refused one by one before the kind is
PROBATION_AFTER = 2  # deaths a request is charged with before it is sent again only on probation


@dataclass(frozen=True, slots=True)
class Fingerprint:
    identity: str  # a hash of the body, less what changes between sends
    kind: str | None  # a hash of the endpoint, model and unusual option names; None for an everyday request
    says: str  # the kind in words, for the client


def _set(value: Any) -> bool:
    return value not in (None, False, [], {}, "")


def _hash(parts: list[str]) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:32]


def fingerprint(kind: str, model: str, body: dict[str, Any]) -> Fingerprint:
    """The request's identity and kind (see the module docstring)."""
    options = sorted(k for k, v in body.items() if k not in EVERYDAY and _set(v) and not (k == "n" and v == 1))
    kept = {k: v for k, v in body.items() if k not in VOLATILE}
    identity = _hash(["body", kind, json.dumps(kept, sort_keys=True, default=str)])
    if not options:
        return Fingerprint(identity, None, "this request")
    return Fingerprint(identity, _hash(["options", kind, model, *options]),
                       f"{kind} requests for '{model[:64]}' with {', '.join(options)}")


class CrashQuarantine:
    """Suspects and refusals, each kept ``hold_s`` (0: nothing is ever suspected or refused)."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self._deaths: dict[str, dict[Hashable, float]] = {}  # identity -> {a death it was charged with: when}
        self._refused: dict[str, float] = {}  # identity or kind -> until when
        self._kinds: dict[str, set[str]] = {}  # kind -> identities of it refused

    def charge(self, fp: Fingerprint, death: Hashable, on_probation: bool, now: float | None = None) -> bool:
        """``fp``'s request was on an engine when it died (``death`` names it: an engine in one of its lives): charged,
        or refused if it was on probation. True when it is refused now."""
        if self.hold_s <= 0:
            return False
        now = time.monotonic() if now is None else now
        self._forget(now)
        if not on_probation:
            self._deaths.setdefault(fp.identity, {}).setdefault(death, now)
            return self.refuses(fp, now) is not None
        self._refused[fp.identity] = now + self.hold_s
        if fp.kind is not None:
            refused = self._kinds.setdefault(fp.kind, set())
            refused.add(fp.identity)
            if len(refused) >= KIND_AFTER:
                self._refused[fp.kind] = now + self.hold_s
        return True

    def suspect(self, fp: Fingerprint, now: float | None = None) -> bool:
        """Whether ``fp``'s request must go on probation: charged with :data:`PROBATION_AFTER` deaths within ``hold_s``."""
        now = time.monotonic() if now is None else now
        return sum(now - t < self.hold_s for t in self._deaths.get(fp.identity, {}).values()) >= PROBATION_AFTER

    def refuses(self, fp: Fingerprint, now: float | None = None) -> tuple[float, str] | None:
        """(seconds left, what is refused) while ``fp`` is refused, else None."""
        now = time.monotonic() if now is None else now
        for key, what in ((fp.kind, fp.says), (fp.identity, "this request")):
            until = self._refused.get(key) if key is not None else None
            if until is not None and until > now:
                return until - now, what
        return None

    def check(self, fp: Fingerprint, now: float | None = None) -> None:
        """A 400 while ``fp`` is refused, saying what, why and for how long."""
        refused = self.refuses(fp, now)
        if refused is None:
            return
        left, what = refused
        why = (f"was on engines when they died {PROBATION_AFTER + 1} times, the last time alone among suspects"
               if what == "this request" else
               f"took down engines: {KIND_AFTER} different such requests were each on an engine when it died, alone")
        raise ApiError(400, f"refused for {left:.0f} s more: {what} {why}. vLLM fails on it (the gateway log has the "
                       "engine's error); change its options, or ask the operator", code="request_quarantined",
                       headers={"Retry-After": str(max(1, round(left)))})

    def state(self) -> dict[str, int]:
        """Counts for /health: suspects and refusals in force."""
        now = time.monotonic()
        self._forget(now)
        return {"suspects": sum(self.suspect(Fingerprint(i, None, ""), now) for i in self._deaths),
                "refused": len(self._refused)}

    def _forget(self, now: float) -> None:
        for key in [k for k, d in self._deaths.items() if all(now - t >= self.hold_s for t in d.values())]:
            del self._deaths[key]
        for key in [k for k, until in self._refused.items() if until <= now]:
            del self._refused[key]
        for kind in [k for k in self._kinds if k not in self._refused and not
                     any(i in self._refused for i in self._kinds[k])]:
            del self._kinds[kind]


class Probation:
    """One suspect in flight at a time (see the module docstring): :meth:`enter` waits for the one before to end."""

    def __init__(self) -> None:
        self._lock = asyncio.Lock()

    async def enter(self) -> Pass:
        await self._lock.acquire()
        return Pass(self._lock)


class Pass:
    """A suspect's turn; :meth:`leave` is idempotent, so every way its request ends may call it."""

    __slots__ = ("_lock",)

    def __init__(self, lock: asyncio.Lock) -> None:
        self._lock: asyncio.Lock | None = lock

    def leave(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
