"""Turning a prompt (chat turns) into predictor input ids, truncated to a token budget.

Training and serving share this one function, so a prompt is cut the same way in both. The budget
keeps the latest user turn first (it carries the request whose answer length we predict), then fills
the rest with the most recent earlier turns. A latest turn that alone exceeds the budget keeps its
head and tail halves: instructions sit at either end of long pasted inputs.

With ``length_hints`` each turn is prefixed by its approximate length in words ("user (~450 words): ..."),
so the classifier still sees how long a pasted input or an earlier answer was after truncation has cut
it: in multi-turn chats the previous answer's length is a strong cue for the next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
    length_hints: bool = False

    def to_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "prefix_ids": list(self.prefix_ids),
                "suffix_ids": list(self.suffix_ids), "pad_id": self.pad_id, "length_hints": self.length_hints}

    @classmethod
    def from_dict(cls, d: dict) -> InputFormat:
        return cls(int(d["max_tokens"]), tuple(d["prefix_ids"]), tuple(d["suffix_ids"]), int(d["pad_id"]),
                   bool(d.get("length_hints", False)))

    @property
    def budget(self) -> int:
        return self.max_tokens - len(self.prefix_ids) - len(self.suffix_ids)


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    truncated: bool


def approx_words(text: str) -> int:
    """Word count on a coarse grid: exact below 20, then 10s below 100, 50s below 1000, 500s above."""
    n = len(text.split())
    if n < 20:
        return n
    step = 10 if n < 100 else 50 if n < 1000 else 500
    return int(round(n / step) * step)


def _turn_parts(role: str, text: str, cap_chars: int, hints: bool) -> tuple[str, str]:
    """(label, body): the label survives truncation whole; the body is what gets cut."""
    label = f"{role} (~{approx_words(text)} words):" if hints else f"{role}:"
    if len(text) > cap_chars:
        half = cap_chars // 2
        text = text[:half] + " ... " + text[-half:]
    return label, text


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
        for role, text in conv:
            flat.extend(_turn_parts(role, text, cap, fmt.length_hints))
        spans.append((start, len(flat)))
    enc = tokenizer.encode_batch(flat, add_special_tokens=False) if flat else []
    out: list[Encoded] = []
    for start, end in spans:
        turns = [(enc[i].ids, enc[i + 1].ids) for i in range(start, end, 2)]
        out.append(_fit(turns, budget, fmt))
    return out


def _fit(turns: list[tuple[list[int], list[int]]], budget: int, fmt: InputFormat) -> Encoded:
    """Latest turn first (label + body, body cut to head and tail halves), then older turns, newest
    first, each as label + the tail of its body, until the budget is used."""
    truncated = False
    body: list[int] = []
    if turns:
        label, text = turns[-1]
        room = budget - len(label)
        if len(text) > room:
            head = room // 2
            text = text[:head] + text[len(text) - (room - head):] if room > 0 else []
            truncated = True
        body = (label + text)[:budget]
    for label, text in reversed(turns[:-1]):
        room = budget - len(body) - len(label)
        if room <= 0:
            truncated = True
            break
        if len(text) > room:
            body = label + text[len(text) - room:] + body
            truncated = True
            break
        body = label + text + body
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
