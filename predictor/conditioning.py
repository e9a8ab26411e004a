"""One length predictor for several served models: the model's name is part of what it reads.

Several models behind one endpoint answer the same prompt at different lengths (AlpacaEval's 62 models: a terse
fine-tune's mean answer is a fifth of a verbose one's). A predictor *conditioned on the model* is trained on every
model's answers with the answering model's name written before the request, and asked the same way: the name is
words of the prompt, so one encoder learns each model's scale beside what the prompt says (measured against one
encoder per model and against TF-IDF in docs/results/predictor.md). Training and serving build the text with the
same function, here, so that the two never drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

META_KEY = "conditioned_on_model"
"""meta.json's list of the served models a conditioned package was trained on (absent: not conditioned)."""


def conditioned_text(model: str, text: str) -> str:
    """A request's text as a predictor conditioned on the model reads it: the model's name first."""
    return f"[{model}] {text}"


def condition_turns(turns: Sequence[tuple[str, str]], model: str) -> list[tuple[str, str]]:
    """A conversation ``[(role, text), ...]`` with its latest turn (the request) conditioned on ``model``."""
    *earlier, (role, text) = turns
    return [*earlier, (role, conditioned_text(model, text))]
