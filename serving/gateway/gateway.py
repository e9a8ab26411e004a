"""The gateway's request path as one object, one method per step, with no HTTP server in it.

Per request (docs/architecture.md), in :meth:`Gateway.serve`: :meth:`~Gateway.validate` → :meth:`~Gateway.slo_terms` (the
client's ``x-slo-*`` headers, read before the prediction so that a malformed one costs no sidecar call) →
:meth:`~Gateway.predict` (sidecar or fallback) → :meth:`~Gateway.deadline` → :meth:`~Gateway.hints` (into
``vllm_xargs``) → :meth:`~Gateway.engine_headers` → :meth:`~Gateway.job` (count the prompt's tokens, the request
as placement sees it) → :meth:`~Gateway.prefill` (disaggregated only) → :meth:`~Gateway.forward` (placement, retries,
streaming: :mod:`serving.gateway.forward`) → :meth:`~Gateway.finished` (metrics and feedback, when the answer is
complete) → :meth:`~Gateway.decorate` (the headers that say what the gateway decided). Any step may raise
:class:`~serving.gateway.errors.ApiError`; :meth:`~Gateway.refused` turns it into the client's answer.

Why a module of its own rather than more of ``app.py``: ``app.py`` is the FastAPI adapter (routes, lifespan, error
handlers, reading the body, noticing a client that leaves), and everything it needs from a request is a kind, the
body's bytes and the headers. Here those are plain arguments, so each step runs, and is tested
(``tests/test_gateway_steps.py``), with a settings object and no server, engine or HTTP client; the only web types
are the Starlette responses the forwarder already returns.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from serving.gateway.errors import ApiError
from serving.gateway.feedback import FeedbackPoster
from serving.gateway.forward import Forwarder, Outcome
from serving.gateway.hints import engine_body
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.pool import EnginePool
from serving.gateway.prediction import LengthPrediction, Predictor
from serving.gateway.prefill import Prefilled, PrefillHop
from serving.gateway.requests import PATHS, ClientRequest, Kind, parse_json
from serving.gateway.requests import validate as validate_request
from serving.gateway.settings import GatewaySettings
from serving.gateway.slo import client_slo, default_slo
from serving.gateway.slo import deadline as slo_deadline
from serving.gateway.target import TargetCheck, TargetWatch, served_model
from serving.gateway.target import check as check_target
from serving.gateway.tokens import PromptCounter
from serving.placement import Job

log = logging.getLogger("serving.gateway")
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
PRED_LEN_HEADER = "x-lengthwise-pred-len"  # a trusted client's own prediction (--trust-client-predictions)

# How the adapter awaits a non-streamed answer: the answer, or None when the client left first (the call is cancelled).
Waiter = Callable[[Coroutine[Any, Any, Response]], Awaitable[Response | None]]


@dataclass
class Call:
    """One request on its way through the steps: what they found that feedback and the response headers report."""

    kind: Kind
    t0: float = field(default_factory=time.perf_counter)  # latency and TTFT are measured from here
    arrival: float = field(default_factory=time.time)  # the deadline's origin, Unix seconds
    rid: str = field(default_factory=lambda: "lw-" + uuid.uuid4().hex)  # also the engine's request id
    pred: LengthPrediction | None = None
    deadline: float | None = None
    prompt_tokens: int | None = None
    method: str | None = None  # how prompt_tokens were counted: tokenizer, estimate, token_ids or prefill
    prefilled: Prefilled | None = None

    @property
    def endpoint(self) -> str:
        return PATHS[self.kind]


class Gateway:
    """The engines (decode and, disaggregated, prefill), the predictor, feedback and metrics, and the steps over them.

    ``engine_urls`` default to ``settings.engine_urls`` and ``prefill_urls`` to ``settings.prefill_urls``; engines must
    already be starting or up. ``plugin_metrics`` maps an engine URL to its scheduler plug-in's metrics URL, re-exported
    on ``/metrics``. ``predictor_target`` is the command line's verdict on the sidecar's target model, already announced
    (:mod:`serving.gateway.target`); without one the gateway checks at :meth:`start`. Nothing is contacted before
    :meth:`start`; :meth:`aclose` releases what it holds.
    """

    def __init__(self, settings: GatewaySettings, engine_urls: list[str] | None = None,
                 plugin_metrics: dict[str, str] | None = None, prefill_urls: list[str] | None = None,
                 predictor_target: TargetCheck | None = None) -> None:
        self.settings = settings
        self.metrics = metrics = GatewayMetrics()
        self.pool = EnginePool(engine_urls or settings.engine_urls, settings, metrics)
        self.predictor = Predictor(settings.predictor_url, settings.predictor_timeout_ms, settings.fallback_tokens, metrics)
        self.feedback = FeedbackPoster(settings.predictor_url if settings.feedback else None, metrics)
        self.forwarder = Forwarder(self.pool, settings, metrics)
        prefill_urls = prefill_urls or settings.prefill_urls
        self.hop = (PrefillHop(EnginePool(prefill_urls, settings, metrics, prefill=True), settings, metrics) if prefill_urls
                    else None)
        names = {e.url: e.name for e in [*self.pool.engines, *(self.hop.pool.engines if self.hop else [])]}
        self.plugin_targets = {names[u]: m for u, m in (plugin_metrics or {}).items() if u in names}
        self.slo = default_slo(settings)
        self.prompts = PromptCounter()
        self.rids = itertools.count()
        self._tokenizer: asyncio.Task | None = None
        served = served_model(settings)
        if predictor_target is None and not settings.predictor_url:
            predictor_target = TargetCheck("unchecked", served, detail="no --predictor-url: no predictor to check")
        self.target = TargetWatch(served, settings.allow_predictor_for_other_model, metrics.predictor_target_mismatch.set,
                                  predictor_target)
        self._target_task: asyncio.Task | None = None

    # --- life ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the tokenizer and watch the predictor's target model in the background, and take in the engines (the
        CLI waited for their /health)."""
        s, hop = self.settings, self.hop
        self._tokenizer = asyncio.get_running_loop().create_task(self.prompts.load(s.model))
        if s.predictor_url:
            self._target_task = asyncio.get_running_loop().create_task(self._watch_target())
        await asyncio.gather(self.pool.start(), *([hop.pool.start()] if hop else []))
        if s.model and self.pool.models and s.model not in self.pool.models:
            log.warning("--model %s is not among the models the engines serve (%s)", s.model, ", ".join(sorted(self.pool.models)))
        log.info("gateway ready: %d engine(s)%s, predictor %s, placement %s, prompt tokens: %s", len(self.pool.engines),
                 f" decoding after {len(hop.pool.engines)} prefill engine(s)" if hop else "",
                 s.predictor_url or "none (fallback only)", s.placement, self.prompts.method)

    async def _watch_target(self) -> None:
        """Check which model the sidecar's predictor is for now (unless the command line just did), then every
        ``predictor_check_interval_s``: a sidecar that was down at start, or whose alias moved, is judged when it
        answers."""
        import httpx

        checked = self.target.current.state != "unchecked" and not self.target.current.pending
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as client:
            while True:
                if not checked:
                    self.target.update(await check_target(self.settings.predictor_url, self.target.served, client))
                checked = False
                await asyncio.sleep(self.settings.predictor_check_interval_s)

    async def aclose(self) -> None:
        for task in (self._tokenizer, self._target_task):
            if task is not None:
                task.cancel()
        await self.feedback.aclose()
        await self.pool.aclose()
        await self.forwarder.aclose()
        if self.hop:
            await self.hop.aclose()
        await self.predictor.aclose()

    def count(self, endpoint: str, status: int) -> None:
        """One answered HTTP request, by endpoint (``other`` for unknown paths) and status."""
        self.metrics.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(status)).inc()

    # --- one request: the path ----------------------------------------------------------------------
    async def serve(self, call: Call, raw: bytes, headers: Mapping[str, str], wait: Waiter) -> Response:
        """The answer to the request whose body is ``raw``; ``wait`` awaits a non-streamed answer (see :data:`Waiter`).

        Raises ApiError from whichever step refuses the request; the caller answers it with :meth:`refused`.
        """
        req = self.validate(call.kind, raw)
        terms = self.slo_terms(headers)
        pred = await self.predict(call, req, headers)
        body = self.hints(call, req, pred, self.deadline(call, pred, terms))
        forwarded = self.engine_headers(call, headers)
        job = self.job(call, req, pred)
        if self.hop:
            prefilled = await self.prefill(call, req, body, forwarded, job)
            if isinstance(prefilled, Response):  # the prefill engine refused the request: its answer is the client's
                return prefilled
            body = prefilled.body
        resp = await self.forward(call, req, body, forwarded, job, wait)
        return self.client_left(call) if resp is None else self.decorate(call, resp)

    # --- the steps ------------------------------------------------------------------------------------
    def validate(self, kind: Kind, raw: bytes) -> ClientRequest:
        """The body as a checked request for the models the engines serve (none known yet: any model)."""
        return validate_request(kind, parse_json(raw), self.pool.models)

    def slo_terms(self, headers: Mapping[str, str]) -> tuple[float | None, float | None]:
        """The client's own (TTFT, TPOT) in seconds from ``x-slo-ttft-ms``/``x-slo-tpot-ms``; a malformed one is a 400."""
        return client_slo(headers)

    async def predict(self, call: Call, req: ClientRequest, headers: Mapping[str, str]) -> LengthPrediction:
        """The predicted length: a trusted client's header, else the sidecar's, else the fallback (never an error but
        a malformed trusted header). A sidecar whose predictor is for another model is not asked, unless the operator
        allowed it (then each of its predictions is counted)."""
        hint = headers.get(PRED_LEN_HEADER) if self.settings.trust_client_predictions else None
        if hint is not None:
            pred = self.predictor.from_client(req, hint)
        elif self.target.refuses:
            pred = self.predictor.fallback(req, "other_model")
        else:
            pred = await self.predictor.predict(req, call.rid)
            if pred.source == "sidecar" and self.target.other_model:
                self.metrics.other_model_predictions.inc()
        self.metrics.predictions.labels(pred.source).inc()
        call.pred = pred
        return pred

    def deadline(self, call: Call, pred: LengthPrediction, terms: tuple[float | None, float | None]) -> float:
        """The absolute deadline: the client's terms where given, else the JCT SLO, over the predicted length."""
        call.deadline = slo_deadline(call.arrival, pred.tokens, terms, self.slo)
        return call.deadline

    def hints(self, call: Call, req: ClientRequest, pred: LengthPrediction, dl: float) -> dict[str, Any]:
        """The engine's body: the client's, with the prediction and the deadline in ``vllm_xargs`` over any the client
        set for the same keys (those are counted and logged)."""
        body, dropped = engine_body(req, pred, dl)
        if dropped:
            self.metrics.client_hints_dropped.inc(len(dropped))
            log.debug("request %s: client vllm_xargs %s replaced by the gateway's", call.rid, dropped)
        return body

    def engine_headers(self, call: Call, headers: Mapping[str, str]) -> dict[str, str]:
        """What goes to the engine besides the body: our request id and the client's credentials."""
        out = {"X-Request-Id": call.rid}
        if "authorization" in headers:
            out["Authorization"] = headers["authorization"]
        return out

    def job(self, call: Call, req: ClientRequest, pred: LengthPrediction) -> Job:
        """The request as placement sees it: its prompt's tokens (counted here) and its predicted output tokens."""
        call.prompt_tokens, call.method = self.prompts.count(req)
        self.metrics.prompt_token_counts.labels(call.method).inc()
        return Job(next(self.rids), call.prompt_tokens, float(pred.tokens * req.outputs), arrival=time.monotonic())

    async def prefill(self, call: Call, req: ClientRequest, body: dict[str, Any], headers: dict[str, str],
                      job: Job) -> Prefilled | Response:
        """Disaggregated: the prompt's KV computed on a prefill engine; the prefill engine's refusal is the client's
        answer. The engine's own prompt count, exact, replaces ours for the decode placement."""
        assert self.hop is not None
        prefilled = await self.hop.run(req, body, headers, job)
        if isinstance(prefilled, Response):
            self.count(call.endpoint, prefilled.status_code)
            prefilled.headers["x-lengthwise-request-id"] = call.rid
            return prefilled
        call.prefilled = prefilled
        if prefilled.prompt_tokens is not None:
            call.prompt_tokens = job.prompt_len = prefilled.prompt_tokens
            call.method = "prefill"
        return prefilled

    async def forward(self, call: Call, req: ClientRequest, body: dict[str, Any], headers: dict[str, str], job: Job,
                      wait: Waiter) -> Response | None:
        """Place and send the request (retried elsewhere while the client saw nothing); None when the client of a
        non-streamed request left before its answer."""
        answer = self.forwarder.forward(req, body, headers, job, functools.partial(self.finished, call, req))
        if req.stream:  # a stream notices its client leaving itself (Starlette cancels the relay)
            return await answer
        return await wait(answer)

    def finished(self, call: Call, req: ClientRequest, out: Outcome) -> None:
        """The answer is complete (streams: after the last event): metrics, and the actual length to the sidecar."""
        self.count(call.endpoint, out.status)
        self.metrics.latency.labels(call.endpoint).observe(time.perf_counter() - call.t0)
        if out.first_token_at is not None:
            self.metrics.ttft.labels(call.endpoint).observe(out.first_token_at - call.t0)
        if out.status == 200 and out.completion_tokens is not None:
            self.metrics.output_tokens.inc(out.completion_tokens)
            assert call.pred is not None
            self.feedback.submit(call.pred, out.completion_tokens, req.outputs, out.finish_reason)

    def decorate(self, call: Call, resp: Response) -> Response:
        """The engine's response with the headers that say what the gateway decided."""
        pred = call.pred
        assert pred is not None and call.deadline is not None
        resp.headers.update({
            "x-lengthwise-request-id": call.rid, "x-lengthwise-pred-len": str(pred.tokens),
            "x-lengthwise-prediction": pred.source if pred.reason is None else f"fallback:{pred.reason}",
            "x-lengthwise-deadline": f"{call.deadline:.3f}", "x-lengthwise-prompt-tokens": f"{call.prompt_tokens}:{call.method}"})
        if call.prefilled is not None:
            resp.headers.update({"x-lengthwise-prefill-engine": call.prefilled.engine,
                                 "x-lengthwise-prefill-ms": f"{call.prefilled.seconds * 1000:.1f}"})
        return resp

    def client_left(self, call: Call) -> Response:
        """A non-streamed request whose client went away: its engine call was cancelled."""
        self.count(call.endpoint, 499)
        log.info("request %s: the client went away before its answer; the engine call was cancelled", call.rid)
        return Response(status_code=499)

    def refused(self, call: Call, exc: ApiError) -> Response:
        """A step's refusal as the client's OpenAI-style error, with the request id."""
        self.count(call.endpoint, exc.status)
        resp = exc.response()
        resp.headers["x-lengthwise-request-id"] = call.rid
        return resp

    # --- the other endpoints ------------------------------------------------------------------------
    async def models(self) -> Response:
        """The first healthy engine's ``/v1/models``, or a 503."""
        for e in self.pool.engines:
            if e.healthy:
                try:
                    r = await self.pool.client.get(e.url + "/v1/models")
                except Exception:  # noqa: BLE001 - try the next engine
                    self.pool.suspect(e)
                    continue
                self.count("/v1/models", r.status_code)
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        self.count("/v1/models", 503)
        return ApiError(503, "no healthy engine to list models from", code="engine_unavailable").response()

    def health(self) -> dict[str, Any]:
        """``/health``'s body: ``ok`` while requests can be served (disaggregated: both kinds of engine), else ``degraded``."""
        pool, hop, s = self.pool, self.hop, self.settings
        up = sum(e.healthy for e in pool.engines)
        self.count("/health", 200)
        extra = {"prefill_engines": hop.pool.status()} if hop else {}
        serving = up and (hop is None or any(e.healthy for e in hop.pool.engines))
        return {"status": "ok" if serving else "degraded", "healthy_engines": up, "engines": pool.status(), **extra,
                "predictor_url": s.predictor_url,
                "predictor_target": self.target.current.as_dict(s.allow_predictor_for_other_model), "placement": s.placement,
                "placement_state": pool.placer.state(), "prompt_tokens": self.prompts.method}

    async def exposition(self) -> bytes:
        """``/metrics``: the gateway's metrics and, re-exported, each engine plug-in's that answered."""
        body = self.metrics.render()
        if self.plugin_targets:
            from serving.gateway.plugin_metrics import scrape

            extra, failed = await scrape(self.pool.client, self.plugin_targets)
            for name in failed:
                self.metrics.plugin_scrape_errors.labels(name).inc()
            body = self.metrics.render() + extra if failed else body + extra
        return body
