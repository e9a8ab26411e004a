"""Prompt length in tokens (Aladdin's l_in), which placement needs for a request's KV and prefill cost.

Why count here and not ask the engine: the count is needed before the engine is chosen, on every request.
With the served model's tokenizer on this machine (``--model`` is a local Hugging Face directory), the
count is exact; it is loaded with ``local_files_only`` from that directory and never from a hub, in a
background thread (the gateway serves meanwhile, estimating). Without one (an attached fleet, a hub name) the length is
estimated as characters / 4, the usual English ratio for BPE vocabularies. Token-id prompts are counted as they are. Which
method ran is counted in ``lengthwise_gateway_prompt_token_counts_total{method}``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from serving.gateway.chat_text import Chat, for_template
from serving.gateway.requests import ClientRequest

log = logging.getLogger("serving.gateway")

CHARS_PER_TOKEN = 4.0
MAX_CHARS_PER_TOKEN = 16.0  # far above any BPE vocabulary's average: an estimate past the context by this much is sure
MAX_TOKENIZE_CHARS = 200_000  # longer prompts are estimated: the tokenizer's work grows with the text
TEMPLATE_CHARS_PER_MESSAGE = 32  # what a chat template adds around each message, about (role markers, separators)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_local_tokenizer(model: str | None) -> Any | None:
    """The tokenizer in the local model directory ``model``, or None (no directory, no tokenizer files, failure).

    With a ``tokenizer.json`` (every fast tokenizer) it is loaded as ``PreTrainedTokenizerFast``, which imports no
    torch: 2 s and 127 MB here against 14 s and 537 MB for ``AutoTokenizer``, which imports torch and scikit-learn
    with the model classes. Other directories (a sentencepiece ``tokenizer.model`` only) go through ``AutoTokenizer``.
    """
    if not has_local_tokenizer(model):
        return None
    path = Path(model).expanduser()
    try:
        if (path / "tokenizer.json").exists():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means: estimate instead
        log.warning("cannot load the tokenizer of %s (%s); prompt lengths are estimated as characters / %g",
                    model, exc, CHARS_PER_TOKEN)
        return None


def estimate(text: str) -> int:
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def has_local_tokenizer(model: str | None) -> bool:
    path = Path(model).expanduser() if model else None
    return bool(path and path.is_dir() and any((path / f).exists() for f in TOKENIZER_FILES))


class PromptCounter:
    """Counts a validated request's prompt tokens, summed over its prompts and multiplied by ``n``."""

    def __init__(self, tokenizer: Any | None = None) -> None:
        self.tokenizer = tokenizer
        self.loading = False
        self._thread: ThreadPoolExecutor | None = None

    async def load(self, model: str | None) -> None:
        """Load ``model``'s local tokenizer off the event loop; until it is there, prompts are estimated."""
        if not has_local_tokenizer(model):
            return
        self.loading = True
        t0 = time.perf_counter()
        try:
            self.tokenizer = await asyncio.to_thread(load_local_tokenizer, model)
        finally:
            self.loading = False
        if self.tokenizer is not None:
            log.info("prompt tokens are counted with the tokenizer of %s (loaded in %.1f s)", model, time.perf_counter() - t0)

    @property
    def method(self) -> str:
        """What /health shows: tokenizer, loading (estimating meanwhile) or estimate."""
        return "tokenizer" if self.tokenizer is not None else "loading" if self.loading else "estimate"

    def _tokens(self, text: str) -> tuple[int, str]:
        if self.tokenizer is None or len(text) > MAX_TOKENIZE_CHARS:
            return estimate(text), "estimate"
        return max(1, len(self.tokenizer(text, add_special_tokens=True)["input_ids"])), "tokenizer"

    def _chat(self, chat: Chat) -> tuple[int, str]:
        """The conversation as the engine renders it (:mod:`serving.gateway.chat_text`: every text part, the reasoning,
        tool calls, the request's tools and documents), counted with the template where there is one."""
        text = chat.text()
        tok = self.tokenizer
        rendered_size = len(text) + TEMPLATE_CHARS_PER_MESSAGE * len(chat.turns)  # the template's text, before rendering it
        if rendered_size > MAX_TOKENIZE_CHARS:
            return estimate(text), "estimate"
        if tok is not None and getattr(tok, "chat_template", None):
            try:
                rendered = tok.apply_chat_template(for_template(chat.turns, tok.chat_template), tools=chat.tools,
                                                   documents=chat.documents, tokenize=False, **chat.template_kwargs)
                return max(1, len(tok(rendered, add_special_tokens=False)["input_ids"])), "tokenizer"
            except Exception as exc:  # noqa: BLE001 - a template that rejects these messages: count the text alone
                log.debug("chat template failed on a request (%s); counting its text alone", exc)
        return self._tokens(text)

    def measure(self, req: ClientRequest) -> tuple[int, int, str]:
        """(prompt tokens of all its prompts, of its longest prompt, method), each prompt counted once whatever ``n``:
        ``tokenizer``, ``estimate`` or ``token_ids``."""
        body = req.body
        if req.kind == "chat":
            tokens, method = self._chat(req.chat if req.chat is not None else Chat.of(body))
            return tokens, tokens, method
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            tokens, method = self._tokens(prompt)
            return tokens, tokens, method
        if prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt), len(prompt), "token_ids"
        if prompt and all(isinstance(p, list) for p in prompt):
            return sum(len(p) for p in prompt), max(len(p) for p in prompt), "token_ids"
        counted = [self._tokens(p) for p in prompt or [""]]
        return sum(c for c, _ in counted), max(c for c, _ in counted), counted[0][1]

    async def measure_off_loop(self, req: ClientRequest) -> tuple[int, int, str]:
        """:meth:`measure` in the tokenizer's own thread when the tokenizer runs (the chat template and the tokenizer
        hold the event loop for as long as they work; one thread, so requests take turns on one tokenizer), else here."""
        if self.tokenizer is None:  # an estimate: a length, no work
            return self.measure(req)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.measure, req)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def count(self, req: ClientRequest) -> tuple[int, str]:
        """(prompt tokens times ``n``, method): the KV a request's sequences hold for their prompts, for placement."""
        tokens, _, method = self.measure(req)
        return tokens * (req.body.get("n") or 1), method


def fits_context(longest: int, method: str, max_tokens: int | None, context: int) -> bool:
    """Whether a prompt of ``longest`` tokens (counted by ``method``) and at least one output token fit ``context``.

    An exact count (``tokenizer``, ``token_ids``) is held to the engine's own rule (prompt + ``max_tokens``, or + 1 when
    unset, at most the context). An estimate (characters / 4) is refused only when even at
    :data:`MAX_CHARS_PER_TOKEN` characters per token it could not fit: an estimate must never refuse a prompt the
    engine would take (the engine still refuses the rest, in its own words).
    """
    if method == "estimate":
        return longest * CHARS_PER_TOKEN / MAX_CHARS_PER_TOKEN + 1 <= context
    return longest + (max_tokens or 1) <= context
