"""The scheduling hints a request carries from the gateway to the scheduler plug-in, defined once.

They travel in vLLM's per-request ``vllm_xargs`` (``sampling_params.extra_args`` inside the engine). The gateway
writes them (``serving/gateway/hints.py``) and the plug-in reads them (``serving/engine/inputs.py``), both through
:class:`SchedulingHints`, so a key cannot be renamed on one side only. Keys:

=============== ======================================================================================
``pred_len``    predicted output length in tokens (the point the policy allocates and groups by)
``pred_hi``     upper bound of the predicted bucket (tokens)
``pred_bucket`` predicted bucket index
``pred_edges``  bucket edges (tokens): the top of every bucket but the last, open one (strictly increasing, >= 1)
``pred_probs``  the probability of each bucket, ``len(pred_edges) + 1`` of them (finite, >= 0, summing to 1);
                with ``pred_edges`` the distribution a request that outlived ``pred_len`` is re-predicted by
``deadline``    absolute deadline, Unix seconds (``time.time()`` clock, as vLLM's ``arrival_time``)
``slo_s``       alternatively, the deadline relative to arrival, seconds
``priority``    the request's priority class, from its model's catalogue entry: lower runs first (vLLM's convention)
``client``      an opaque id of the client key that sent it (the gateway's ``key-<i>``, never the key; at most
                :data:`CLIENT_MAX_LEN` characters of letters, digits, ``_.:-``), so that a learner of lengths in the
                engine caps one key's share of its window (:class:`serving.policy.learnable.ClientWindow`)
``ref``         the gateway's opaque id of the request (the same characters, as long), by which a refined
                prediction reaches it while it runs (:class:`Refinement`); absent when the gateway sends none
=============== ======================================================================================

A refinement (:class:`Refinement`) travels the other way round: after the request started, from the gateway to the
plug-in's own port (:mod:`serving.engine.channel`), naming the request by its ``ref``.
"""

from __future__ import annotations

import itertools
import math
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

PROBS_SUM_TOLERANCE = 1e-3  # |sum(pred_probs) - 1| allowed: a softmax in float32 and a JSON round trip stay far within it
_Edge = Annotated[int, Field(ge=1)]
_Prob = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]
CLIENT_MAX_LEN = 64  # the sidecar's feedback takes a client id as long
_OpaqueId = Annotated[str, Field(min_length=1, max_length=CLIENT_MAX_LEN, pattern=r"^[\w.:-]+$")]


def check_distribution(edges: tuple[int, ...] | None, probs: tuple[float, ...] | None) -> None:
    """ValueError unless ``edges`` and ``probs`` are both absent or make one bucket distribution (the keys' rules)."""
    if (edges is None) != (probs is None):
        raise ValueError("pred_edges and pred_probs go together")
    if edges is None or probs is None:
        return
    if not edges:
        raise ValueError("pred_edges needs at least one edge (two buckets)")
    if len(probs) != len(edges) + 1:
        raise ValueError("pred_probs needs one entry per bucket: len(pred_edges) + 1")
    if any(b <= a for a, b in itertools.pairwise(edges)):
        raise ValueError("pred_edges must be strictly increasing")
    if abs(math.fsum(probs) - 1.0) > PROBS_SUM_TOLERANCE:
        raise ValueError(f"pred_probs must sum to 1, not {math.fsum(probs):.6g}")


class SchedulingHints(BaseModel):
    """One request's hints; keys other than these in ``vllm_xargs`` are the client's and are ignored here."""

    model_config = ConfigDict(extra="ignore")

    pred_len: int | float | None = Field(None, ge=0, allow_inf_nan=False)
    pred_hi: int | float | None = Field(None, ge=0, allow_inf_nan=False)
    pred_bucket: int | None = Field(None, ge=0)
    pred_edges: tuple[_Edge, ...] | None = None
    pred_probs: tuple[_Prob, ...] | None = None
    deadline: float | None = Field(None, allow_inf_nan=False)
    slo_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    priority: int | None = Field(None, ge=-1000, le=1000)
    client: _OpaqueId | None = None
    ref: _OpaqueId | None = None

    @model_validator(mode="after")
    def _distribution(self) -> SchedulingHints:
        check_distribution(self.pred_edges, self.pred_probs)
        return self

    def xargs(self) -> dict[str, Any]:
        """The ``vllm_xargs`` entries, unset hints left out."""
        return self.model_dump(exclude_none=True)


HINT_KEYS: frozenset[str] = frozenset(SchedulingHints.model_fields)
"""The keys the plug-in reads: a client may not set these (the gateway is the trust boundary)."""


class Refinement(BaseModel):
    """A sharper prediction for a running request: the remaining-length predictor read its prompt and its answer's
    first ``generated_tokens`` tokens, and predicts the tokens still to come (``pred_len``, and their bucket
    distribution). The plug-in turns it into a prediction of the whole length (:meth:`Prediction.after`)."""

    model_config = ConfigDict(extra="forbid")

    ref: _OpaqueId
    generated_tokens: int = Field(ge=0)
    pred_len: float = Field(ge=0, allow_inf_nan=False)
    pred_edges: tuple[_Edge, ...] | None = None
    pred_probs: tuple[_Prob, ...] | None = None

    @model_validator(mode="after")
    def _distribution(self) -> Refinement:
        check_distribution(self.pred_edges, self.pred_probs)
        return self


MAX_REFINEMENTS = 256  # per call of the plug-in's port


class Refinements(BaseModel):
    """Several refinements in one call (a gateway gathers those for one engine for a few milliseconds)."""

    model_config = ConfigDict(extra="forbid")

    refinements: list[Refinement] = Field(min_length=1, max_length=MAX_REFINEMENTS)
