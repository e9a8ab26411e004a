"""Validate an OpenAI completions or chat request before it costs a prediction or an engine slot.

Why check here and not leave it all to vLLM: the gateway reads some fields itself (``model`` to route,
the prompt to predict, ``max_tokens`` to clamp the prediction, ``stream``/``stream_options``/``n`` to
handle the answer), so those must be well-formed here; everything else (temperature, stop, logprobs, ...)
is validated by the engine, whose 4xx answer is passed through unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from serving.gateway import schema
from serving.gateway.chat_text import Chat
from serving.gateway.errors import ApiError
from serving.gateway.redact import quote

Kind = Literal["completion", "chat"]
PATHS: dict[Kind, str] = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class ClientRequest:
    """A validated request: the body to forward and what the gateway needs to know about it."""

    kind: Kind
    body: dict[str, Any]
    model: str
    stream: bool
    wants_usage: bool  # the client asked for the usage chunk of a stream
    max_tokens: int | None
    outputs: int  # sequences the engine generates: n x prompts
    predict_input: dict[str, Any] | None = field(default=None)  # sidecar body; None: nothing to predict from
    no_predict_reason: str | None = None
    prompts: int = 1  # prompts in the body (a completions prompt list holds several): each takes a place in flight
    chat: Chat | None = None  # a chat request's conversation as the engine's template gets it (serving.gateway.chat_text)

    @property
    def path(self) -> str:
        return PATHS[self.kind]

    @property
    def width(self) -> int:
        """Sequences on the engine per prompt: ``n`` (a beam search's width), or ``best_of`` where larger."""
        return max(_plain_int(self.body.get("n")) or 1, _plain_int(self.body.get("best_of")) or 1)

    @property
    def sequences(self) -> int:
        """The sequences this request puts on the engines at once, each a place in flight (serving/gateway/admission.py)."""
        return self.width * self.prompts

    def sequences_told(self) -> tuple[str, str]:
        """How :attr:`sequences` come about, for an error message, and the field to blame."""
        width = self.width
        by = "n" if width == (_plain_int(self.body.get("n")) or 1) else "best_of"
        told = [f"{self.prompts} prompts"] if self.prompts > 1 else []
        if width > 1:
            told.append(f"{by}={width}" + (" beams" if self.body.get("use_beam_search") is True else ""))
        return " x ".join(told), by if width > 1 else "prompt"


def _plain_int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


MAX_DEPTH = 64  # JSON nesting an OpenAI body needs (a JSON schema in response_format or tools included) is far less
MAX_INT_DIGITS = 20  # enough for any 64-bit integer, signed or not (a seed, a token id); no request field needs more


def _no_constant(name: str) -> float:
    raise ApiError(400, f"the request body holds {name}, which is not a JSON number; send a finite number",
                   code="invalid_json")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ApiError(400, f"the number {text[:40]} is too large to be a finite number; send a finite number",
                       code="invalid_json")
    return v


def _bounded_int(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_INT_DIGITS:
        raise ApiError(400, f"an integer of {len(text)} digits is larger than any request field takes (at most "
                       f"{MAX_INT_DIGITS} digits)", code="invalid_json")
    return int(text)


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it.

    Besides malformed JSON, bodies that parse in Python but that no engine call may carry are refused here:

    - ``NaN``, ``Infinity`` and numbers past a float's range (``1e999``): Python's parser takes them, but JSON has no
      such numbers, so encoding the body for the engine or the sidecar fails (a streamed request then waited forever
      for an engine call that never began, holding its place in flight);
    - integers of more than :data:`MAX_INT_DIGITS` digits (at 4,300 Python refuses to turn one into text at all);
    - nesting deeper than :data:`MAX_DEPTH` (at about a thousand levels the parser itself, and every later encoder,
      hits Python's recursion limit) and a lone UTF-16 surrogate (``"\\ud800"``), which JSON's escapes allow but no
      UTF-8 text can hold.
    """
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite, parse_int=_bounded_int)
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8 JSON", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})", code="invalid_json") from None
    except RecursionError:
        raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict[str, Any]) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH` and strings that are not valid Unicode (iteratively: no recursion)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the request body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")
        if isinstance(node, dict):
            for k, v in node.items():
                _check_text(k)
                stack.append((v, depth + 1))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
        elif isinstance(node, str):
            _check_text(node)


def _check_text(s: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "the request body holds a lone UTF-16 surrogate (an escape like \\ud800 without its pair), "
                       "which is not text", code="invalid_json") from None


def _int_field(body: dict, name: str, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{name}' must be an integer, got {json.dumps(v)[:40]}", param=name, code="invalid_type")
    if v < minimum:
        raise ApiError(400, f"'{name}' must be at least {minimum}, got {v}", param=name, code="invalid_value")
    return v


def _bool_field(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ApiError(400, f"'{name}' must be true or false, got {json.dumps(v)[:40]}", param=name, code="invalid_type")
    return v


def _check_messages(body: dict[str, Any], max_messages: int) -> tuple[dict[str, Any] | None, Chat]:
    """Validate chat messages; return the sidecar's ``{"messages": ...}`` body (None if no text) and the conversation.

    The text is every part the engine renders as text (:mod:`serving.gateway.chat_text`); a part the gateway cannot read
    (media, an unknown type) is a 400 that names it. A client's ``kv_transfer_params.prompt_token_ids`` is refused: vLLM
    runs those ids in place of the messages (its decode-side reuse of a prefill's tokens), so the messages would not be
    the prompt.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} objects", param="messages",
                       code="invalid_type" if messages is not None else "missing_required_parameter")
    if len(messages) > max_messages:
        raise ApiError(400, f"'messages' holds {len(messages)} messages; at most {max_messages} are taken here",
                       param="messages", code="invalid_value")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object, got {type(m).__name__}", param=f"messages[{i}]",
                           code="invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}].role must be a non-empty string", param=f"messages[{i}].role",
                           code="invalid_type")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of content parts",
                           param=f"messages[{i}].content", code="invalid_type")
    kv = body.get("kv_transfer_params")
    if isinstance(kv, dict) and kv.get("prompt_token_ids") is not None:
        raise ApiError(400, "kv_transfer_params.prompt_token_ids would replace the messages as the prompt; send the "
                       "messages alone", param="kv_transfer_params.prompt_token_ids", code="invalid_value")
    chat = Chat.of(body)
    turns = [{"role": role[:64], "content": text} for role, text in chat.turns_text() if text.strip()]
    return ({"messages": turns[-256:]} if turns else None), chat


def _check_prompt(prompt: Any) -> tuple[dict[str, Any] | None, int, str | None]:
    """Validate a completions prompt; return (sidecar body or None, number of prompts, why no prediction)."""
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        return ({"prompt": prompt} if prompt.strip() else None), 1, (None if prompt.strip() else "no_text")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            texts = [p for p in prompt if p.strip()]
            if not texts:
                return None, len(prompt), "no_text"
            return ({"prompt": texts[0]} if len(texts) == 1 else {"prompts": texts[:64]}), len(prompt), None
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, 1, "token_ids"
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            return None, len(prompt), "token_ids"
    raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
                   param="prompt", code="invalid_type")


MAX_MESSAGES = 2048  # OpenAI's own limit on a conversation's messages


def validate(kind: Kind, body: dict[str, Any], models: set[str], max_n: int | None = None,
             max_messages: int = MAX_MESSAGES) -> ClientRequest:
    """Check the fields the gateway uses, then every field's type against vLLM's schema (:mod:`serving.gateway.schema`);
    ``models`` are the names the engines serve (empty: not known yet); ``n`` above ``max_n`` is refused (each sequence
    costs an engine slot and its KV: one request must not take a batch), and so is a conversation of more than
    ``max_messages`` messages (each costs the chat template and the tokenizer work before any engine is involved)."""
    model = body.get("model")
    if model is None:
        raise ApiError(400, "'model' is required", param="model", code="missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "'model' must be a non-empty string", param="model", code="invalid_type")
    if models and model not in models:
        raise ApiError(404, f"the model '{quote(model)}' does not exist; served: {', '.join(sorted(models))}", param="model",
                       code="model_not_found")
    stream = _bool_field(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options", code="invalid_type")
    wants_usage = bool(opts and opts.get("include_usage") is True)
    if kind == "chat":
        max_tokens = _int_field(body, "max_completion_tokens", 1)
        legacy = _int_field(body, "max_tokens", 1)
        max_tokens = max_tokens if max_tokens is not None else legacy
        (predict_input, chat), prompts = _check_messages(body, max_messages), 1
        reason = None if predict_input else "no_text"
    else:
        max_tokens = _int_field(body, "max_tokens", 1)
        predict_input, prompts, reason = _check_prompt(body.get("prompt"))
        chat = None
    n = _int_field(body, "n", 1) or 1
    if max_n is not None and n > max_n:
        raise ApiError(400, f"'n' must be at most {max_n} here, got {n}", param="n", code="invalid_value")
    # best_of candidates are generated and the best n returned (OpenAI's legacy completions, vLLM before V1), each an
    # engine sequence: counted as such (ClientRequest.width). vLLM 0.32 ignores the field, so there the count is
    # cautious; an engine that honours it would otherwise run best_of sequences behind n places.
    best_of = _int_field(body, "best_of", 1) or 1
    if max_n is not None and best_of > max_n:
        raise ApiError(400, f"'best_of' must be at most {max_n} here, got {best_of}", param="best_of",
                       code="invalid_value")
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise ApiError(400, "'vllm_xargs' must be an object", param="vllm_xargs", code="invalid_type")
    schema.check(kind, body)
    return ClientRequest(kind, body, model, stream, wants_usage, max_tokens, n * prompts, predict_input, reason, prompts,
                         chat)
