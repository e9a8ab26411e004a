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
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from serving.gateway.admission import Admission, OverShare, Slot
from serving.gateway.auth import KeyCheck
from serving.gateway.engine_defects import prompt_logprobs_field, refuse_masked_grammar, refuse_prompt_logprobs
from serving.gateway.errors import ApiError
from serving.gateway.feedback import FeedbackPoster
from serving.gateway.forward import Forwarder, Outcome, then_run
from serving.gateway.hints import engine_body
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.model_predictors import ModelPredictors
from serving.gateway.pool import EnginePool
from serving.gateway.prediction import LengthPrediction, Predictor
from serving.gateway.prefill import Prefilled, PrefillHop
from serving.gateway.quarantine import CrashQuarantine, Fingerprint, fingerprint
from serving.gateway.redact import hide_deployment, model_card
from serving.gateway.refine import Refiner
from serving.gateway.requests import PATHS, ClientRequest, Kind, parse_json
from serving.gateway.requests import validate as validate_request
from serving.gateway.settings import GatewaySettings
from serving.gateway.shaping import shaped_by
from serving.gateway.slo import TPOT_HEADER, TTFT_HEADER, client_slo, default_slo
from serving.gateway.slo import deadline as slo_deadline
from serving.gateway.target import TargetCheck, TargetWatch, served_model
from serving.gateway.target import check as check_target
from serving.gateway.tokens import PromptCounter, fits_context
from serving.placement import Job

log = logging.getLogger("serving.gateway")
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}
LARGE_BODY = 64 << 10  # bodies past this are parsed and checked off the event loop (about a millisecond of work)
PRED_LEN_HEADER = "x-lengthwise-pred-len"  # a trusted client's own prediction (--trust-client-predictions)
# a prediction that fell back for one of these reasons says the sidecar is down: its state for /health
SIDECAR_DOWN = {"unreachable": "unreachable", "timeout": "slow", "sidecar_error": "error"}

# How the adapter awaits an answer (a stream: until its first event): the answer, or None when the client left first
# (the call is cancelled).
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
    slot: Slot | None = None  # its place among the requests in flight (admission), released when it ends
    client: str | None = None  # which of several client keys sent it (key-<i>): the sidecar caps one key's feedback
    fingerprint: Fingerprint | None = None  # its identity and kind, charged when an engine dies under it (quarantine)

    @property
    def endpoint(self) -> str:
        return PATHS[self.kind]


class Gateway:
    """The engines (decode and, disaggregated, prefill), the predictor, feedback and metrics, and the steps over them.

    ``engine_urls`` default to ``settings.engine_urls`` and ``prefill_urls`` to ``settings.prefill_urls``; engines must
    already be starting or up; ``engines`` are their processes where this command started them (watched, and started
    again when one exits while serving: :mod:`serving.launch.supervise`). ``plugin_metrics`` maps an engine URL to its
    scheduler plug-in's metrics URL, re-exported on ``/metrics``. ``predictor_target`` is the command line's verdict on
    the sidecar's target model, already announced (:mod:`serving.gateway.target`); without one the gateway checks at
    :meth:`start`. ``serves`` (a catalogue's) maps an engine URL to the names placed on it, where its entry lays a name
    on some of its engines only. Nothing is contacted before :meth:`start`; :meth:`aclose` releases what it holds.
    """

    def __init__(self, settings: GatewaySettings, engine_urls: list[str] | None = None,
                 plugin_metrics: dict[str, str] | None = None, prefill_urls: list[str] | None = None,
                 predictor_target: TargetCheck | None = None, model_targets: dict[str, TargetCheck] | None = None,
                 serves: dict[str, list[str]] | None = None, engines: list | None = None) -> None:
        self.settings = settings
        self.metrics = metrics = GatewayMetrics()
        self.engine_procs, self.supervisor = engines, None  # the processes started here, and their watcher
        self.quarantine = CrashQuarantine(settings.crash_quarantine_s)
        self.pool = EnginePool(engine_urls or settings.engine_urls, settings, metrics, serves=serves)
        self.predictor = Predictor(settings.predictor_url, settings.predictor_timeout_ms, settings.fallback_tokens, metrics,
                                   settings.keepalive_s)
        self.feedback = FeedbackPoster(settings.predictor_url if settings.feedback else None, metrics,
                                      keepalive_s=settings.keepalive_s)
        for client in (self.predictor.client, self.feedback.client):
            if client is not None:
                self._sidecar_client(client)
        cat = settings.catalogue
        # with a catalogue, each name's own predictor: a sidecar's (checked per name), its profile, or none
        self.model_predictors = (ModelPredictors(cat, settings, metrics, self.predictor, self.feedback, model_targets,
                                                 self._sidecar_client) if cat is not None else None)
        self.forwarder = Forwarder(self.pool, settings, metrics, self.quarantine)
        prefill_urls = prefill_urls or settings.prefill_urls
        self.hop = (PrefillHop(EnginePool(prefill_urls, settings, metrics, prefill=True), settings, metrics) if prefill_urls
                    else None)
        names = {e.url: e.name for e in [*self.pool.engines, *(self.hop.pool.engines if self.hop else [])]}
        self.plugin_targets = {names[u]: m for u, m in (plugin_metrics or {}).items() if u in names}
        # refined predictions of running requests, posted to the plug-in port beside each engine's metrics
        self.refiner = (Refiner(settings, metrics, self.plugin_targets, settings.sidecar_headers())
                        if settings.refine_at and settings.predictor_url else None)
        self.forwarder.refiner = self.refiner
        self.slo = default_slo(settings)
        # each catalogue model's own (TTFT, TPOT) terms, where it sets them (--models)
        self.model_terms = {m.name: m.slo.terms() for m in (settings.catalogue.models if settings.catalogue else [])}
        self.model_priority = {m.name: m.priority for m in (settings.catalogue.models if settings.catalogue else [])}
        self.prompts = PromptCounter()
        # with a catalogue, each base started here from a local directory counts its own prompts (its adapters share it)
        self.model_prompts = ({m.name: PromptCounter() for m in cat.models if m.starts_engines} if cat is not None else {})
        self.rids = itertools.count()
        self._tokenizer: asyncio.Task | None = None
        served = served_model(settings)
        if predictor_target is None and not settings.predictor_url:
            predictor_target = TargetCheck("unchecked", served, detail="no --predictor-url: no predictor to check")
        elif predictor_target is None and cat is not None:
            predictor_target = TargetCheck("unchecked", None, detail="with --models each name is checked on its own "
                                           "(/health models)")
        self.target = TargetWatch(served, settings.allow_predictor_for_other_model, metrics.predictor_target_mismatch.set,
                                  predictor_target)
        self._target_task: asyncio.Task | None = None
        self._sidecar_task: asyncio.Task | None = None
        self.keys = KeyCheck(settings.client_keys(), settings.protect_health)
        self.urgent = KeyCheck(settings.slo_keys())  # the keys whose x-slo-* headers count (with keys enabled)
        limit = settings.outstanding_bounds(len(self.pool.engines))[1]
        self.admission = Admission(limit, metrics.inflight.set, settings.key_share(limit, self.keys.count))
        if settings.max_outstanding_per_key is not None and not self.keys.enabled:
            log.warning("--max-outstanding-per-key bounds each client key, and this gateway has none: no bound per key")
        # the sidecar as last seen: by its /ready (every health_interval_s) and by each prediction
        self.predictor_state: tuple[str, str] = (("unchecked", "not probed yet") if settings.predictor_url
                                                 else ("none", "no --predictor-url: every request runs on the fallback"))

    # --- life ------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the tokenizer and watch the predictor's target model in the background, and take in the engines (the
        CLI waited for their /health)."""
        s, hop = self.settings, self.hop
        loads = [self.prompts.load(s.model)]
        if s.catalogue is not None:
            loads += [counter.load(s.catalogue.entry(name).model) for name, counter in self.model_prompts.items()]
        self._tokenizer = asyncio.ensure_future(asyncio.gather(*loads))
        if s.predictor_url or (self.model_predictors is not None and self.model_predictors.checked):
            self._target_task = asyncio.get_running_loop().create_task(self._watch_target())
        if s.predictor_url:
            self._sidecar_task = asyncio.get_running_loop().create_task(self._watch_sidecar())
        await asyncio.gather(self.pool.start(), *([hop.pool.start()] if hop else []))
        if self.engine_procs and s.engine_restarts > 0:
            self._supervise(self.engine_procs)
        if s.model and self.pool.models and s.model not in self.pool.models:
            log.warning("--model %s is not among the models the engines serve (%s)", s.model, ", ".join(sorted(self.pool.models)))
        log.info("gateway ready: %d engine(s)%s, predictor %s, placement %s, prompt tokens: %s", len(self.pool.engines),
                 f" decoding after {len(hop.pool.engines)} prefill engine(s)" if hop else "",
                 s.predictor_url or "none (fallback only)", s.placement, self.prompts.method)

    async def _watch_target(self) -> None:
        """Check which model the sidecar's predictor is for now (unless the command line just did), then every
        ``predictor_check_interval_s``: a sidecar that was down at start, or whose alias moved, is judged when it
        answers. With a catalogue, each sidecar-predicted name's verdict too."""
        checked = self.target.current.state != "unchecked" and not self.target.current.pending
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=self.settings.sidecar_headers()) as client:
            while True:
                if not checked and self.settings.predictor_url and self.model_predictors is None:
                    self.target.update(await check_target(self.settings.predictor_url, self.target.served, client))
                if self.model_predictors is not None:
                    await self.model_predictors.recheck(client)
                checked = False
                await asyncio.sleep(self.settings.predictor_check_interval_s)

    def _supervise(self, procs: list) -> None:
        """Watch the engines started here; one that exits while serving is taken out at once, started again within the
        restart budget, and probed back in at its new address (:mod:`serving.launch.supervise`). The watcher's thread
        hands each event to the event loop."""
        from serving.launch.supervise import EngineSupervisor, RestartBudget

        s, loop = self.settings, asyncio.get_running_loop()
        pools = [self.pool, *([self.hop.pool] if self.hop else [])]
        # by address: with a catalogue the processes and the pool's engines are numbered differently (attached ones too)
        where = {e.url: (pool, e) for pool in pools for e in pool.engines}

        def exited(p, status: int | None) -> None:
            if p.url in where:
                pool, e = where[p.url]
                pool.exited(e, status)

        def back(old, new) -> None:
            if old.url in where:
                pool, e = where[new.url] = where.pop(old.url)
                pool.relocate(e, new.url)
                if new.metrics_url and e.name in self.plugin_targets:
                    self.plugin_targets[e.name] = new.metrics_url
                pool.suspect_down(e)

        def gave_up(p, why: str) -> None:
            if p.url in where:
                pool, e = where[p.url]
                pool.stays_down(e, why)

        def dead(e) -> None:  # its process may take its time to exit: stop it now, so it starts again at once
            if self.supervisor is not None and e.url in where:
                loop.run_in_executor(None, self.supervisor.stop_dead, e.url, e.restarting)

        self.supervisor = EngineSupervisor(
            procs, RestartBudget(s.engine_restarts, s.engine_restart_window_s, start_timeout_s=s.engine_start_timeout_s),
            on_exit=lambda p, rc: loop.call_soon_threadsafe(exited, p, rc),
            on_back=lambda old, new: loop.call_soon_threadsafe(back, old, new),
            on_give_up=lambda p, why: loop.call_soon_threadsafe(gave_up, p, why)).start()
        for pool in pools:
            pool.on_dead = dead

    def _sidecar_client(self, client: httpx.AsyncClient) -> None:
        """The sidecar's token on every call to it, predictions and feedback (``--predictor-token``)."""
        client.headers.update(self.settings.sidecar_headers())

    async def _watch_sidecar(self) -> None:
        """Ask the sidecar's ``/ready`` every ``health_interval_s``, so ``/health`` says within a second or two that
        requests run on the fallback length because the sidecar is down or has no model, even with no traffic."""
        s = self.settings
        async with httpx.AsyncClient(timeout=httpx.Timeout(s.health_timeout_s), headers=s.sidecar_headers()) as client:
            while True:
                try:
                    r = await client.get(s.predictor_url + "/ready")
                    found = (("ok", "the sidecar is ready") if r.status_code == 200 else
                             ("loading", "the sidecar has no model loaded yet (/ready: 503)") if r.status_code == 503 else
                             ("error", f"the sidecar's /ready answered {r.status_code}"))
                except httpx.HTTPError as exc:
                    found = ("unreachable", f"the sidecar at {s.predictor_url} did not answer ({type(exc).__name__})")
                self._sidecar_seen(*found)
                await asyncio.sleep(s.health_interval_s)

    def _seen_by(self, pred: LengthPrediction) -> None:
        """What one prediction says of ``--predictor-url``'s sidecar: it answers, or why not."""
        if pred.source == "sidecar":
            self._sidecar_seen("ok", "the sidecar answers predictions")
        elif pred.reason in SIDECAR_DOWN:
            self._sidecar_seen(SIDECAR_DOWN[pred.reason], f"a prediction fell back: {pred.reason}")

    def _sidecar_seen(self, state: str, detail: str) -> None:
        if state != self.predictor_state[0]:
            (log.info if state == "ok" else log.warning)("predictor sidecar %s: %s", state, detail)
        self.predictor_state = (state, detail)
        self.metrics.predictor_up.set(1.0 if state == "ok" else 0.0)

    async def aclose(self) -> None:
        if self.supervisor is not None:  # before the command stops its engines: none is started again
            await asyncio.to_thread(self.supervisor.stop)
        for task in (self._tokenizer, self._target_task, self._sidecar_task):
            if task is not None:
                task.cancel()
        for counter in (self.prompts, *self.model_prompts.values()):
            counter.close()
        await self.feedback.aclose()
        await self.pool.aclose()
        await self.forwarder.aclose()
        if self.hop:
            await self.hop.aclose()
        await self.predictor.aclose()
        if self.refiner is not None:
            await self.refiner.aclose()
        if self.model_predictors is not None:
            await self.model_predictors.aclose()

    def count(self, endpoint: str, status: int) -> None:
        """One answered HTTP request, by endpoint (``other`` for unknown paths) and status."""
        self.metrics.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(status)).inc()

    # --- one request: the path ----------------------------------------------------------------------
    async def serve(self, call: Call, raw: bytes, headers: Mapping[str, str], wait: Waiter) -> Response:
        """The answer to the request whose body is ``raw``; ``wait`` awaits the answer (see :data:`Waiter`).

        Raises ApiError from whichever step refuses the request; the caller answers it with :meth:`refused`.
        """
        slot = call.slot = self.admit(self.keys.which(headers) if self.admission.share is not None else None)
        resp: Response | None = None
        try:
            resp = await self._steps(call, raw, headers, wait)
        finally:
            if not isinstance(resp, StreamingResponse):  # a stream stays in flight until its last event went out
                slot.release()
        if isinstance(resp, StreamingResponse):  # finished() releases it; this covers a stream never iterated
            resp.background = then_run(resp.background, slot.release)
        return self.client_left(call) if resp is None else self.decorate(call, resp)

    async def _steps(self, call: Call, raw: bytes, headers: Mapping[str, str], wait: Waiter) -> Response | None:
        req = await self.validated(call.kind, raw)
        call.client = self.client_of(headers)
        self.refuse_engine_defects(req)
        call.fingerprint = self.unquarantined(req)
        if call.slot is not None and req.sequences > 1:
            self.widen(call.slot, req)
        terms = self.slo_terms(headers, req.model)
        await self.measured(call, req)
        pred = await self.predict(call, req, headers)
        body = self.hints(call, req, pred, self.deadline(call, pred, terms))
        forwarded = self.engine_headers(call, headers)
        job = self.job(call, req, pred)
        if self.hop:
            prefilled = await self.prefill(call, req, body, forwarded, job)
            if isinstance(prefilled, Response):  # the prefill engine refused the request: its answer is the client's
                return prefilled
            body = prefilled.body
        return await self.forward(call, req, body, forwarded, job, wait)

    # --- the steps ------------------------------------------------------------------------------------
    def authorize(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        """A 401 (ApiError) for a call that needs an API key and does not carry one (:mod:`serving.gateway.auth`)."""
        try:
            self.keys.check(method, path, headers)
        except ApiError:
            self.metrics.rejected.labels("unauthorized").inc()
            raise

    def client_of(self, headers: Mapping[str, str]) -> str | None:
        """``key-<i>`` for the i-th client key (:meth:`~serving.gateway.settings.GatewaySettings.client_keys`), when
        there are several to tell apart; None otherwise. It goes with the answer's feedback, never the key itself."""
        if self.keys.count < 2:
            return None
        index = self.keys.which(headers)
        return None if index is None else f"key-{index}"

    def admit(self, key: int | None = None) -> Slot:
        """The request's place among those in flight, or a 429 at once (:mod:`serving.gateway.admission`); ``key`` is
        the client key's index where each key holds at most its share."""
        try:
            return self.admission.admit(key)
        except ApiError as exc:
            self.metrics.rejected.labels("key_share" if isinstance(exc, OverShare) else "overload").inc()
            raise

    def widen(self, slot: Slot, req: ClientRequest) -> None:
        """A request holds a place in flight for each sequence it puts on the engines, n for each prompt (a 429 when
        they do not fit now, a 400 when they never could)."""
        try:
            self.admission.widen(slot, req.sequences, *req.sequences_told())
        except ApiError as exc:
            reason = "key_share" if isinstance(exc, OverShare) else "too_many_sequences" if exc.status == 400 else "overload"
            self.metrics.rejected.labels(reason).inc()
            raise

    def validate(self, kind: Kind, raw: bytes) -> ClientRequest:
        """The body as a checked request for the models served: the catalogue's names (``--models``), else those the
        engines list (none known yet: any model)."""
        cat = self.settings.catalogue
        served = set(cat.names) if cat is not None else self.pool.models
        try:
            return validate_request(kind, parse_json(raw), served, self.settings.max_n, self.settings.max_messages)
        except ApiError as exc:
            if exc.param in ("n", "best_of") and exc.code == "invalid_value":
                self.metrics.rejected.labels("too_many_n").inc()
            raise

    async def validated(self, kind: Kind, raw: bytes) -> ClientRequest:
        """:meth:`validate`, in a worker thread for a large body: parsing and checking megabytes (up to
        ``max_body_bytes``) would hold the event loop, and every other client, for as long."""
        if len(raw) <= LARGE_BODY:
            return self.validate(kind, raw)
        return await asyncio.to_thread(self.validate, kind, raw)

    def refuse_engine_defects(self, req: ClientRequest) -> None:
        """A 400 for what the engines' vLLM is known to fail on (:mod:`serving.gateway.engine_defects`): allowed tokens
        beside a grammar, and prompt logprobs for a model an engine serving LoRA adapters serves (unless the operator
        allowed them)."""
        try:
            refuse_masked_grammar(req.body)
        except ApiError:
            self.metrics.rejected.labels("engine_defect").inc()
            raise
        if self.settings.allow_prompt_logprobs_with_lora or (field := prompt_logprobs_field(req.kind, req.body)) is None:
            return
        if any(e.lora and (not e.models or req.model in e.models) for e in self.pool.engines):
            self.metrics.rejected.labels("engine_defect").inc()
            raise refuse_prompt_logprobs(field, req.model)

    def unquarantined(self, req: ClientRequest) -> Fingerprint:
        """The request's fingerprint, or a 400 while it (or its kind) is refused for taking engines down
        (:mod:`serving.gateway.quarantine`)."""
        fp = fingerprint(req.kind, req.model, req.body)
        try:
            self.quarantine.check(fp)
        except ApiError:
            self.metrics.rejected.labels("quarantined").inc()
            raise
        return fp

    def slo_terms(self, headers: Mapping[str, str], model: str | None = None) -> tuple[float | None, float | None]:
        """The client's own (TTFT, TPOT) in seconds from ``x-slo-ttft-ms``/``x-slo-tpot-ms``, moved into
        [``slo_min_ms``, ``slo_max_ms``] (counted); a malformed one is a 400. With client keys, only the keys of
        ``slo_key_file`` may set them: anyone else's are ignored (counted), and the request keeps the default SLO.
        A term the client leaves out is the ``model``'s catalogue SLO term, where it has one."""
        s = self.settings
        own = self.model_terms.get(model or "", (None, None))
        if self.keys.enabled and (TTFT_HEADER in headers or TPOT_HEADER in headers) and not self.urgent.allows(headers):
            self.metrics.slo_ignored.inc()
            return own
        ttft, tpot = client_slo(headers, (s.slo_min_ms, s.slo_max_ms),
                                lambda header, bound: self.metrics.slo_clamped.labels(header, bound).inc())
        return (own[0] if ttft is None else ttft), (own[1] if tpot is None else tpot)

    def measure(self, call: Call, req: ClientRequest, counted: tuple[int, int, str] | None = None) -> None:
        """Count the prompt's tokens (each prompt once, whatever ``n``; ``counted``: already counted, see :meth:`measured`)
        and refuse, before any prediction is asked for, a prompt the engines' context cannot hold (a 400, as the engine
        would answer, minus the sidecar call)."""
        total, longest, method = counted or self.counter(req.model).measure(req)
        call.prompt_tokens, call.method = total, method
        context = self.pool.context(req.model)
        if context is not None and not fits_context(longest, method, req.max_tokens, context):
            self.metrics.rejected.labels("context_length").inc()
            asked = f" and {req.max_tokens} output tokens" if req.max_tokens and method != "estimate" else ""
            raise ApiError(400, f"this model's context is {context} tokens; the prompt has "
                           f"{'about ' if method == 'estimate' else ''}{longest}{asked}; shorten it", param="messages"
                           if req.kind == "chat" else "prompt", code="context_length_exceeded")
        if self.settings.log_prompts:
            log.info("request %s: prompt %r", call.rid, (req.predict_input or {}))

    async def measured(self, call: Call, req: ClientRequest) -> None:
        """:meth:`measure`, with the tokenizer's work off the event loop."""
        self.measure(call, req, await self.counter(req.model).measure_off_loop(req))

    def counter(self, model: str) -> PromptCounter:
        """What counts ``model``'s prompts: its catalogue base's tokenizer where one was started here, else the gateway's
        (``--model``'s, or the estimate)."""
        cat = self.settings.catalogue
        return self.model_prompts.get(cat.base_of(model), self.prompts) if cat is not None else self.prompts

    async def predict(self, call: Call, req: ClientRequest, headers: Mapping[str, str]) -> LengthPrediction:
        """The predicted length: a trusted client's header, else the sidecar's, else the fallback (never an error but
        a malformed trusted header). A sidecar whose predictor is for another model is not asked, unless the operator
        allowed it (then each of its predictions is counted)."""
        hint = headers.get(PRED_LEN_HEADER) if self.settings.trust_client_predictions else None
        route = self.model_predictors.route(req.model) if self.model_predictors is not None else None
        predictor, target = (route.predictor, route.target) if route and route.kind == "sidecar" else (self.predictor,
                                                                                                      self.target)
        assert predictor is not None and target is not None
        if hint is not None:
            pred = self.predictor.from_client(req, hint)
        elif route is not None and route.kind == "profile":
            pred = self.model_predictors.profile.predict(req)
        elif route is not None and route.kind == "none":
            pred = self.predictor.fallback(req, "disabled")
        elif target.refuses:
            pred = self.predictor.fallback(req, "other_model")
        else:
            pred = await predictor.predict(req, call.rid)
            if pred.source == "sidecar" and target.other_model:
                self.metrics.other_model_predictions.inc()
            if predictor is self.predictor:  # a name's own sidecar shows in its verdict (/health models[...])
                self._seen_by(pred)
        context = self.pool.context(req.model)
        if req.max_tokens is None and context is not None and pred.tokens > context:
            pred = dataclasses.replace(pred, tokens=context)  # no answer is longer than the context
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
        ref = call.rid if self.refiner is not None else None  # the id a refinement names the request by in its engine
        body, dropped = engine_body(req, pred, dl, self.model_priority.get(req.model, 0), call.client, ref)
        if dropped:
            self.metrics.client_hints_dropped.inc(len(dropped))
            log.debug("request %s: client vllm_xargs %s replaced by the gateway's", call.rid, dropped)
        return body

    def engine_headers(self, call: Call, headers: Mapping[str, str]) -> dict[str, str]:
        """What goes to the engine besides the body: our request id, and the client's credentials where the gateway
        has no keys of its own (neither --api-key nor --engine-api-key)."""
        out = {"X-Request-Id": call.rid}
        # the client's key is the gateway's to check, never the engines' to see; and an engine key (the engine clients'
        # own header) is not to be replaced by whatever the client sent
        if "authorization" in headers and not self.keys.enabled and self.settings.engine_api_key is None:
            out["Authorization"] = headers["authorization"]
        return out

    def job(self, call: Call, req: ClientRequest, pred: LengthPrediction) -> Job:
        """The request as placement sees it: the KV of its sequences' prompts (each of the ``n`` sequences holds its
        prompt) and its predicted output tokens."""
        if call.prompt_tokens is None:
            self.measure(call, req)
        assert call.prompt_tokens is not None and call.method is not None
        self.metrics.prompt_token_counts.labels(call.method).inc()
        return Job(next(self.rids), call.prompt_tokens * req.width, float(pred.tokens * req.outputs), arrival=time.monotonic())

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
        """Place and send the request (retried elsewhere while the client saw nothing); None when the client left before
        its answer (a stream: before its first event)."""
        # a stream too, until its first event: before that nothing is sent that would notice the client leave (once
        # the stream is returned, Starlette's own watch cancels the relay)
        return await wait(self.forwarder.forward(req, body, headers, job, functools.partial(self.finished, call, req),
                                                 call.fingerprint))

    def finished(self, call: Call, req: ClientRequest, out: Outcome) -> None:
        """The answer is complete (streams: after the last event): metrics, and the actual length to the sidecar."""
        self.count(call.endpoint, out.status)
        if call.slot is not None:
            call.slot.release()
        m, elapsed = self.metrics, time.perf_counter() - call.t0
        m.latency.labels(call.endpoint).observe(elapsed)
        m.model_requests.labels(req.model, str(out.status)).inc()
        m.model_latency.labels(req.model).observe(elapsed)
        if out.status == 200 and call.deadline is not None:
            m.model_deadlines.labels(req.model, "met" if time.time() <= call.deadline else "missed").inc()
        if out.first_token_at is not None:
            m.ttft.labels(call.endpoint).observe(out.first_token_at - call.t0)
        if out.status == 200 and out.completion_tokens is not None:
            m.output_tokens.inc(out.completion_tokens)
            m.model_output_tokens.labels(req.model).inc(out.completion_tokens)
            assert call.pred is not None
            route = self.model_predictors.route(req.model) if self.model_predictors is not None else None
            watch = route.target if route is not None and route.target is not None else self.target
            target = watch.current.target or {}
            reason = shaped_by(req.body, target.get("sampling"))
            if route is not None and route.kind == "profile":  # it learns by the same rules (serving/policy/learnable.py)
                self.model_predictors.profile.learn(req.model, out.completion_tokens, req.outputs, out.finish_reason,
                                                    reason, call.client)
            if reason is not None:  # the client decided the length, not the model: no truth about the predictor
                self.metrics.feedback_withheld.labels(reason).inc()
                return
            poster = route.feedback if route is not None and route.feedback is not None else self.feedback
            poster.submit(call.pred, out.completion_tokens, req.outputs, out.finish_reason, call.client)

    def decorate(self, call: Call, resp: Response) -> Response:
        """The engine's response with the headers that say what the gateway decided."""
        pred = call.pred
        assert pred is not None and call.deadline is not None
        resp.headers.update({
            "x-lengthwise-request-id": call.rid, "x-lengthwise-pred-len": str(pred.tokens),
            "x-lengthwise-prediction": pred.label,
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
        """Every model the healthy engines serve, each once, in vLLM's own cards (an adapter's names its ``parent``),
        listed afresh from each engine, without the directories they were loaded from (``root`` is the served name:
        :func:`~serving.gateway.redact.model_card`); or a 503 when none answers."""
        cards: dict[str, dict] = {}
        for e in self.pool.engines:
            if e.healthy:
                try:
                    r = await self.pool.client.get(e.url + "/v1/models")
                    r.raise_for_status()
                    listed = r.json()["data"]
                except Exception:  # noqa: BLE001 - the others still list theirs
                    self.pool.suspect(e)
                    continue
                for card in listed:
                    if isinstance(card, dict) and isinstance(card.get("id"), str):
                        cards.setdefault(card["id"], model_card(card))
        if not cards:
            self.count("/v1/models", 503)
            return ApiError(503, "no healthy engine to list models from", code="engine_unavailable").response()
        self.count("/v1/models", 200)
        return JSONResponse({"object": "list", "data": list(cards.values())})

    def health(self, headers: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``/health``'s body (see :meth:`health_status` for its HTTP status).

        ``status`` is ``ok`` only while every part works: an engine is up (disaggregated: a prefill engine too), and a
        configured sidecar answers with a predictor for the served model. Anything less is ``degraded`` and
        ``reasons`` says what: requests are still served, on the fallback length when the predictor is the part missing.

        Where the engines listen (their and the sidecar's URLs) is told only to a caller with a key, or by a gateway
        without keys: ``/health`` stays open to probes that carry none, and an address is where an attack starts. To a
        caller without one, no URL, host address or file path shows anywhere in the body, reasons and details included
        (:func:`~serving.gateway.redact.hide_deployment`).
        """
        pool, hop, s = self.pool, self.hop, self.settings
        up = sum(e.healthy for e in pool.engines)
        reasons = []
        if not up:
            reasons.append(f"no healthy engine (all {len(pool.engines)} are down)")
        if hop is not None and not any(e.healthy for e in hop.pool.engines):
            reasons.append(f"no healthy prefill engine (all {len(hop.pool.engines)} are down)")
        state, detail = self.predictor_state
        if state not in ("ok", "none", "unchecked"):
            reasons.append(f"predictor {state}: {detail}; requests run on the fallback length")
        if self.target.refuses:
            reasons.append(f"predictor for another model: {self.target.current.detail}; requests run on the fallback length")
        models = self.model_health()
        refused = self.model_predictors.refused() if self.model_predictors is not None else []
        if refused:
            reasons.append(f"predictor for another model for {', '.join(refused)}: their requests run on the fallback "
                           "length (/health models[...].predictor says why)")
        down = [name for name, m in models.items() if not m["healthy_engines"]]
        for e in [*pool.engines, *(hop.pool.engines if hop else [])]:
            if e.restarting:
                reasons.append(f"{e.name} {e.restarting} and is starting again")
            elif e.down_for_good:
                reasons.append(f"{e.name} stays down: {e.down_for_good}")
        if down and up:
            reasons.append(f"no healthy engine serves {', '.join(down)} (their requests get 503; the other models are "
                           "served)")
        shown = not self.keys.enabled or (headers is not None and self.keys.allows(headers))

        def engines(p: EnginePool) -> list[dict[str, Any]]:
            return [e if shown else {k: v for k, v in e.items() if k != "url"} for e in p.status()]

        extra = {"prefill_engines": engines(hop.pool)} if hop else {}
        body = {"status": "degraded" if reasons else "ok", "reasons": reasons, "healthy_engines": up,
                "engines": engines(pool), **extra, **({"models": models} if models else {}),
                "predictor_url": s.predictor_url if shown else None,
                "predictor": {"state": state, "detail": detail},
                "predictor_target": self.target.current.as_dict(s.allow_predictor_for_other_model), "placement": s.placement,
                "placement_state": pool.placer.state(), "prompt_tokens": self.prompts.method,
                "engine_restarts": sum(e.restarts for e in pool.engines), "quarantine": self.quarantine.state(),
                "inflight": self.admission.inflight, "inflight_peak": self.admission.peak,
                "max_outstanding": self.admission.limit, "max_outstanding_per_key": self.admission.share}
        self.count("/health", self.health_status(body))
        return body if shown else hide_deployment(body)

    def model_health(self) -> dict[str, dict[str, Any]]:
        """Per catalogue model (``--models``; empty without one): the engines that serve it (as their model lists
        said) and how many of them are healthy."""
        cat = self.settings.catalogue
        if cat is None:
            return {}
        out = {}
        predictors = self.model_predictors.health() if self.model_predictors is not None else {}
        for name in cat.names:
            mine = [e for e in self.pool.engines if name in e.models]
            out[name] = {"engines": [e.name for e in mine], "healthy_engines": sum(e.healthy for e in mine),
                         "prompt_tokens": self.counter(name).method, "predictor": predictors[name],
                         "priority": cat.entry(name).priority,
                         **({"adapter_of": cat.base_of(name)} if cat.base_of(name) != name else {})}
        return out

    def health_status(self, body: dict[str, Any]) -> int:
        """200 while requests can be served, degraded or not; 503 when no engine can serve one (a load balancer then
        sends traffic elsewhere; a degraded predictor is no reason to: the fallback length still serves)."""
        serving = body["healthy_engines"] and (self.hop is None or any(e.healthy for e in self.hop.pool.engines))
        return 200 if serving else 503

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
