"""The input of a remaining-length prediction: the prompt, then the answer so far.

A prompt alone cannot say which of its possible answers the engine will sample; the first tokens of the answer can
("Sure! Here are 10 ways…" against "Yes."). A remaining-length predictor reads the prompt's turns followed by one
assistant turn holding the answer written so far, marked with how many tokens it has, and predicts the bucket
distribution of the tokens still to come. Training and serving build that turn with the one function here, so that
the two never drift apart.

The encoder keeps the latest turn first (:mod:`predictor.prompt`), so the answer so far is cut here to its head and
tail (the plan an answer announces, and where it stands now), leaving the rest of the input budget to the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

META_KEY = "remaining_length"
"""meta.json's mark of a package trained on answers so far: it predicts the tokens still to come of an answer after
``generated`` tokens (with none, the whole length), and the sidecar takes ``answer_so_far`` for it only."""
ANSWER_HEAD_CHARS = 200
ANSWER_TAIL_CHARS = 200
"""What of the answer so far the predictor reads: its first and last characters (about 50 tokens each)."""


def answer_so_far(text: str, generated: int) -> str:
    """The answer's text after ``generated`` tokens as the predictor reads it: the count, then head and tail."""
    if len(text) > ANSWER_HEAD_CHARS + ANSWER_TAIL_CHARS:
        text = text[:ANSWER_HEAD_CHARS] + " ... " + text[-ANSWER_TAIL_CHARS:]
    return f"[{generated} tokens written] {text}"


def with_answer(turns: Sequence[tuple[str, str]], text: str, generated: int) -> list[tuple[str, str]]:
    """A prompt's turns followed by the answer so far (none when ``generated`` is 0: the prompt-only question)."""
    if generated <= 0:
        return list(turns)
    return [*turns, ("assistant", answer_so_far(text, generated))]
