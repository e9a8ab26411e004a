"""The predicted response length of a request: from the sidecar, or from the fallback when it cannot answer.

Why a hard time limit: the prediction sits on every request's critical path. A sidecar that is down,
slow or confused must cost at most ``predictor_timeout_ms`` and never an error: the request then runs
on the fallback length (``fallback_tokens``, clamped to ``max_tokens``), and the reason is counted in
``lengthwise_gateway_prediction_fallbacks_total`` so an operator sees how much traffic ran blind.

A sidecar whose encoder is saturated answers from its fast tier (``overflow`` in its answer) rather than let the
prediction time out: such a request keeps the sidecar's prediction, counted in
``lengthwise_gateway_prediction_fast_tier_total`` and marked ``sidecar:fast-tier`` in ``x-lengthwise-prediction``.

A sidecar prediction also carries the bucket distribution (``edges``, ``probs``), by which the engine re-predicts a
request that outlives its prediction. It is checked here as the plug-in checks it
(:class:`~serving.policy.hints.SchedulingHints`); one that is absent (an older sidecar) or malformed is dropped, counted
in ``lengthwise_gateway_prediction_distributions_dropped_total``, and the request keeps its point prediction.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import httpx
from pydantic import ValidationError

from serving.gateway.errors import ApiError
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.requests import ClientRequest
from serving.policy.hints import SchedulingHints

log = logging.getLogger("serving.gateway")


@dataclass(frozen=True, slots=True)
class LengthPrediction:
    """What the scheduler plug-in receives (``tokens``, ``hi``, ``bucket``, ``edges``, ``probs``) and what feedback needs."""

    tokens: int  # predicted output tokens, clamped to [1, max_tokens]
    source: str  # "sidecar", "profile" (a catalogue name's own profile), "fallback" or "client" (--trust-client-predictions)
    reason: str | None = None  # why the fallback was used
    hi: int | None = None  # upper edge of the predicted bucket
    bucket: int | None = None
    expected_tokens: float | None = None  # the sidecar's numbers, unclamped, for /v1/feedback
    quantile_tokens: float | None = None
    prediction_id: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    edges: tuple[int, ...] | None = None  # the sidecar's bucket distribution (checked): tops of all buckets but the last
    probs: tuple[float, ...] | None = None  # and one probability per bucket, len(edges) + 1
    fast_tier: bool = False  # answered by the sidecar's fast tier: its encoder would have answered after the timeout

    @property
    def label(self) -> str:
        """Where the length came from, as the ``x-lengthwise-prediction`` header says it: ``sidecar``,
        ``sidecar:fast-tier``, ``client`` or ``fallback:<reason>``."""
        if self.reason is not None:
            return f"fallback:{self.reason}"
        return f"{self.source}:fast-tier" if self.fast_tier else self.source


def clamp(tokens: float, max_tokens: int | None) -> int:
    cap = max_tokens if max_tokens else math.inf
    return int(max(1, min(round(tokens), cap)))


class Predictor:
    """Asks ``POST {url}/v1/predict``; anything but a timely, well-formed answer gives the fallback."""

    def __init__(self, url: str | None, timeout_ms: float, fallback_tokens: int, metrics: GatewayMetrics,
                 keepalive_s: float = 2.0):
        """``keepalive_s``: an idle connection is dropped after this long, below the sidecar's own 5 s (uvicorn's),
        so that a reuse never races the sidecar closing it (which resets the call: a needless fallback)."""
        self.url, self.timeout, self.fallback_tokens, self.metrics = url, timeout_ms / 1000.0, fallback_tokens, metrics
        # the sidecar drops a prediction still queued when this timeout has passed (it is a fallback here by then)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(max(1.0, self.timeout * 4)),
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64,
                                                            keepalive_expiry=keepalive_s),
                                        headers={"x-lengthwise-timeout-ms": f"{timeout_ms:g}"})
        self._calls: set[asyncio.Task] = set()  # calls in flight, held until they end (see predict)

    async def aclose(self) -> None:
        for task in list(self._calls):
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        await self.client.aclose()

    def _settle(self, task: asyncio.Task) -> None:
        """A call's end: forget it and consume its outcome (a late call's exception, awaited by nobody, would be logged)."""
        self._calls.discard(task)
        if not task.cancelled():
            task.exception()

    def fallback(self, req: ClientRequest, reason: str) -> LengthPrediction:
        self.metrics.prediction_fallbacks.labels(reason).inc()
        return LengthPrediction(clamp(self.fallback_tokens, req.max_tokens), "fallback", reason)

    def from_client(self, req: ClientRequest, header: str) -> LengthPrediction:
        """A trusted client's own prediction (``x-lengthwise-pred-len``); a malformed one is the client's error."""
        try:
            tokens = float(header)
        except ValueError:
            tokens = math.nan
        if not math.isfinite(tokens) or tokens < 1:
            raise ApiError(400, f"x-lengthwise-pred-len must be a number of output tokens >= 1, got {header[:40]!r}",
                           param="x-lengthwise-pred-len")
        return LengthPrediction(clamp(tokens, req.max_tokens), "client", expected_tokens=tokens)

    async def predict(self, req: ClientRequest, request_id: str) -> LengthPrediction:
        if self.url is None:
            return self.fallback(req, "disabled")
        if req.predict_input is None:
            return self.fallback(req, req.no_predict_reason or "no_text")
        # the model the request is for: a predictor conditioned on the model reads it (one for one model ignores it)
        body = {**req.predict_input, "request_id": request_id, **({"model": req.model} if req.model else {})}
        t0 = time.perf_counter()
        # The call is shielded from the timeout rather than cancelled by it: a call cancelled at the wrong moment (as its
        # answer arrives and its connection goes back to the pool) loses the socket, which httpx never closes; it sits
        # in CLOSE_WAIT once the sidecar hangs up. Measured: 1,200 predictions at a 3 ms timeout left 114 such sockets.
        # A late call runs on to the sidecar's answer (it drops a prediction queued past the timeout this gateway sends
        # it) or to the client's own timeout, and its connection goes back to the pool. Held in ``_calls`` until it
        # ends, also when the request awaiting it is cancelled (the event loop keeps only weak references to tasks).
        task = asyncio.ensure_future(self.client.post(self.url + "/v1/predict", json=body))
        self._calls.add(task)
        task.add_done_callback(self._settle)
        try:
            r = await asyncio.wait_for(asyncio.shield(task), self.timeout)
        except TimeoutError:
            reason = "timeout"
        except httpx.TransportError as exc:
            reason = "unreachable"
            log.debug("sidecar unreachable: %s", exc)
        else:
            self.metrics.predictor_latency.observe(time.perf_counter() - t0)
            if r.status_code != 200:
                log.debug("sidecar answered %d: %s", r.status_code, r.text[:200])
                return self.fallback(req, "rejected" if r.status_code < 500 else "sidecar_error")
            try:
                return self._parse(r.json(), req)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                log.warning("sidecar answer not understood (%s): %s", exc, r.text[:200])
                return self.fallback(req, "bad_response")
        self.metrics.predictor_latency.observe(time.perf_counter() - t0)
        return self.fallback(req, reason)

    def _parse(self, data: dict, req: ClientRequest) -> LengthPrediction:
        """One prediction per prompt; several prompts (a completions batch) share the longest one's."""
        preds = data["predictions"]
        p = max(preds, key=lambda x: float(x["expected_tokens"]))
        expected = float(p["expected_tokens"])
        if not math.isfinite(expected) or expected < 0:
            raise ValueError(f"expected_tokens {expected}")
        hi, bucket = int(p["range"][1]), int(p["bucket"])
        qtok = float(p["quantile_tokens"]) if p.get("quantile_tokens") is not None else None
        one = len(preds) == 1
        fast = bool(p.get("overflow"))
        edges, probs = self._distribution(p)  # last: counted only for an answer that is used
        if fast:
            self.metrics.prediction_fast_tier.inc()
        return LengthPrediction(
            clamp(expected, req.max_tokens), "sidecar", hi=hi, bucket=bucket, expected_tokens=expected, quantile_tokens=qtok,
            prediction_id=str(p["prediction_id"]) if one and p.get("prediction_id") else None,
            model_name=p.get("model_name"), model_version=str(p["model_version"]) if p.get("model_version") else None,
            edges=edges, probs=probs, fast_tier=fast)

    def _distribution(self, p: dict) -> tuple[tuple[int, ...] | None, tuple[float, ...] | None]:
        """The bucket distribution of the sidecar's prediction ``p`` as the plug-in reads it; none (counted) when the
        sidecar sent none or one the plug-in would refuse (not finite, negative, not summing to 1, edges not strictly
        increasing, ``len(probs) != len(edges) + 1``): a bad distribution never costs the request its prediction."""
        if p.get("edges") is None:
            self.metrics.distributions_dropped.labels("absent").inc()
            return None, None
        try:
            hints = SchedulingHints(pred_edges=p["edges"], pred_probs=p.get("probs"))
        except (ValidationError, TypeError) as exc:
            self.metrics.distributions_dropped.labels("invalid").inc()
            log.debug("sidecar distribution dropped: %s", exc)
            return None, None
        return hints.pred_edges, hints.pred_probs
