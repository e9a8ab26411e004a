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

The fields that end an answer by themselves are judged by :func:`serving.policy.learnable.shaping_field`, the one
definition every learner of lengths uses (the gateway's per-name profiles and the plug-in's priors too); only the
sampling judgement, which needs the predictor's recorded sampling, is the gateway's own.

Sampling is judged against the predictor's recorded sampling, within :data:`SAMPLING_TOLERANCE`, and a sampling field
the recorded sampling does not name must keep its neutral value; a field the request leaves out runs at the engine's
default, taken as the served setting. A predictor whose labels record no sampling has nothing to judge sampling
against: then only the fields that end an answer by themselves are judged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from serving.policy.learnable import shaping_field

# Sampling fields compared with the predictor's recorded sampling: farther than this from it shapes the length.
SAMPLING_TOLERANCE = {"temperature": 0.3, "top_p": 0.1, "repetition_penalty": 0.1}
# Sampling fields the labels' recorded sampling leaves at their neutral value when it does not name them.
SAMPLING_NEUTRAL = {"presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,),
                    "top_k": (-1, 0), "min_p": (0.0,)}


def shaped_by(body: Mapping[str, Any], sampling: Mapping[str, float] | None) -> str | None:
    """The first field of the request ``body`` that shapes its answer's length (None: the model decided it alone).

    ``sampling`` is the predictor's recorded sampling (temperature, top_p, repetition_penalty), or None when unknown:
    then no sampling field is judged, since there is nothing to judge it against (the labels were perhaps made with the
    very values the request sends).
    """
    field = shaping_field(body)  # the fields every learner of lengths judges alike (serving/policy/learnable.py)
    if field is not None or sampling is None:
        return field
    for key, tolerance in SAMPLING_TOLERANCE.items():
        v, want = body.get(key), sampling.get(key)
        if _number(v) and want is not None and abs(v - want) > tolerance:
            return key
    for key, neutral in SAMPLING_NEUTRAL.items():
        v = body.get(key)
        if key not in sampling and v is not None and v not in neutral:
            return key
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
