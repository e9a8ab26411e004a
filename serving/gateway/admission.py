"""How much work the gateway accepts: a bound on requests in flight, past which a request gets 429 at once.

Why bound it here: without a bound, a burst past the engines' capacity queues without limit, in the gateway's
connections and inside the engines; every request then waits longer, the deadlines the scheduler orders by pass for all
of them, and clients time out after the work was spent. A 429 with ``Retry-After`` costs the client one round trip and
tells a load balancer to send the request elsewhere.

Two bounds (:meth:`~serving.gateway.settings.GatewaySettings.outstanding_bounds`): requests in flight in the whole
gateway, checked on arrival before anything else is spent on the request (no prediction, no engine), and requests on one
engine, which placement respects (an engine at its bound is not chosen; when every engine is, the request gets the same
429). A request leaves when its answer is complete, failed, or its client left.

A place is one sequence on an engine, not one request: ``n`` sequences per prompt (a beam search's width is its ``n``),
for each prompt of a completions prompt list (:attr:`~serving.gateway.requests.ClientRequest.sequences`). Counted by
requests, 16 requests of ``n: 4`` put 64 sequences on an engine of 8, each behind one place. A request is admitted with
one place on arrival and widened to its sequences once its body is read (:meth:`Admission.widen`).

With client keys one key may hold only its share of the places (:meth:`~serving.gateway.settings.GatewaySettings.key_share`):
without it one key filled every place (16 streams on a slow engine, for minutes) and every other client got 429.
"""

from __future__ import annotations

from serving.gateway.errors import ApiError

RETRY_AFTER_S = 1


def overloaded(what: str) -> ApiError:
    """The 429 for a request past a bound (OpenAI's shape and code for a rate limit)."""
    return ApiError(429, f"the gateway is at its limit of {what}; retry later", type="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


class OverShare(ApiError):
    """The 429 for a request past its key's share of the places (:func:`over_share`)."""


def over_share(share: int, limit: int) -> OverShare:
    """The 429 for a request whose API key holds its share of the places already: it is this key's share that is full,
    not the gateway, which other keys may still be using below its limit."""
    return OverShare(429, f"this API key holds its share of the gateway's places in flight ({share} of {limit} "
                     "sequences); retry when one of its requests has ended", type="rate_limit_error",
                     code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


class Slot:
    """One admitted request's places (``weight``: one per sequence it puts on an engine), held for ``key`` (a client
    key's index; None: not counted per key); :meth:`release` is idempotent, so every way a request ends may call it."""

    __slots__ = ("_gate", "key", "released", "weight")

    def __init__(self, gate: Admission, key: int | None = None) -> None:
        self._gate, self.key, self.released, self.weight = gate, key, False, 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate.leave(self.weight, self.key)


class Admission:
    """Counts places in flight; :meth:`admit` and :meth:`widen` refuse past ``limit``, or past ``share`` for one key
    (None: no bound per key). ``peak`` is the most ever in flight at once: the bound as the gateway kept it, where a
    client's view also counts answers still on their way to it. ``held`` maps a key to the places it holds."""

    def __init__(self, limit: int, on_change=None, share: int | None = None) -> None:
        self.limit, self.inflight, self.peak, self._on_change = limit, 0, 0, on_change
        self.share = share
        self.held: dict[int, int] = {}

    def admit(self, key: int | None = None) -> Slot:
        """One place for a request just arrived (its body not read yet) from client key ``key``, or a 429 at once."""
        if self._counted(key) and self.held.get(key, 0) >= self.share:
            raise over_share(self.share, self.limit)
        if self.inflight >= self.limit:
            raise overloaded(f"{self.limit} sequences in flight")
        self._take(1, key)
        return Slot(self, key)

    def widen(self, slot: Slot, weight: int, what: str = "", param: str = "prompt") -> None:
        """Hold ``weight`` places for ``slot`` (a request that puts ``weight`` sequences on the engines; ``what`` says
        how, ``param`` is the field to blame): a 429 when the others do not fit now, a 400 when they never could (past
        the limit, or past the key's share)."""
        extra = weight - slot.weight
        if extra <= 0 or slot.released:
            return
        how = f" ({what})" if what else ""
        if weight > self.limit:
            raise ApiError(400, f"this request puts {weight} sequences{how} on the engines, more than this gateway's "
                           f"limit of {self.limit} in flight; send at most {self.limit} prompts per request, fewer with "
                           "n above 1", param=param, code="invalid_value")
        if self._counted(slot.key):
            if weight > self.share:
                raise ApiError(400, f"this request puts {weight} sequences{how} on the engines, more than one API key "
                               f"may hold in flight here ({self.share}); send at most {self.share} prompts per "
                               "request, fewer with n above 1", param=param, code="invalid_value")
            if self.held.get(slot.key, 0) + extra > self.share:
                raise over_share(self.share, self.limit)
        if self.inflight + extra > self.limit:
            raise overloaded(f"{self.limit} sequences in flight (this request's {weight} count one each)")
        slot.weight = weight
        self._take(extra, slot.key)

    def _counted(self, key: int | None) -> bool:
        return key is not None and self.share is not None

    def _take(self, places: int, key: int | None = None) -> None:
        self.inflight += places
        self.peak = max(self.peak, self.inflight)
        if self._counted(key):
            self.held[key] = self.held.get(key, 0) + places
        self._changed()

    def leave(self, places: int = 1, key: int | None = None) -> None:
        self.inflight -= places
        if self._counted(key):
            left = self.held.get(key, 0) - places
            if left > 0:
                self.held[key] = left
            else:
                self.held.pop(key, None)
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.inflight)
