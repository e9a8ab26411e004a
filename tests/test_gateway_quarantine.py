"""Requests that crash engines (serving/gateway/quarantine.py) and what the engines' vLLM is known to fail on
(serving/gateway/engine_defects.py): the rules, without engines. The real engine deaths, restarts and refusals are in
tests/test_engine_crashes.py."""

from __future__ import annotations

import asyncio

import pytest

from serving.gateway.engine_defects import prompt_logprobs_field
from serving.gateway.errors import ApiError
from serving.gateway.quarantine import KIND_AFTER, CrashQuarantine, Probation, fingerprint

pytestmark = pytest.mark.unit


def test_a_requests_identity_ignores_what_changes_between_sends_and_its_kind_the_values_of_its_options():
    a = fingerprint("completion", "m", {"model": "m", "prompt": "hi", "prompt_logprobs": 1, "stream": True, "seed": 3})
    b = fingerprint("completion", "m", {"model": "m", "prompt": "hi", "prompt_logprobs": 1, "user": "x"})
    c = fingerprint("completion", "m", {"model": "m", "prompt": "other text", "prompt_logprobs": 5})
    assert a.identity == b.identity != c.identity
    assert a.kind == c.kind is not None and "prompt_logprobs" in a.says
    plain = fingerprint("completion", "m", {"model": "m", "prompt": "hi", "max_tokens": 9, "echo": False, "n": 1})
    assert plain.kind is None, "an everyday request (false, null and n=1 options are not options) has no kind"
    assert fingerprint("chat", "m", {"model": "m", "messages": [], "logprobs": True}).kind != fingerprint(
        "completion", "m", {"model": "m", "prompt": "", "logprobs": 1}).kind


def test_a_request_is_refused_only_when_its_engine_dies_while_it_is_on_probation():
    q = CrashQuarantine(hold_s=60)
    culprit = fingerprint("completion", "m", {"model": "m", "prompt": "x", "prompt_logprobs": 1})
    bystander = fingerprint("completion", "m", {"model": "m", "prompt": "y"})
    for fp in (culprit, bystander):  # both on the engine at its first death: sent again as usual
        assert not q.charge(fp, ("engine-0", 1), on_probation=False, now=0)
        assert not q.charge(fp, ("engine-0", 1), on_probation=False, now=0.5), "one death is charged once"
        assert not q.suspect(fp, now=1) and q.refuses(fp, now=1) is None
    for fp in (culprit, bystander):  # sent again together: both on its second death too
        assert not q.charge(fp, ("engine-1", 1), on_probation=False, now=2)
        assert q.suspect(fp, now=2), "two deaths: sent again only alone among suspects"
    q.check(bystander, now=3)  # on probation, not refused: it is answered
    assert q.charge(culprit, ("engine-0", 2), on_probation=True, now=3), "its engine died while it ran on probation"
    with pytest.raises(ApiError) as refused:
        q.check(culprit, now=4)
    assert refused.value.status == 400 and refused.value.code == "request_quarantined"
    assert "refused for 59 s more: this request was on engines when they died 3 times" in refused.value.message
    assert refused.value.headers["Retry-After"] == "59"
    assert q.refuses(bystander, now=4) is None, "the bystander of the first deaths is not refused"
    assert q.refuses(culprit, now=63) is None and not q.suspect(culprit, now=63), "for a while: hold_s"


def test_a_kind_is_refused_once_two_different_requests_of_it_were_refused():
    q = CrashQuarantine(hold_s=600)
    kinds = [fingerprint("completion", "m", {"model": "m", "prompt": f"text {i}", "echo": True, "logprobs": 2})
             for i in range(KIND_AFTER + 1)]
    for fp in kinds[:KIND_AFTER]:
        q.charge(fp, ("engine-0", 1), on_probation=True, now=0)
    with pytest.raises(ApiError, match="completion requests for 'm' with echo, logprobs took down engines"):
        q.check(kinds[KIND_AFTER], now=1)  # a third text, never seen: refused by its kind
    everyday = [fingerprint("completion", "m", {"model": "m", "prompt": f"p{i}"}) for i in range(3)]
    for fp in everyday[:2]:
        q.charge(fp, ("engine-0", 1), on_probation=True, now=0)
    q.check(everyday[2], now=1)  # an everyday request is refused one by one, never by kind


def test_no_quarantine_with_hold_zero():
    q = CrashQuarantine(hold_s=0)
    fp = fingerprint("completion", "m", {"model": "m", "prompt": "x", "logprobs": 1})
    assert not q.charge(fp, "a death", on_probation=True) and not q.suspect(fp) and q.refuses(fp) is None


def test_probation_lets_one_suspect_in_at_a_time():
    async def run() -> list[str]:
        probation, order = Probation(), []

        async def suspect(name: str, hold: float) -> None:
            turn = await probation.enter()
            order.append(f"{name} in")
            await asyncio.sleep(hold)
            order.append(f"{name} out")
            turn.leave()
            turn.leave()  # idempotent

        await asyncio.gather(suspect("a", 0.05), suspect("b", 0.0))
        return order

    assert asyncio.run(run()) == ["a in", "a out", "b in", "b out"]


@pytest.mark.parametrize(("kind", "body", "field"), [
    ("completion", {"prompt_logprobs": 0}, "prompt_logprobs"),
    ("completion", {"echo": True, "logprobs": 0}, "echo"),
    ("completion", {"echo": True}, None),
    ("completion", {"logprobs": 5}, None),
    ("chat", {"echo": True, "logprobs": True, "top_logprobs": 2}, "echo"),
    ("chat", {"echo": True}, "echo"),  # top_logprobs is 0 unless set
    ("chat", {"echo": True, "top_logprobs": None}, "echo"),
    ("chat", {"prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_prompt_logprobs_are_asked_for_as_vllms_to_sampling_params_reads_it(kind, body, field):
    assert prompt_logprobs_field(kind, body) == field


def test_the_rule_matches_vllms_own_sampling_params():
    """The gateway's rule against vLLM's request models themselves: the prompt logprobs their SamplingParams ask for."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    cases = [("completion", {"prompt_logprobs": 0}), ("completion", {"echo": True, "logprobs": 0}),
             ("completion", {"echo": True}), ("completion", {"logprobs": 3}),
             ("chat", {"echo": True, "logprobs": True, "top_logprobs": 2}), ("chat", {"echo": True, "logprobs": True}),
             ("chat", {"echo": True}), ("chat", {"echo": True, "top_logprobs": None}), ("chat", {"echo": False}),
             ("chat", {"prompt_logprobs": 1}), ("chat", {"logprobs": True, "top_logprobs": 1})]
    for kind, extra in cases:
        if kind == "completion":
            params = CompletionRequest(model="m", prompt="hi", max_tokens=4, **extra).to_sampling_params(
                max_tokens=4, default_sampling_params={})
        else:
            params = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **extra).to_sampling_params(max_tokens=4, default_sampling_params={})
        assert (params.prompt_logprobs is not None) == (prompt_logprobs_field(kind, extra) is not None), (kind, extra)


@pytest.mark.parametrize(("body", "refused"), [
    ({"allowed_token_ids": [0], "response_format": {"type": "json_object"}}, True),
    ({"allowed_token_ids": [0, 5], "structured_outputs": {"choice": ["yes", "no"]}}, True),
    ({"allowed_token_ids": [0], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
     True),
    ({"allowed_token_ids": [0], "response_format": {"type": "text"}}, False),
    ({"allowed_token_ids": [], "structured_outputs": {"regex": "a"}}, False),
    ({"structured_outputs": {"regex": "a"}}, False),
])
def test_allowed_tokens_beside_a_grammar_are_refused(body, refused):
    from serving.gateway.engine_defects import refuse_masked_grammar

    if refused:
        with pytest.raises(ApiError, match="allowed_token_ids cannot be combined with"):
            refuse_masked_grammar(body)
    else:
        refuse_masked_grammar(body)
