"""The engine-bound body: the client's request plus our scheduling hints in ``vllm_xargs``.

Merge rule: the client's own ``vllm_xargs`` travel unchanged, except the keys the scheduler plug-in reads
(:data:`serving.policy.hints.HINT_KEYS`): for those the gateway's values win and a client's
are dropped. Why: the gateway is the trust boundary. A client that could send ``pred_len: 1`` or a
deadline in the past would jump every queue ordered by predicted length or deadline; a client with a
real latency target says so with the ``x-slo-*`` headers, which the gateway turns into the deadline. The gateway
reads none of the client's other keys. With several client keys the hints name the key the request came with
(``client``: ``key-<i>``, its place in the key list, never the key), so that the plug-in's learners of lengths cap one
key's share as the sidecar's windows and the gateway's profiles do (a client's own ``client`` key is dropped with the
other hint keys: it could spread one key's answers over made-up ids). A disaggregated prefill hop's one-token request
carries the hints alone (``serving/gateway/prefill.py``); the engine that answers gets the client's keys.

For streams the engine is always asked for the usage chunk (``stream_options.include_usage``) so the
actual output length is known for feedback; the gateway strips that chunk again for a client that did
not ask for it.
"""

from __future__ import annotations

from typing import Any

from serving.gateway.prediction import LengthPrediction
from serving.gateway.requests import ClientRequest
from serving.policy.hints import HINT_KEYS, SchedulingHints


def our_xargs(pred: LengthPrediction, deadline: float, priority: int = 0, client: str | None = None,
              ref: str | None = None) -> dict[str, Any]:
    """The hints; a priority class only where the request's catalogue entry sets one other than 0, a client id only
    where the gateway tells keys apart, a ref only where it refines predictions."""
    return SchedulingHints(pred_len=pred.tokens, pred_hi=pred.hi, pred_bucket=pred.bucket, pred_edges=pred.edges,
                           pred_probs=pred.probs, deadline=round(deadline, 3), priority=priority or None,
                           client=client, ref=ref).xargs()


def engine_body(req: ClientRequest, pred: LengthPrediction, deadline: float, priority: int = 0,
                sender: str | None = None, ref: str | None = None) -> tuple[dict[str, Any], list[str]]:
    """The body to forward, and the client's xargs keys we overrode (for the log). ``sender``: the client key's label
    (``key-<i>``), or None; ``ref``: the id refinements name the request by (:mod:`serving.gateway.refine`), or None."""
    client = dict(req.body.get("vllm_xargs") or {})
    dropped = sorted(k for k in client if k in HINT_KEYS)
    ours = our_xargs(pred, deadline, priority, sender, ref)
    body = {**req.body, "vllm_xargs": {**{k: v for k, v in client.items() if k not in HINT_KEYS}, **ours}}
    if req.stream:
        body["stream_options"] = {**(req.body.get("stream_options") or {}), "include_usage": True}
    return body, dropped
