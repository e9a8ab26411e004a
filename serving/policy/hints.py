"""The scheduling hints a request carries from the gateway to the scheduler plug-in, defined once.

They travel in vLLM's per-request ``vllm_xargs`` (``sampling_params.extra_args`` inside the engine). The gateway
writes them (``serving/gateway/hints.py``) and the plug-in reads them (``serving/engine/inputs.py``), both through
:class:`SchedulingHints`, so a key cannot be renamed on one side only. Keys:

=============== ======================================================================================
``pred_len``    predicted output length in tokens (the point the policy allocates and groups by)
``pred_hi``     upper bound of the predicted bucket (tokens)
``pred_bucket`` predicted bucket index
``pred_edges``  bucket edges (tokens) and ``pred_probs`` the probability per bucket, for re-prediction
``deadline``    absolute deadline, Unix seconds (``time.time()`` clock, as vLLM's ``arrival_time``)
``slo_s``       alternatively, the deadline relative to arrival, seconds
=============== ======================================================================================
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SchedulingHints(BaseModel):
    """One request's hints; keys other than these in ``vllm_xargs`` are the client's and are ignored here."""

    model_config = ConfigDict(extra="ignore")

    pred_len: int | float | None = Field(None, ge=0, allow_inf_nan=False)
    pred_hi: int | float | None = Field(None, ge=0, allow_inf_nan=False)
    pred_bucket: int | None = Field(None, ge=0)
    pred_edges: tuple[int, ...] | None = None
    pred_probs: tuple[float, ...] | None = None
    deadline: float | None = Field(None, allow_inf_nan=False)
    slo_s: float | None = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _distribution(self) -> SchedulingHints:
        if (self.pred_edges is None) != (self.pred_probs is None):
            raise ValueError("pred_edges and pred_probs go together")
        if self.pred_edges is not None and len(self.pred_probs) != len(self.pred_edges) + 1:
            raise ValueError("pred_probs needs one entry per bucket: len(pred_edges) + 1")
        return self

    def xargs(self) -> dict[str, Any]:
        """The ``vllm_xargs`` entries, unset hints left out."""
        return self.model_dump(exclude_none=True)


HINT_KEYS: frozenset[str] = frozenset(SchedulingHints.model_fields)
"""The keys the plug-in reads: a client may not set these (the gateway is the trust boundary)."""
