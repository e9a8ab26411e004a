"""A chat request as the engine renders it: the text the gateway predicts an answer's length from, and counts.

Why: the gateway predicted from content parts with a ``text`` key only, while vLLM renders more. A request of ``[{"type":
"text", "text": "Hi"}, {"type": "refusal", "refusal": <a long ask>}]`` was predicted at 142 tokens with 31 prompt tokens
counted, where the same ask as plain text is predicted at 361 with 115 (the engine counted 117): its client jumped the
length-ordered queue, and its feedback paired the visible text with the real answer's length. Here every part vLLM
renders as text is read, and every part the gateway cannot read is refused.

Why a table and not vLLM's own parser: the gateway imports no vLLM (it fronts attached engines from machines without
it). The table is vLLM 0.32's (``vllm/renderers/chat_utils.py``: ``MM_PARSER_MAP``, ``TEXT_PART_TYPES``,
``_parse_chat_message_content``), and ``tests/test_gateway_chat_text.py`` holds it to vLLM's own parsing part type by part
type, and to the set of types vLLM knows (a vLLM that adds one fails the test until the table says what to do with it).

A content part (an item of ``messages[i].content`` when it is a list):

================================================  =========================================  ===========================
part                                              what vLLM renders                          here
================================================  =========================================  ===========================
``text``, ``input_text``, ``output_text``         its ``text``                               read
``refusal``                                       its ``refusal``                            read
``thinking``                                      its ``thinking``                           read
``tool_reference``                                its ``name`` (the template expands it)     read
a bare string                                     itself                                     read
``image_url``, ``input_image``, ``image_pil``,    a text model: a 400, after fetching or     400 ``unsupported_content``
``image_embeds``, ``audio_url``, ``input_audio``, decoding the media; a multimodal model: a
``audio_embeds``, ``video_url``, ``video_embeds`` placeholder and the media's own tokens
``prompt_embeds``                                 embeddings spliced in (only with           400 ``unsupported_content``
                                                  ``--enable-prompt-embeds``), else a 400
another type, no type, a ``uuid``                 a 400 (a ``uuid`` marks a media part)      400 ``invalid_value``
================================================  =========================================  ===========================

Media are refused, not estimated: the models lengthwise serves are text models, where vLLM refuses them anyway (after
its engine fetched the client's URL), and on a multimodal model an image's tokens are the processor's to know, not a
count the gateway could make from the request. A text value that is null is skipped, as vLLM skips it; one that is not a
string is a 400. vLLM joins a message's texts with a newline, leaving out empty ones; so does :func:`content_text`.

Besides its content, a message gives the template an assistant's ``reasoning`` (or the deprecated
``reasoning_content``) and ``tool_calls`` (arguments as objects), a tool message's ``tool_call_id``, and any message's
``name`` (and ``task``); the request gives it ``tools`` and ``documents``. :class:`Chat` hands all of these to the chat
template as vLLM does, so a count with the model's tokenizer is the engine's; the text the predictor reads
(:meth:`Chat.turns_text`) holds, besides the contents, the reasoning, the tool calls and the request's tools and
documents (a system turn first), which templates that know them render. vLLM drops a system message's
``x-anthropic-billing-header`` line; the gateway counts it (a bound, a line long).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from serving.gateway.errors import ApiError
from serving.gateway.redact import quote

# content part type -> the key whose string vLLM renders as the part's text
TEXT_KEYS: dict[str, str] = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                             "thinking": "thinking", "tool_reference": "name"}
# content part types that carry media (or embeddings): refused
MEDIA_TYPES = frozenset({"image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio",
                         "audio_embeds", "video_url", "video_embeds", "prompt_embeds"})


def _refuse(at: str, why: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{at} {why}", param=at, code=code)


def part_text(part: Any, at: str) -> str | None:
    """The text vLLM renders for one content part (None: it renders nothing), or a 400 naming ``at`` and why."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise _refuse(at, f"must be a content part object or a string, got {type(part).__name__}", "invalid_type")
    kind = part.get("type")
    if kind is None:  # vLLM reads a part without a type by its media key
        media = next((k for k in sorted(MEDIA_TYPES) if k in part), None)
    else:
        media = kind if isinstance(kind, str) and kind in MEDIA_TYPES else None
    if media is not None:
        raise _refuse(at, f"is a {media} part: this gateway predicts answer lengths from text and serves text models; "
                      f"send text parts ({', '.join(TEXT_KEYS)})", "unsupported_content")
    if part.get("uuid") is not None:
        raise _refuse(at, "has a 'uuid', which marks a media part; text parts have none")
    if not isinstance(kind, str):
        raise _refuse(at, f"needs a 'type' ({', '.join(TEXT_KEYS)})")
    key = TEXT_KEYS.get(kind)
    if key is None:
        raise _refuse(at, f"has the type {quote(kind)!r}, which is not a content part type this gateway reads "
                      f"({', '.join(TEXT_KEYS)})")
    value = part.get(key)
    if value is not None and not isinstance(value, str):
        raise _refuse(f"{at}.{key}", f"must be a string, got {type(value).__name__}", "invalid_type")
    return value


def content_text(content: Any, at: str) -> str:
    """A message's content as vLLM renders it for a template that takes a string: its parts' texts, one a line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(at, "must be a string or a list of content parts", "invalid_type")
    return "\n".join(t for j, part in enumerate(content) if (t := part_text(part, f"{at}[{j}]")))


def _arguments(args: Any) -> Any:
    """A tool call's arguments as vLLM gives them to the template: an object (a string that is not one: ``{}``)."""
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except ValueError:
            return {}
    return args if isinstance(args, dict) else {}


def turn(m: dict[str, Any], i: int) -> dict[str, Any]:
    """Message ``i`` as vLLM hands it to the chat template (``ConversationMessage``, content as a string)."""
    role = m.get("role")
    out: dict[str, Any] = {"role": role, "content": content_text(m.get("content"), f"messages[{i}].content")}
    reasoning = m.get("reasoning")
    if reasoning is None:
        reasoning = m.get("reasoning_content")
    if role == "assistant":
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                                 if isinstance(c, dict) and isinstance(c.get("function"), dict) else c for c in calls]
        if reasoning is not None:
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in m:
        out["tool_call_id"] = m["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(m.get(key), str):
            out[key] = m[key]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def for_template(turns: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """``turns`` as vLLM renders them with ``template``: a template that names no ``developer`` role gets developer
    messages as system ones (without their tools), every system message merged into one first (vLLM's
    ``safe_apply_chat_template``)."""
    template = template if isinstance(template, str) else str(template)  # (a tokenizer may hold several, by name)
    if not any(t["role"] == "developer" for t in turns) or "'developer'" in template or '"developer"' in template:
        return turns
    turns = [{k: v for k, v in t.items() if k != "tools"} | {"role": "system"} if t["role"] == "developer" else t
             for t in turns]
    system = [i for i, t in enumerate(turns) if t["role"] == "system"]
    if system == [0] or not system:
        return turns
    merged = {"role": "system", "content": "\n\n".join(turns[i]["content"] for i in system if turns[i]["content"])}
    return [merged, *(t for t in turns if t["role"] != "system")]


def _text(value: Any) -> str:
    return value if isinstance(value, str) else "" if value is None else json.dumps(value, ensure_ascii=False)


def turn_text(t: dict[str, Any]) -> str:
    """What the predictor reads of a turn: its content, its reasoning and its tool calls (name and arguments)."""
    calls = [c.get("function") for c in t.get("tool_calls") or [] if isinstance(c, dict)]
    texts = [t["content"], _text(t.get("reasoning")),
             *(f"{_text(f.get('name'))} {_text(f.get('arguments'))}".strip() for f in calls if isinstance(f, dict))]
    return "\n".join(x for x in texts if x)


@dataclass
class Chat:
    """A validated conversation as the template gets it: the turns, the request's tools and documents, and the flags."""

    turns: list[dict[str, Any]]
    tools: list | None = None
    documents: list | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # add_generation_prompt, continue_final_message

    @classmethod
    def of(cls, body: dict[str, Any]) -> Chat:
        """The chat request ``body``'s conversation (its ``messages`` already checked to be a list of objects with a
        role); a 400 for a content part the gateway cannot read."""
        turns = [turn(m, i) for i, m in enumerate(body.get("messages") or []) if isinstance(m, dict)]
        tools, documents = body.get("tools"), body.get("documents")
        kwargs = {"add_generation_prompt": body.get("add_generation_prompt") is not False}
        if body.get("continue_final_message") is True:
            kwargs["continue_final_message"] = True
        return cls(turns, tools if isinstance(tools, list) and tools else None,
                   documents if isinstance(documents, list) and documents else None, kwargs)

    def preamble(self) -> str:
        """The request's tools and documents as text (what a template that renders them puts before the turns)."""
        return "\n".join(_text(x) for x in [*(self.tools or []), *(self.documents or [])])

    def turns_text(self) -> list[tuple[str, str]]:
        """(role, text) per turn as the predictor reads them; the request's tools and documents a system turn first."""
        first = [("system", self.preamble())] if self.tools or self.documents else []
        return first + [(str(t["role"]), turn_text(t)) for t in self.turns]

    def text(self) -> str:
        """Everything of the request a template may render, for an estimate: each turn's text and name, the preamble."""
        texts = [self.preamble(), *(x for t in self.turns for x in (t.get("name"), turn_text(t)))]
        return "\n".join(x for x in texts if x)
