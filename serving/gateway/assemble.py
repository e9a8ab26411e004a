"""A non-streamed answer read from the engine as a stream, put back together as the engine would have sent it whole.

Why: a refinement needs the answer so far (:mod:`serving.gateway.refine`), and an engine says nothing of a
non-streamed request until it is done. So where the gateway refines, it asks the engine for a stream instead and
gives the client the same JSON vLLM gives a non-streamed request.

Only requests whose whole answer is the sum of their stream's parts are read this way (:func:`assembles`): one
sequence (``n`` 1, no ``best_of``), no log probabilities, no echo, no tools, for completions and chat completions.
Anything else is sent as the client sent it, and gets no refinement.
"""

from __future__ import annotations

import json
from typing import Any

from serving.gateway.requests import ClientRequest

# body fields whose whole answer is not the sum of its stream's parts (or that vLLM treats differently streamed)
NOT_ASSEMBLED = ("logprobs", "top_logprobs", "prompt_logprobs", "echo", "tools", "tool_choice", "functions",
                 "function_call", "best_of", "return_tokens_as_token_ids", "return_token_ids")


def assembles(req: ClientRequest) -> bool:
    """Whether ``req``, not streamed, can be read from the engine as a stream and given back whole."""
    body = req.body
    return (not req.stream and req.prompts == 1 and body.get("n") in (None, 1)
            and not any(body.get(k) not in (None, False) for k in NOT_ASSEMBLED))


def as_stream(body: dict[str, Any]) -> dict[str, Any]:
    """The engine's body for a stream of the same answer, with the usage chunk at its end."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


class Assembler:
    """Collects one stream's events into the answer vLLM sends a non-streamed request."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {}
        self.parts: list[str] = []
        self.reasoning: list[str] = []
        self.role = "assistant"
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict[str, Any] | None = None
        self.stamps: dict[str, Any] = {}  # what vLLM stamps on the stream's last chunk (system_fingerprint, metrics)

    def add(self, data: str) -> None:
        """One event's data (``[DONE]`` and what is not JSON are ignored)."""
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if not self.head:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        self.stamps.update({k: obj[k] for k in ("system_fingerprint", "metrics") if obj.get(k) is not None})
        for c in obj.get("choices") or ():
            if not isinstance(c, dict) or c.get("index", 0) != 0:
                continue
            if self.chat:
                delta = c.get("delta") or {}
                self.role = delta.get("role") or self.role
                if isinstance(delta.get("content"), str):
                    self.parts.append(delta["content"])
                reasoning = delta.get("reasoning", delta.get("reasoning_content"))  # vLLM 0.32's name, then the older
                if isinstance(reasoning, str):
                    self.reasoning.append(reasoning)
            elif isinstance(c.get("text"), str):
                self.parts.append(c["text"])
            if c.get("finish_reason") is not None:
                self.finish_reason = c["finish_reason"]
                self.stop_reason = c.get("stop_reason")

    def answer(self) -> dict[str, Any]:
        """The non-streamed answer, with the fields vLLM 0.32 gives one (those a stream does not carry are null): one
        choice with the text (or message) whole, its finish reason, and the usage."""
        usage = {"prompt_tokens_details": None, "completion_tokens_details": None, **(self.usage or {})}
        ends = {"logprobs": None, "finish_reason": self.finish_reason, "stop_reason": self.stop_reason, "token_ids": None}
        if self.chat:
            message = {"role": self.role, "content": "".join(self.parts), "refusal": None, "annotations": None,
                       "audio": None, "function_call": None, "tool_calls": None,
                       "reasoning": "".join(self.reasoning) if self.reasoning else None}
            choice = {"index": 0, "message": message, **ends, "routed_experts": None}
            extra = {"prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}
        else:
            choice = {"index": 0, "text": "".join(self.parts), **ends, "prompt_logprobs": None, "prompt_token_ids": None,
                      "routed_experts": None}
            extra = {}
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion", "choices": [choice],
                "service_tier": None, "system_fingerprint": self.stamps.get("system_fingerprint"), "usage": usage,
                **extra, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": self.stamps.get("metrics")}


__all__ = ["Assembler", "as_stream", "assembles"]
