"""Per-request scheduling inputs as they reach an engine: ``sampling_params.extra_args`` (``vllm_xargs``).

The gateway puts the sidecar's prediction and the SLO deadline on each request; the scheduler plug-in
turns them into the policy core's :class:`~serving.policy.request.Prediction` and deadline. The keys are
:class:`serving.policy.hints.SchedulingHints`.

A request without ``pred_len`` (a client that bypassed the gateway, or a sidecar outage the gateway
did not cover) gets ``default_pred_len`` clamped to its ``max_tokens``; it is counted, so an operator
sees how much of the traffic ran blind. Malformed values are treated the same way, never as a crash:
one bad request must not take the engine down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from serving.policy.hints import SchedulingHints
from serving.policy.request import Prediction, capped_length


@dataclass(frozen=True, slots=True)
class RequestInputs:
    """What the policy needs from one request, and whether it fell back to defaults."""

    prediction: Prediction
    deadline: float
    fallback_prediction: bool
    invalid: str | None = None
    priority: int = 0


def parse_inputs(extra_args: dict[str, Any] | None, *, arrival: float, max_tokens: int | None,
                 default_pred_len: float) -> RequestInputs:
    """Read ``extra_args``; missing or malformed predictions fall back to ``default_pred_len``."""
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
    return RequestInputs(pred, deadline, fallback, invalid, x.priority or 0)
