"""Deterministic train/validation/test split by conversation id.

A hash of (seed, conversation id) decides the split, so the same conversation always lands in the same
split across runs and machines, and no turn of a test conversation is ever seen in training.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from training.data.example import Example


@dataclass(frozen=True)
class Splits:
    train: list[Example]
    val: list[Example]
    test: list[Example]

    def fingerprint(self) -> str:
        """Identifies the test split (ids and labels), so evaluations are compared only on equal sets."""
        h = hashlib.sha256()
        for e in self.test:
            h.update(f"{e.group}|{e.response_tokens}|{len(e.turns)}\n".encode())
        return h.hexdigest()[:16]


def _unit(seed: int, group: str) -> float:
    digest = hashlib.sha256(f"{seed}:{group}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(group: str, val: float = 0.1, test: float = 0.1, seed: int = 0) -> str:
    """``train``, ``val`` or ``test``: where :func:`split_by_group` puts a conversation, so another tool (relabelling
    more samples of the held-out prompts) can pick the same prompts without the examples at hand."""
    if not (0 < val < 1 and 0 < test < 1 and val + test < 1):
        raise ValueError("val and test fractions must be in (0, 1) and sum below 1")
    u = _unit(seed, group)
    return "test" if u < test else "val" if u < test + val else "train"


def split_by_group(examples: list[Example], val: float = 0.1, test: float = 0.1, seed: int = 0) -> Splits:
    parts: dict[str, list[Example]] = {"train": [], "val": [], "test": []}
    for e in examples:
        parts[split_of(e.group, val, test, seed)].append(e)
    return Splits(parts["train"], parts["val"], parts["test"])


def cap_groups(examples: list[Example], max_samples: int | None, seed: int = 0) -> list[Example]:
    """Keep at most ``max_samples`` examples, choosing whole conversations in a seeded hash order."""
    if max_samples is None or len(examples) <= max_samples:
        return examples
    order = sorted({e.group for e in examples}, key=lambda g: _unit(seed + 7919, g))
    keep: set[str] = set()
    count: dict[str, int] = {}
    for e in examples:
        count[e.group] = count.get(e.group, 0) + 1
    total = 0
    for g in order:
        if total >= max_samples:
            break
        keep.add(g)
        total += count[g]
    return [e for e in examples if e.group in keep][:max_samples]
