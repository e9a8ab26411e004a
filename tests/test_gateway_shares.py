"""Who holds the places in flight (serving/gateway/admission.py): one per sequence a request puts on an engine, and with
client keys at most a share of them per key.

Units, no server: the settings' share, the admission counts, and :meth:`Gateway.serve` with the engine call stood in for
(it holds its answer while the test looks at the places). Through a real gateway: tests/test_gateway_slow_clients.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from pydantic import SecretStr, ValidationError
from starlette.responses import Response

from serving.gateway.admission import Admission, OverShare
from serving.gateway.errors import ApiError
from serving.gateway.gateway import Call
from serving.gateway.settings import GatewaySettings

pytestmark = pytest.mark.unit


def value(metric, *labels: str) -> float:
    return (metric.labels(*labels) if labels else metric)._value.get()


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 100, **fields}).encode()


def test_a_keys_share_is_half_with_several_keys_none_with_one_or_none_and_a_count_or_share_when_set():
    s = GatewaySettings(engine_urls=["http://e:1"])
    assert (s.key_share(16, 0), s.key_share(16, 1), s.key_share(16, 2), s.key_share(16, 5)) == (None, None, 8, 8)
    assert s.key_share(1, 3) == 1 and s.key_share(5, 2) == 3  # never 0; half of an odd bound rounds up
    assert GatewaySettings(engine_urls=["http://e:1"], max_outstanding_per_key=0.25).key_share(16, 2) == 4
    assert GatewaySettings(engine_urls=["http://e:1"], max_outstanding_per_key=3).key_share(16, 1) == 3  # set: even one key
    assert GatewaySettings(engine_urls=["http://e:1"], max_outstanding_per_key=3).key_share(16, 0) is None  # nothing to count by
    assert GatewaySettings(engine_urls=["http://e:1"], max_outstanding_per_key=99).key_share(16, 2) == 16
    with pytest.raises(ValidationError, match="neither a share"):
        GatewaySettings(engine_urls=["http://e:1"], max_outstanding_per_key=2.5)


def test_one_key_at_its_share_is_refused_while_another_is_admitted_and_a_release_frees_the_keys_places():
    gate = Admission(4, share=2)
    a1, a2 = gate.admit(0), gate.admit(0)
    with pytest.raises(OverShare) as err:
        gate.admit(0)
    assert (err.value.status, err.value.code, err.value.headers["Retry-After"]) == (429, "rate_limit_exceeded", "1")
    assert "this API key holds its share" in err.value.message and "2 of 4" in err.value.message
    b = gate.admit(1)  # another key: room in the gateway and in its share
    assert gate.inflight == 3 and gate.held == {0: 2, 1: 1}
    gate.widen(b, 2)  # its request of 2 sequences: its share holds them
    assert gate.inflight == 4 and gate.held == {0: 2, 1: 2}
    a1.release()
    a1.release()  # a second release frees nothing more
    assert gate.inflight == 3 and gate.held == {0: 1, 1: 2}
    a3 = gate.admit(0)
    with pytest.raises(OverShare):  # 2 sequences beside the key's other place: past its share now, not for ever
        gate.widen(a3, 2)
    a2.release(), a3.release(), b.release()
    assert gate.inflight == 0 and gate.held == {}
    for _ in range(4):
        gate.admit(None)  # a request without a key (no share per key) is bounded by the whole only
    with pytest.raises(ApiError) as err:
        gate.admit(None)
    assert err.value.status == 429 and not isinstance(err.value, OverShare) and "4 sequences in flight" in err.value.message


def test_a_request_wider_than_its_keys_share_or_the_bound_is_a_400_that_says_why():
    gate = Admission(8, share=4)
    with pytest.raises(ApiError) as err:
        gate.widen(gate.admit(0), 5, "n=5", "n")
    assert (err.value.status, err.value.param) == (400, "n") and "one API key may hold in flight here (4)" in err.value.message
    with pytest.raises(ApiError) as err:
        gate.widen(gate.admit(0), 9, "3 prompts x n=3", "n")
    assert err.value.status == 400 and "limit of 8 in flight" in err.value.message and "3 prompts x n=3" in err.value.message


class HeldEngine:
    """Stands in for ``Forwarder.forward``: the answer waits on ``held`` while the test looks at the places."""

    async def forward(self, req, body, headers, job, on_done, *more) -> Response:
        from serving.gateway.forward import Outcome

        on_done(Outcome(200, "engine-0", 1, "stop"))
        return Response(b'{"choices": []}', status_code=200)


def _served_holding(gw, raw: bytes, headers: dict) -> int:
    """Serve ``raw`` and return the places it held while its answer was awaited."""
    held = []

    async def wait(answer):
        held.append(gw.admission.inflight)
        return await answer

    asyncio.run(gw.serve(Call("completion"), raw, headers, wait))
    return held[0]


@pytest.mark.parametrize("fields,places", [
    ({}, 1), ({"n": 4}, 4), ({"n": 3, "use_beam_search": True}, 3), ({"best_of": 3}, 3), ({"n": 2, "best_of": 1}, 2),
    ({"prompt": ["a", "b"], "n": 2}, 4),
])
def test_a_request_holds_a_place_per_sequence_it_puts_on_an_engine(make_gateway, fields, places):
    gw = make_gateway(max_outstanding=8)
    gw.forwarder.forward = HeldEngine().forward
    assert _served_holding(gw, body(**fields), {}) == places
    assert gw.admission.inflight == 0


def test_sequences_past_the_bound_are_a_400_and_past_the_free_places_a_429(make_gateway):
    gw = make_gateway(max_outstanding=4, max_n=8)
    gw.forwarder.forward = HeldEngine().forward
    with pytest.raises(ApiError) as err:
        asyncio.run(gw.serve(Call("completion"), body(n=5, use_beam_search=True), {}, None))
    assert (err.value.status, err.value.param) == (400, "n") and "5 sequences (n=5 beams)" in err.value.message
    assert value(gw.metrics.rejected, "too_many_sequences") == 1 and gw.admission.inflight == 0
    with pytest.raises(ApiError) as err:
        gw.validate("completion", body(best_of=9))
    assert (err.value.status, err.value.param) == (400, "best_of") and value(gw.metrics.rejected, "too_many_n") == 1
    gw.admission.admit()
    with pytest.raises(ApiError) as err:  # 1 in flight, 4 asked for: not now
        asyncio.run(gw.serve(Call("completion"), body(n=4), {}, None))
    assert err.value.status == 429 and value(gw.metrics.rejected, "overload") == 1 and gw.admission.inflight == 1


def test_with_two_keys_one_key_cannot_take_the_other_keys_room(make_gateway):
    gw = make_gateway(max_outstanding=4, api_keys=[SecretStr("key-a"), SecretStr("key-b")])
    gw.forwarder.forward = HeldEngine().forward
    a, b = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
    assert gw.admission.share == 2
    gw.admit(0)  # key-a holds a place already
    with pytest.raises(ApiError) as err:  # its n=2 would pass its share of 2
        asyncio.run(gw.serve(Call("completion"), body(n=2), a, None))
    assert err.value.status == 429 and "this API key holds its share" in err.value.message
    assert value(gw.metrics.rejected, "key_share") == 1
    assert _served_holding(gw, body(n=2), b) == 3  # key-b is served: its own 2 beside key-a's 1
    assert gw.admission.inflight == 1 and gw.admission.held == {0: 1}
