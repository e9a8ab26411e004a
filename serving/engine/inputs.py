"""Per-request scheduling inputs as they reach an engine: ``sampling_params.extra_args`` (``vllm_xargs``).

The gateway puts the sidecar's prediction and the SLO deadline on each request; the scheduler plug-in
turns them into the policy core's :class:`~serving.policy.request.Prediction` and deadline. Keys:

=============== ======================================================================================
``pred_len``    predicted output length in tokens (the point the policy allocates and groups by)
``pred_hi``     upper bound of the predicted bucket (tokens)
``pred_bucket`` predicted bucket index
``pred_edges``  bucket edges (tokens) and ``pred_probs`` the probability per bucket, for re-prediction
``deadline``    absolute deadline, Unix seconds (``time.time()`` clock, as vLLM's ``arrival_time``)
``slo_s``       alternatively, the deadline relative to arrival, seconds
=============== ======================================================================================

A request without ``pred_len`` (a client that bypassed the gateway, or a sidecar outage the gateway
did not cover) gets ``default_pred_len`` clamped to its ``max_tokens``; it is counted, so an operator
sees how much of the traffic ran blind. Malformed values are treated the same way, never as a crash:
one bad request must not take the engine down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serving.policy.request import Prediction


class _Inputs(BaseModel):
    model_config = ConfigDict(extra="ignore")

    pred_len: float | None = Field(None, ge=0, allow_inf_nan=False)
    pred_hi: float | None = Field(None, ge=0, allow_inf_nan=False)
    pred_bucket: int | None = Field(None, ge=0)
    pred_edges: tuple[int, ...] | None = None
    pred_probs: tuple[float, ...] | None = None
    deadline: float | None = Field(None, allow_inf_nan=False)
    slo_s: float | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _distribution(self) -> _Inputs:
        if (self.pred_edges is None) != (self.pred_probs is None):
            raise ValueError("pred_edges and pred_probs go together")
        if self.pred_edges is not None and len(self.pred_probs) != len(self.pred_edges) + 1:
            raise ValueError("pred_probs needs one entry per bucket: len(pred_edges) + 1")
        return self


@dataclass(frozen=True, slots=True)
class RequestInputs:
    """What the policy needs from one request, and whether it fell back to defaults."""

    prediction: Prediction
    deadline: float
    fallback_prediction: bool
    invalid: str | None = None


def parse_inputs(extra_args: dict[str, Any] | None, *, arrival: float, max_tokens: int | None,
                 default_pred_len: float) -> RequestInputs:
    """Read ``extra_args``; missing or malformed predictions fall back to ``default_pred_len``."""
    invalid = None
    try:
        x = _Inputs.model_validate(extra_args or {})
    except ValidationError as exc:
        err = exc.errors()[0]
        invalid = f"{'.'.join(str(p) for p in err['loc']) or 'extra_args'}: {err['msg']}"
        x = _Inputs()
    cap = float(max_tokens) if max_tokens else math.inf
    if x.pred_len is None:
        pred = Prediction(length=max(1.0, min(default_pred_len, cap)))
        fallback = True
    else:
        pred = Prediction(length=max(1.0, min(x.pred_len, cap)), hi=x.pred_hi, bucket=x.pred_bucket,
                          edges=x.pred_edges, probs=x.pred_probs)
        fallback = False
    if x.deadline is not None:
        deadline = x.deadline
    elif x.slo_s is not None:
        deadline = arrival + x.slo_s
    else:
        deadline = math.inf
    return RequestInputs(pred, deadline, fallback, invalid)
