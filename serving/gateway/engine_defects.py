"""Requests the installed vLLM is known to fail on, refused before an engine sees them.

Why the gateway and not only the plug-in: the engines behind a gateway may run vLLM's own scheduler (attached with
``--engine-url``), and one such request takes the whole engine down with every request on it.

- **Prompt logprobs on an engine that serves LoRA adapters.** vLLM 0.32 computes a prompt's logprobs through the LoRA
  logits layer with the step's LoRA mapping, which has one row per request, not one per prompt position: when the
  step carries another request the engine core fails (on the CPU build ``einsum(): subscript b has size 2 ... 5`` in
  ``bgmv_shrink``) and the engine dies; with as many requests as positions, it runs with the wrong adapter rows. Stock
  vLLM fails the same way (vllm-project/vllm#16668, open; #29955). vLLM asks for them when ``prompt_logprobs`` is set,
  or when ``echo`` is, with ``logprobs`` (completions) or ``top_logprobs`` (chat, where it is 0 unless set: ``echo``
  alone asks for them). The lengthwise plug-in runs such a
  step alone (:mod:`serving.engine.scheduler`), so ``--allow-prompt-logprobs-with-lora`` lets them through to engines
  that run it.
- **``allowed_token_ids`` with structured outputs.** The engine masks every token but the allowed ones, the grammar
  masks every token it does not accept; when the two leave nothing, a token the grammar rejects is sampled, vLLM 0.32
  logs "Failed to advance FSM ... Please file an issue", ends the request and answers 500 (the engine lives). Found by
  the gateway's property test over every option (tests/test_engine_crashes.py). Refused with a 400 whatever the
  engines, since the gateway cannot tell which allowed tokens a grammar accepts.
"""

from __future__ import annotations

from typing import Any

from serving.gateway.errors import ApiError


def prompt_logprobs_field(kind: str, body: dict[str, Any]) -> str | None:
    """The field through which ``body`` asks vLLM for prompt logprobs, as vLLM's ``to_sampling_params`` reads it; None
    when it does not."""
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    # chat's top_logprobs is 0 unless set (and null reads as 0): there echo alone asks for them
    if body.get("echo") is True and (kind == "chat" or body.get("logprobs") is not None):
        return "echo"
    return None


def structured(body: dict[str, Any]) -> str | None:
    """The field that asks for structured outputs (a grammar the engine enforces), if any."""
    if body.get("structured_outputs") not in (None, {}):
        return "structured_outputs"
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        return "response_format"
    choice = body.get("tool_choice")
    if body.get("tools") and (choice == "required" or isinstance(choice, dict)):
        return "tool_choice"
    return None


def refuse_masked_grammar(body: dict[str, Any]) -> None:
    """A 400 for ``allowed_token_ids`` beside structured outputs (the module docstring says why)."""
    if body.get("allowed_token_ids") and (grammar := structured(body)) is not None:
        raise ApiError(400, f"allowed_token_ids cannot be combined with {grammar} here: vLLM 0.32 fails the request "
                       "when the grammar accepts none of the allowed tokens; send one or the other",
                       param="allowed_token_ids", code="unsupported_parameter")


def refuse_prompt_logprobs(field: str, model: str) -> ApiError:
    asked = "prompt_logprobs" if field == "prompt_logprobs" else "echo with logprobs (which asks for prompt logprobs)"
    return ApiError(400, f"{asked} is not served for '{model[:64]}': its engines serve LoRA adapters, and vLLM 0.32's "
                    "engine fails on prompt logprobs there when another request shares the step "
                    "(vllm-project/vllm#16668); send the request without it, or ask the operator (the lengthwise "
                    "plug-in handles it: --allow-prompt-logprobs-with-lora)", param=field, code="unsupported_parameter")
