"""The gateway's table of content parts (:mod:`serving.gateway.chat_text`) held to vLLM's own chat parsing.

vLLM's parser (``vllm.renderers.chat_utils.parse_chat_messages``) runs here without an engine, over the session's
dummy Llama (GPT-2's tokenizer, a chat template; a text model), after vLLM's request model
(``ChatCompletionRequest``) normalised the messages as its server does. For every part type vLLM knows: the text the
gateway reads equals the text vLLM renders, or the gateway refuses the part and so does vLLM on a text model; and the
prompt tokens the gateway counts with the model's tokenizer equal those of the prompt vLLM renders.
"""

from __future__ import annotations

import copy
import json
from typing import get_args

import pytest

from serving.gateway.chat_text import MEDIA_TYPES, TEXT_KEYS, Chat, content_text
from serving.gateway.errors import ApiError
from serving.gateway.openapi import ContentPart
from serving.gateway.requests import validate
from serving.gateway.tokens import PromptCounter, load_local_tokenizer

vllm = pytest.importorskip("vllm")

ASK = "Explain, step by step and at length, how a compiler turns source code into machine code."
PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5"
       "ErkJggg==")
# one part of each media type as a client would send it (data URLs: nothing is fetched)
MEDIA = {"image_url": {"image_url": {"url": PNG}}, "input_image": {"image_url": PNG, "detail": "auto"},
         "image_pil": {"image_pil": PNG}, "image_embeds": {"image_embeds": "AAAA"},
         "audio_url": {"audio_url": {"url": "data:audio/wav;base64,AAAA"}},
         "input_audio": {"input_audio": {"data": "AAAA", "format": "wav"}}, "audio_embeds": {"audio_embeds": "AAAA"},
         "video_url": {"video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video_embeds": {"video_embeds": "AAAA"},
         "prompt_embeds": {"data": "AAAA"}}
# a template that renders what a tool-aware one does: tools, names, reasoning, tool calls
FULL_TEMPLATE = ("{% if tools %}tools: {{ tools | tojson }}\n{% endif %}{% for m in messages %}{{ m['role'] }}"
                 "{% if m.name %} ({{ m.name }}){% endif %}: {{ m['content'] }}"
                 "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
                 "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
                 "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def model_config(model_dir):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(model_dir), tokenizer=str(model_dir), max_model_len=2048, dtype="float32")


def normalised(body: dict) -> list:
    """The messages as vLLM's server hands them to its parser (its request model validated them)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest.model_validate(copy.deepcopy({"model": "m", **body})).messages


def parsed(model_config, body: dict, content_format: str = "string") -> list[dict]:
    from vllm.renderers.chat_utils import parse_chat_messages

    return parse_chat_messages(normalised(body), model_config, content_format)[0]


def test_the_table_holds_every_part_type_vllm_knows_and_reads_the_key_vllm_reads():
    from vllm.renderers.chat_utils import _MEDIA_CONTENT_PART_KEYS, MM_PARSER_MAP, TEXT_PART_TYPES

    assert set(TEXT_KEYS) | MEDIA_TYPES == set(MM_PARSER_MAP), "a part type vLLM knows is not in the gateway's table"
    assert set(TEXT_KEYS) == TEXT_PART_TYPES | {"tool_reference"} and MEDIA_TYPES == _MEDIA_CONTENT_PART_KEYS
    for kind, key in TEXT_KEYS.items():
        assert MM_PARSER_MAP[kind]({"type": kind, key: "the text"}) == "the text", kind
    assert get_args(ContentPart.model_fields["type"].annotation) == tuple(TEXT_KEYS)  # the published contract says so


def _message(kind: str) -> list:
    key = TEXT_KEYS[kind]
    return [{"type": "text", "text": "Hi"}, {"type": kind, key: ASK}, "a bare string", {"type": kind, key: ""}]


@pytest.mark.parametrize("kind", sorted(TEXT_KEYS))
def test_each_text_part_reads_as_vllm_renders_it(model_config, kind):
    body = {"messages": [{"role": "user", "content": _message(kind)}]}
    (vllm_turn,) = parsed(model_config, body)
    mine = content_text(body["messages"][0]["content"], "messages[0].content")
    assert mine == vllm_turn["content"] and ASK in mine
    # a template that iterates over parts gets the same texts, one part each (an empty one too, which renders nothing)
    (parts,) = parsed(model_config, body, "openai")
    assert "\n".join(t for p in parts["content"] if (t := p.get("text") or p.get("name"))) == mine
    # and the request the sidecar is asked about holds the whole ask
    req = validate("chat", {"model": "m", **body}, set())
    assert req.predict_input == {"messages": [{"role": "user", "content": mine}]}


def test_a_null_text_is_skipped_as_vllm_skips_it(model_config):
    from vllm.renderers.chat_utils import parse_chat_messages

    for kind, key in TEXT_KEYS.items():
        content = [{"type": "text", "text": "a"}, {"type": kind, key: None}, {"type": kind}, {"type": "text", "text": "b"}]
        (turn,) = parse_chat_messages([{"role": "user", "content": content}], model_config, "string")[0]
        assert content_text(content, "c") == turn["content"] == "a\nb", kind


CONVERSATION = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "refusal", "refusal": ASK}], "name": "ann"},
        {"role": "assistant", "content": None, "reasoning_content": "the user wants " + ASK, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "search", "arguments": json.dumps({"q": ASK})}},
            {"id": "2", "type": "function", "function": {"name": "broken", "arguments": "not json"}},
            {"id": "3", "type": "function", "function": {"name": "none", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "1", "content": [{"type": "text", "text": "found"}, {"type": "text", "text": ASK}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": ASK}, {"type": "output_text", "text": "ok"}],
         "reasoning": "because", "tool_calls": []},
        {"role": "developer", "content": "dev", "tools": [{"type": "function", "function": {"name": "z"}}]},
        {"role": "user", "content": [{"type": "input_text", "text": "go on"}, {"type": "tool_reference", "name": "search"}]},
    ],
    "tools": [{"type": "function", "function": {"name": "search", "description": ASK,
                                                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}],
}


def test_every_message_field_reaches_the_template_as_vllm_passes_it(model_config):
    """Reasoning (and the deprecated reasoning_content), tool calls with their arguments parsed, tool_call_id, name,
    a developer's tools: the turns the gateway renders are vLLM's, field for field."""
    assert Chat.of(copy.deepcopy(CONVERSATION)).turns == parsed(model_config, CONVERSATION)
    texts = dict(enumerate(t for _, t in Chat.of(CONVERSATION).turns_text()))
    assert ASK in texts[0] and texts[0].startswith("{")  # the request's tools: a system turn first
    assert "the user wants" in texts[3] and "search" in texts[3] and ASK in texts[3]  # reasoning and the tool call


@pytest.mark.parametrize("template", [None, FULL_TEMPLATE])
@pytest.mark.parametrize("body", [CONVERSATION, *({"messages": [{"role": "user", "content": _message(k)}]}
                                                  for k in sorted(TEXT_KEYS))], ids=lambda b: str(len(b["messages"])))
def test_the_prompt_tokens_counted_are_those_of_the_prompt_vllm_renders(model_dir, model_config, body, template):
    from vllm.renderers.hf import safe_apply_chat_template
    from vllm.tokenizers import get_tokenizer

    engine_tok = get_tokenizer(str(model_dir))
    conversation = parsed(model_config, body)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate(copy.deepcopy({"model": "m", **body}))
    tools = [tool.model_dump() for tool in request.tools] if request.tools else None  # as vLLM's server passes them
    prompt = safe_apply_chat_template(model_config, engine_tok, conversation, tools=tools, chat_template=template,
                                      tokenize=False, add_generation_prompt=True)
    engine_count = len(engine_tok(prompt, add_special_tokens=False)["input_ids"])
    tok = load_local_tokenizer(str(model_dir))
    if template is not None:
        tok.chat_template = template
    req = validate("chat", {"model": "m", **copy.deepcopy(body)}, set())
    assert PromptCounter(tok).measure(req) == (engine_count, engine_count, "tokenizer")
    if template is not None and body is CONVERSATION:
        assert prompt.count(ASK) == 6  # tools, refusal, reasoning, call, tool result, thinking


@pytest.mark.parametrize("kind", sorted(MEDIA_TYPES))
def test_a_media_part_is_refused_by_the_gateway_and_by_vllm_on_a_text_model(model_config, kind):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": kind, **MEDIA[kind]}]}]}
    with pytest.raises(ApiError) as err:
        validate("chat", {"model": "m", **body}, set())
    assert (err.value.status, err.value.code, err.value.param) == (400, "unsupported_content", "messages[0].content[1]")
    assert kind in err.value.message and "text" in err.value.message
    with pytest.raises(Exception):  # noqa: B017 - vLLM refuses it in its own way (not multimodal, undecodable, ...)
        parsed(model_config, body)


@pytest.mark.parametrize("part,words", [
    ({"type": "bogus", "text": "x"}, "not a content part type"), ({"text": "no type"}, "needs a 'type'"),
    ({"type": "text", "text": "x", "uuid": "u1"}, "uuid"), ({"image_url": {"url": PNG}}, "image_url part"),
    ({"type": 5, "text": "x"}, "needs a 'type'"),
])
def test_an_unknown_or_untyped_part_is_refused_by_the_gateway_and_by_vllm(model_config, part, words):
    from vllm.renderers.chat_utils import parse_chat_messages

    content = [{"type": "text", "text": "Hi"}, part]
    with pytest.raises(ApiError) as err:
        validate("chat", {"model": "m", "messages": [{"role": "user", "content": content}]}, set())
    assert err.value.status == 400 and err.value.param == "messages[0].content[1]" and words in err.value.message
    with pytest.raises(Exception):  # noqa: B017
        parse_chat_messages([{"role": "user", "content": content}], model_config, "string")


def test_a_text_value_of_another_type_is_a_400_naming_it():
    with pytest.raises(ApiError) as err:
        validate("chat", {"model": "m", "messages": [{"role": "user", "content": [{"type": "refusal", "refusal": 5}]}]},
                 set())
    assert (err.value.status, err.value.param, err.value.code) == (400, "messages[0].content[0].refusal", "invalid_type")
