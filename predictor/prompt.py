"""Turning a prompt (chat turns) into predictor input ids, truncated to a token budget.

Training and serving share this one function, so a prompt is cut the same way in both. The budget
keeps the latest user turn first (it carries the request whose answer length we predict), then fills
the rest with the most recent earlier turns. A latest turn that alone exceeds the budget keeps its
head and tail halves: instructions sit at either end of long pasted inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from tokenizers import Tokenizer

# A character cap before tokenising keeps pathological prompts (ShareGPT has 394k-character turns)
# from costing more than the budget can use; ~8 characters per token is generous for English BPE.
_CHARS_PER_TOKEN_CAP = 8


@dataclass(frozen=True)
class InputFormat:
    """What wraps the prompt tokens for a given backbone, recorded in the model artifact."""

    max_tokens: int
    prefix_ids: tuple[int, ...]
    suffix_ids: tuple[int, ...]
    pad_id: int

    def to_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "prefix_ids": list(self.prefix_ids),
                "suffix_ids": list(self.suffix_ids), "pad_id": self.pad_id}

    @classmethod
    def from_dict(cls, d: dict) -> "InputFormat":
        return cls(int(d["max_tokens"]), tuple(d["prefix_ids"]), tuple(d["suffix_ids"]), int(d["pad_id"]))

    @property
    def budget(self) -> int:
        return self.max_tokens - len(self.prefix_ids) - len(self.suffix_ids)


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    truncated: bool


def _turn_text(role: str, text: str, cap_chars: int) -> str:
    if len(text) > cap_chars:
        half = cap_chars // 2
        text = text[:half] + " ... " + text[-half:]
    return f"{role}: {text}"


def encode_turns(
    tokenizer: Tokenizer, fmt: InputFormat, conversations: Sequence[Sequence[tuple[str, str]]]
) -> list[Encoded]:
    """Encode many prompts at once; each prompt is a sequence of ``(role, text)`` ending with the latest turn."""
    budget = fmt.budget
    cap = budget * _CHARS_PER_TOKEN_CAP
    flat: list[str] = []
    spans: list[tuple[int, int]] = []
    for conv in conversations:
        start = len(flat)
        flat.extend(_turn_text(role, text, cap) for role, text in conv)
        spans.append((start, len(flat)))
    enc = tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
    out: list[Encoded] = []
    for start, end in spans:
        turn_ids = [enc[i].ids for i in range(start, end)]
        out.append(_fit(turn_ids, budget, fmt))
    return out


def _fit(turn_ids: list[list[int]], budget: int, fmt: InputFormat) -> Encoded:
    latest = turn_ids[-1] if turn_ids else []
    truncated = False
    if len(latest) > budget:
        head = budget // 2
        latest = latest[:head] + latest[len(latest) - (budget - head):]
        truncated = True
    body = list(latest)
    for ids in reversed(turn_ids[:-1]):
        room = budget - len(body)
        if room <= 0:
            truncated = True
            break
        if len(ids) > room:
            body = ids[len(ids) - room:] + body
            truncated = True
            break
        body = ids + body
    return Encoded(list(fmt.prefix_ids) + body + list(fmt.suffix_ids), truncated)


def messages_to_turns(messages: Iterable[dict]) -> list[tuple[str, str]]:
    """OpenAI-style ``[{"role": ..., "content": ...}]`` to ``(role, text)`` turns."""
    turns = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text parts
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        turns.append((str(m.get("role", "user")), str(content or "")))
    return turns
