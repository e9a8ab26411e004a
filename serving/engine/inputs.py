"""Per-request scheduling inputs as they reach an engine: ``sampling_params.extra_args`` (``vllm_xargs``).

The gateway puts the sidecar's prediction and the SLO deadline on each request; the scheduler plug-in
turns them into the policy core's :class:`~serving.policy.request.Prediction` and deadline. The keys are
:class:`serving.policy.hints.SchedulingHints`.

A request without ``pred_len`` (a client that bypassed the gateway, or a sidecar outage the gateway
did not cover) gets ``default_pred_len`` clamped to its ``max_tokens``; it is counted, so an operator
sees how much of the traffic ran blind. Malformed values are treated the same way, never as a crash:
one bad request must not take the engine down.

Two inputs are for the policy's learners of lengths (its per-service priors): ``client``, the gateway's opaque id of
the client key (``""`` when not told), so one key holds at most its share of a prior's window; and ``learnable``,
whether the request's own sampling parameters leave its length to the model, judged by the one definition every
learner keeps (:func:`serving.policy.learnable.shaping_field`) over what the plug-in sees of them: stop strings and
token ids, ``ignore_eos``, ``min_tokens``, bad words, a logit bias, allowed token ids, structured outputs, a thinking
budget, repetition detection and the client's own ``extra_args``. ``max_tokens`` is not judged here: whether it cuts
the answer is known only at its end, when the policy takes an output that reached it as cut. A model whose generation
config names several end-of-sequence tokens has vLLM add them to every request's ``stop_token_ids``: those
(:func:`model_stop_ids`, given as ``model_stops``) are the model's own stops, not the client's.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from serving.policy.hints import SchedulingHints
from serving.policy.learnable import shaping_field
from serving.policy.request import Prediction, capped_length


@dataclass(frozen=True, slots=True)
class RequestInputs:
    """What the policy needs from one request, and whether it fell back to defaults."""

    prediction: Prediction
    deadline: float
    fallback_prediction: bool
    invalid: str | None = None
    priority: int = 0
    client: str = ""  # the gateway's opaque id of the client key ("": not told)
    learnable: bool = True  # nothing the client set shapes the length (max_tokens aside: judged at the end)
    ref: str | None = None  # the gateway's id of the request, by which refinements name it (None: it gets none)


# vLLM's SamplingParams attributes that can end an answer sooner or later than the model would, by their names there
SHAPING_PARAMS = ("stop", "stop_token_ids", "ignore_eos", "min_tokens", "bad_words", "logit_bias", "allowed_token_ids",
                  "structured_outputs", "thinking_token_budget", "repetition_detection")
# extra_args keys vLLM's own server adds (disaggregated serving's transfer parameters): not the client's
ENGINE_ARGS = frozenset({"kv_transfer_params", "ec_transfer_params"})


def model_stop_ids(generation_config: Mapping[str, Any]) -> frozenset[int]:
    """The end-of-sequence ids of a model's generation config (``eos_token_id``: one id or a list), which vLLM adds to
    every request's ``stop_token_ids``."""
    eos = generation_config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, (list, tuple)) else []
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool))


def sampling_fields(sampling: Any, extra_args: Mapping[str, Any] | None,
                    model_stops: Collection[int] = ()) -> dict[str, Any]:
    """What the client set of the length-shaping sampling parameters (a vLLM ``SamplingParams``, read by attribute),
    by the names of the OpenAI body the shared rules read; the model's own stop ids left out of ``stop_token_ids``."""
    out: dict[str, Any] = {k: getattr(sampling, k, None) for k in SHAPING_PARAMS} if sampling is not None else {}
    if out.get("stop_token_ids"):
        out["stop_token_ids"] = [t for t in out["stop_token_ids"] if t not in model_stops]
    if isinstance(extra_args, Mapping):
        out["vllm_xargs"] = {k: v for k, v in extra_args.items() if k not in ENGINE_ARGS}
    return out


def parse_inputs(extra_args: dict[str, Any] | None, *, arrival: float, max_tokens: int | None,
                 default_pred_len: float, sampling: Any = None, model_stops: Collection[int] = ()) -> RequestInputs:
    """Read ``extra_args``; missing or malformed predictions fall back to ``default_pred_len``. ``sampling``: the
    request's sampling parameters, for ``learnable`` (None: nothing known to shape it); ``model_stops``: the model's own
    end-of-sequence ids (:func:`model_stop_ids`)."""
    invalid = None
    try:
        x = SchedulingHints.model_validate(extra_args or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        invalid = f"{'.'.join(str(p) for p in err['loc']) or 'extra_args'}: {err['msg']}"
        x = SchedulingHints()
    if x.pred_len is None:
        pred = Prediction(length=capped_length(default_pred_len, max_tokens))
        fallback = True
    else:
        pred = Prediction(length=capped_length(x.pred_len, max_tokens), hi=x.pred_hi, bucket=x.pred_bucket,
                          edges=x.pred_edges, probs=x.pred_probs)
        fallback = False
    if x.deadline is not None:
        deadline = x.deadline
    elif x.slo_s is not None:
        deadline = arrival + x.slo_s
    else:
        deadline = math.inf
    learnable = shaping_field(sampling_fields(sampling, extra_args, model_stops)) is None
    return RequestInputs(pred, deadline, fallback, invalid, x.priority or 0, x.client or "", learnable, x.ref)
