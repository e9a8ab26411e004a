"""How much work the gateway accepts: a bound on requests in flight, past which a request gets 429 at once.

Why bound it here: without a bound, a burst past the engines' capacity queues without limit, in the gateway's
connections and inside the engines; every request then waits longer, the deadlines the scheduler orders by pass for all
of them, and clients time out after the work was spent. A 429 with ``Retry-After`` costs the client one round trip and
tells a load balancer to send the request elsewhere.

Two bounds (:meth:`~serving.gateway.settings.GatewaySettings.outstanding_bounds`): requests in flight in the whole
gateway, checked on arrival before anything else is spent on the request (no prediction, no engine), and requests on one
engine, which placement respects (an engine at its bound is not chosen; when every engine is, the request gets the same
429). A request leaves when its answer is complete, failed, or its client left.
"""

from __future__ import annotations

from serving.gateway.errors import ApiError

RETRY_AFTER_S = 1


def overloaded(what: str) -> ApiError:
    """The 429 for a request past a bound (OpenAI's shape and code for a rate limit)."""
    return ApiError(429, f"the gateway is at its limit of {what}; retry later", type="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})


class Slot:
    """One admitted request's place (``weight`` places: one per prompt); :meth:`release` is idempotent, so every way a
    request ends may call it."""

    __slots__ = ("_gate", "released", "weight")

    def __init__(self, gate: Admission) -> None:
        self._gate, self.released, self.weight = gate, False, 1

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._gate.leave(self.weight)


class Admission:
    """Counts requests in flight; :meth:`admit` refuses one past ``limit``. ``peak`` is the most ever in flight at once:
    the bound as the gateway kept it, where a client's view also counts answers still on their way to it."""

    def __init__(self, limit: int, on_change=None) -> None:
        self.limit, self.inflight, self.peak, self._on_change = limit, 0, 0, on_change

    def admit(self) -> Slot:
        if self.inflight >= self.limit:
            raise overloaded(f"{self.limit} requests in flight")
        self._take(1)
        return Slot(self)

    def widen(self, slot: Slot, weight: int) -> None:
        """Hold ``weight`` places for ``slot`` (a request of ``weight`` prompts, each of which is an engine request): a 429
        when the others do not fit now, a 400 when they never could."""
        extra = weight - slot.weight
        if extra <= 0 or slot.released:
            return
        if weight > self.limit:
            raise ApiError(400, f"a request of {weight} prompts is more than this gateway's limit of {self.limit} "
                           f"requests in flight; send at most {self.limit} prompts per request", param="prompt",
                           code="invalid_value")
        if self.inflight + extra > self.limit:
            raise overloaded(f"{self.limit} requests in flight (this request's {weight} prompts count one each)")
        slot.weight = weight
        self._take(extra)

    def _take(self, places: int) -> None:
        self.inflight += places
        self.peak = max(self.peak, self.inflight)
        self._changed()

    def leave(self, places: int = 1) -> None:
        self.inflight -= places
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.inflight)
