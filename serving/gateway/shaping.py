"""Did the client, not the model, decide how long an answer was? Such an answer's length is no truth about the predictor.

The predictor learns, and is scored online on, the served model's own lengths under the served settings: the chat
template, the end-of-sequence token, the sampling its labels were made with (the predictor's target records it, e.g.
temperature 0.7, top_p 0.9, repetition_penalty 1.1). A request can end its answer sooner or later than the model would
by what it sends: stop strings or token ids, ``min_tokens``, ``ignore_eos``, a logit bias, bad or allowed words,
structured outputs, tools, its own chat template, sampling far from the served settings. Thirty requests with
``"stop": [" ", "\\n", ".", ","]`` on prompts the predictor put at 400-512 tokens answered in 2-19 tokens and raised the
sidecar's drift alarm, and went into the feedback store as uncensored training rows. So the gateway withholds the
length of an answer whose request carried any of these (counted by reason in
``lengthwise_gateway_feedback_withheld_total``): kept out of the accuracy windows and out of training rows alike.

``max_tokens`` is not among them: an answer it cut ends with ``finish_reason`` "length", which the sidecar already
takes as a lower bound (a censored label), and an answer that ended before it is the model's own length.

Sampling is judged against the predictor's recorded sampling, within :data:`SAMPLING_TOLERANCE`; a field the request
leaves out runs at the engine's default, taken as the served setting. Without a recorded sampling only the fields no
served setting uses (penalties, ``top_k``, ``min_p``, beam search) are judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serving.policy.hints import HINT_KEYS

# Sampling fields compared with the predictor's recorded sampling: farther than this from it shapes the length.
SAMPLING_TOLERANCE = {"temperature": 0.3, "top_p": 0.1, "repetition_penalty": 0.1}
# Fields whose neutral value leaves the length alone; any other value shapes it (unless the labels used it).
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "length_penalty": 1.0,
           "top_k": (-1, 0, None), "min_p": 0.0, "min_tokens": 0, "ignore_eos": False, "use_beam_search": False,
           "continue_final_message": False, "add_generation_prompt": True}
# Fields that shape the length whenever they hold anything (a non-empty string, list or object).
GIVEN = ("stop", "stop_token_ids", "logit_bias", "bad_words", "allowed_token_ids", "structured_outputs", "tools",
         "functions", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
         "logits_processors", "chat_template", "chat_template_kwargs", "documents", "reasoning_effort",
         "thinking_token_budget")


def shaped_by(body: Mapping[str, Any], sampling: Mapping[str, float] | None) -> str | None:
    """The first field of the request ``body`` that shapes its answer's length (None: the model decided it alone).

    ``sampling`` is the predictor's recorded sampling (temperature, top_p, repetition_penalty), or None when unknown.
    """
    for key in GIVEN:
        if body.get(key) not in (None, "", [], {}):
            return key
    fmt = body.get("response_format")
    if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
        return "response_format"
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, Mapping) and set(xargs) - HINT_KEYS:  # a client's own: what a custom logits processor reads
        return "vllm_xargs"
    served = dict(sampling or {})
    for key, neutral in NEUTRAL.items():
        v = body.get(key)
        if v is None or key in served:
            continue
        if v not in (neutral if isinstance(neutral, tuple) else (neutral,)):
            return key
    for key, tolerance in SAMPLING_TOLERANCE.items():
        v, want = body.get(key), served.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or want is None:
            continue
        if abs(v - want) > tolerance:
            return key
    return None
