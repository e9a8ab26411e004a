"""Is an answer's length the model's own, a sample a learner of lengths may take? One definition for every learner.

Lengths are learnt in several places: the sidecar's online error windows and feedback store (fed by the gateway's
feedback), the gateway's per-name profile (a catalogue entry's ``predictor: profile``) and the scheduler plug-in's
per-service priors. Each learns from what clients send, so a client that shapes its answers shapes what is learnt:
150 requests with ``max_tokens: 1`` from one key moved a profile's mean from 19.5 tokens to 1.5, and the next honest
request was predicted at 1 token, first in every shortest-first queue. So a learner takes an answer's length only when

- the request set nothing that ends an answer sooner or later than the model would (:func:`shaping_field`: stop
  strings or token ids, ``min_tokens``, ``ignore_eos``, a logit bias, bad or allowed words, structured outputs, tools,
  its own chat template, its own ``vllm_xargs``; the gateway also judges sampling against the predictor's recorded
  sampling, serving/gateway/shaping.py);
- it is one sequence's length (``n`` > 1: usage sums the sequences, which is the length of none of them);
- the model ended it: a finish reason in :data:`CUT` ("length" at ``max_tokens``, "abort", ...) says only that the
  answer would have been at least that long. The sidecar keeps such an answer as a censored label, scored as a lower
  bound (monitoring/online.py, whose finish reasons these are: a test holds the two to the same table); a learner of a
  mean or of a window of lengths refuses it (:func:`refusal`). An engine cannot know at admission whether
  ``max_tokens`` will cut an answer: there the policy treats a request whose output reached its ``max_tokens`` as cut.

and one client key holds at most a share of any window of samples (:class:`ClientWindow`): what it sends past its
share pushes out its own oldest samples, never another key's (the sidecar caps a key's share of its online windows
too, by ``--window-key-share``). Pure Python: the gateway, the plug-in and the policy core import it alike.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from typing import Any

from serving.policy.hints import HINT_KEYS

# Finish reasons (OpenAI's and vLLM's): the model chose to stop, or the answer was cut and its length is a lower bound.
FINISHED = ("stop", "tool_calls", "function_call")
CUT = ("length", "abort", "content_filter", "error")
# Fields that shape the length whatever the served settings: any value but their neutral one.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "min_tokens": (0,), "ignore_eos": (False,), "use_beam_search": (False,), "length_penalty": (1.0,),
    "continue_final_message": (False,), "add_generation_prompt": (True,)}
# Fields that shape the length whenever they hold anything (a non-empty string, list or object).
GIVEN = ("stop", "stop_token_ids", "logit_bias", "bad_words", "allowed_token_ids", "structured_outputs", "tools",
         "functions", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
         "logits_processors", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort",
         "thinking_token_budget", "repetition_detection")
WINDOW = 512  # samples a window keeps: recent enough to follow a service that changes, many enough for a steady mean
KEY_SHARE = 0.25  # the most of a window one client key may hold


def shaping_field(fields: Mapping[str, Any]) -> str | None:
    """The first of a request's ``fields`` that ends its answer sooner or later than the model would, whatever the
    served settings; None when none does. ``fields``: an OpenAI request body, or an engine's sampling parameters under
    the same names (``vllm_xargs`` for their extra args)."""
    for key in GIVEN:
        if fields.get(key) not in (None, "", [], {}, ()):
            return key
    fmt = fields.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        return "response_format"
    xargs = fields.get("vllm_xargs")
    if isinstance(xargs, Mapping) and set(xargs) - HINT_KEYS:  # a client's own: what a custom logits processor reads
        return "vllm_xargs"
    for key, neutral in NEUTRAL.items():
        if fields.get(key) is not None and fields[key] not in neutral:
            return key
    return None


def censored(finish_reason: str | None) -> bool:
    """The answer was cut: its true length is at least what was generated. An untold reason is taken as finished."""
    return finish_reason in CUT


def refusal(shaped: str | None, finish_reason: str | None = None, outputs: int = 1) -> str | None:
    """Why an answer's length may not be learnt as the model's own, or None when it may: ``shaped`` (the field by which
    the client shaped it, :func:`shaping_field` or the gateway's wider judgement), ``"n"`` (several sequences), or the
    finish reason that cut it."""
    if shaped is not None:
        return shaped
    if outputs != 1:
        return "n"
    return finish_reason if censored(finish_reason) else None


class ClientWindow:
    """The latest ``size`` learnable lengths, at most ``share`` of them (at least one) from any one client key.

    A key at its share that sends another sample drops its own oldest one; samples without a key (``None``: a gateway
    with fewer than two keys cannot tell its clients apart) are not capped. Why a window, not running moments: a key's
    share can only be bounded over samples that are kept, and old samples leave on their own.
    """

    def __init__(self, size: int = WINDOW, share: float = KEY_SHARE) -> None:
        if size < 1 or not 0 < share <= 1:
            raise ValueError(f"a window needs size >= 1 and share in (0, 1], got {size} and {share}")
        self.size, self.cap = size, max(1, int(size * share))
        # (client, length, what the learner keeps beside it or None: e.g. what was predicted, to judge its predictor by)
        self.samples: deque[tuple[str | None, float, Any]] = deque()
        self.per_client: dict[str, int] = {}
        self.over_share = 0  # samples that pushed out their own key's oldest
        self.added = 0       # samples ever taken (a learner refreshes what it derives every so many)
        self._moments: tuple[float, float] | None = None

    def add(self, length: float, client: str | None = None, note: Any = None) -> None:
        if client is not None and self.per_client.get(client, 0) >= self.cap:
            self.over_share += 1
            index = next(i for i, s in enumerate(self.samples) if s[0] == client)
            del self.samples[index]
            self._forget(client)
        elif len(self.samples) >= self.size:
            self._forget(self.samples.popleft()[0])
        self.samples.append((client, float(length), note))
        if client is not None:
            self.per_client[client] = self.per_client.get(client, 0) + 1
        self.added += 1
        self._moments = None

    def _forget(self, client: str | None) -> None:
        if client is not None:
            self.per_client[client] -= 1
            if not self.per_client[client]:
                del self.per_client[client]

    @property
    def n(self) -> int:
        return len(self.samples)

    def held_by(self, client: str) -> int:
        """The samples ``client`` holds now."""
        return self.per_client.get(client, 0)

    def _stats(self) -> tuple[float, float]:
        if self._moments is None:
            xs = [s[1] for s in self.samples]
            mean = math.fsum(xs) / len(xs) if xs else 0.0
            var = math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0
            self._moments = (mean, math.sqrt(var))
        return self._moments

    @property
    def mean(self) -> float:
        return self._stats()[0]

    @property
    def std(self) -> float:
        """The sample standard deviation (0 below two samples)."""
        return self._stats()[1]
