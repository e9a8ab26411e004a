"""The unit of training data: a prompt (as turns), its response length label, and a group id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["system", "user", "assistant"]


class DataError(ValueError):
    """Input data that cannot be used: missing file, wrong format, no usable examples."""


@dataclass(frozen=True)
class Turn:
    role: Role
    text: str


@dataclass
class Example:
    """One (prompt, response) pair.

    ``group`` is the conversation id: all turns of one conversation share it, and the train/val/test
    split is made on it so no conversation leaks across splits. ``response_tokens`` is filled by
    :func:`training.data.labels.attach_labels` from ``response`` unless the source gave counts directly.
    ``censored`` marks an answer that was cut (it ran to a ``max_tokens`` cap, or was aborted): its true length is
    at least ``response_tokens``, a lower bound that training and evaluation must not take as the length.
    """

    group: str
    turns: tuple[Turn, ...]
    response: str | None = None
    response_tokens: int | None = None
    censored: bool = False
    model: str | None = None  # the served model that answered, where the data holds several (a ``model`` column)

    @property
    def latest(self) -> str:
        return self.turns[-1].text

    @property
    def first_turn(self) -> bool:
        """True for a conversation's opening request (no user turn before the latest one): the scheduler sees these
        without any earlier answer to go by, so every evaluation reports them apart from later turns."""
        return sum(t.role == "user" for t in self.turns) <= 1
