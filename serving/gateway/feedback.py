"""Post each answered request's actual output length to the sidecar (``POST /v1/feedback``), off the request path.

Why in the background and bounded: feedback feeds the sidecar's online error metrics, never the answer,
so it must neither delay nor fail a response. Posts run as tasks after the response is done; when the
sidecar is slow and ``max_pending`` posts are already waiting, further ones are dropped and counted.
The served prediction travels inline too, so a sidecar that forgot the id (restarted, another replica)
still counts it. Only requests with one output sequence are reported: usage sums all of a request's
sequences, which would not be the length of any one of them.

The engine's finish reason goes with the length: an answer cut at ``max_tokens`` ("length") or aborted is only a
lower bound on how long the answer would have been, and the sidecar scores and stores it as such (a censored
label). A reason the sidecar does not know is left out (and logged) rather than costing the whole feedback.
"""

from __future__ import annotations

import asyncio
import logging

import httpx

from serving.gateway.metrics import GatewayMetrics
from serving.gateway.prediction import LengthPrediction

log = logging.getLogger("serving.gateway")

# The finish reasons the sidecar's /v1/feedback accepts (OpenAI's and vLLM's).
FINISH_REASONS = ("stop", "tool_calls", "function_call", "length", "abort", "content_filter", "error")


def finish_reason_of(answer: object) -> str | None:
    """The finish reason of a one-choice OpenAI answer (a whole body, or one streamed chunk); None when it has none."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        return None
    for c in choices:
        if isinstance(c, dict) and isinstance(c.get("finish_reason"), str):
            return c["finish_reason"]
    return None


class FeedbackPoster:
    def __init__(self, url: str | None, metrics: GatewayMetrics, timeout_s: float = 5.0, max_pending: int = 1000,
                 keepalive_s: float = 2.0):
        self.url, self.metrics, self.max_pending = url, metrics, max_pending
        self.client = (httpx.AsyncClient(timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=keepalive_s))
                       if url else None)
        self.pending: set[asyncio.Task] = set()

    def submit(self, pred: LengthPrediction, actual_tokens: int | None, outputs: int, finish_reason: str | None = None,
               client: str | None = None) -> None:
        """Schedule the post; returns at once. Nothing to report without a sidecar prediction id and a count.
        ``client`` (``key-<i>``) says which client key the answer went to: the sidecar caps one key's share of a
        window."""
        if self.client is None or pred.prediction_id is None or actual_tokens is None or outputs != 1:
            return
        if len(self.pending) >= self.max_pending:
            self.metrics.feedback.labels("dropped").inc()
            return
        if finish_reason is not None and finish_reason not in FINISH_REASONS:
            log.debug("finish reason %r of %s is not one the sidecar knows; sent without it", finish_reason,
                      pred.prediction_id)
            finish_reason = None
        task = asyncio.get_running_loop().create_task(self._post(pred, actual_tokens, finish_reason, client))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _post(self, pred: LengthPrediction, actual: int, finish_reason: str | None, client: str | None) -> None:
        inline = {"expected_tokens": pred.expected_tokens, "bucket": pred.bucket}
        if pred.quantile_tokens is not None:
            inline["quantile_tokens"] = pred.quantile_tokens
        if pred.model_name:
            inline["model_name"] = pred.model_name
        if pred.model_version:
            inline["model_version"] = pred.model_version
        body = {"request_id": pred.prediction_id, "actual_tokens": actual, "prediction": inline}
        if finish_reason is not None:
            body["finish_reason"] = finish_reason
        if client is not None:
            body["client"] = client
        try:
            r = await self.client.post(self.url + "/v1/feedback", json=body)
            outcome = "sent" if r.status_code == 200 else "rejected"
            if r.status_code != 200:
                log.debug("sidecar refused feedback for %s: %d %s", pred.prediction_id, r.status_code, r.text[:200])
        except httpx.HTTPError as exc:
            outcome = "failed"
            log.debug("feedback for %s not delivered: %s", pred.prediction_id, exc)
        self.metrics.feedback.labels(outcome).inc()

    async def aclose(self, wait_s: float = 2.0) -> None:
        """Give posts in flight a moment to finish, then drop the rest."""
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=wait_s)
        for t in list(self.pending):
            t.cancel()
        if self.client is not None:
            await self.client.aclose()
