"""The lengthwise scheduler inside vLLM V1: the policy core decides, vLLM's own scheduler executes.

Load it with ``--scheduler-cls serving.engine.scheduler.LengthwiseScheduler`` (or
``scheduler_cls=...`` in ``vllm.LLM``/``EngineArgs``), configured through
``--additional-config '{"lengthwise": {"policy": "ecoserve", "knobs": {"padding": 0.15}}}'``
(see :mod:`serving.engine.settings`). Written against vLLM 0.32, whose scheduler interface is not
public: the levers below are pinned by tests that drive the real scheduler.

Each step:

1. **Mirror**: every request vLLM holds has a policy-core twin whose computed and generated token
   counts are copied from vLLM (so prefix-cache hits, vLLM's own preemptions and async placeholders
   are seen as they are, never assumed).
2. **Decide**: ``policy.schedule(now)`` returns the step plan: tokens per request in batch order,
   recompute preemptions, pauses.
3. **Apply through vLLM's levers**: the policy's preemptions go through ``_preempt_request``;
   running requests the plan leaves out (paused GTs, decoupled GTs waiting for their slot, held PTs)
   are skipped this step with ``next_decode_eligible_step``, keeping their KV; ``running`` is ordered
   held requests first, then the plan's batch order (who gets budget first), so vLLM's own victim
   when a block allocation fails (``running[-1]``; under vLLM's priority policy the largest
   ``(priority, arrival)``, so there priorities are set to the same ranks for the step) is the
   request the plan would let go first and never one it holds; ``waiting`` and
   ``kv_holding_waiting`` are presented holding only the requests the plan admits, in its order;
   the step's token budget is the plan's total.
4. **Execute**: ``AsyncScheduler.schedule()`` allocates blocks, handles chunking, prefix caching and
   async placeholders exactly as stock vLLM does; both waiting queues are merged back and priorities
   restored (nobody lost).
5. **Read back**: what vLLM actually scheduled updates the policy; a request vLLM preempted on its own
   is reported to the policy (``Policy.host_preempted``), which queues it again for recompute; finished
   and aborted requests leave the policy through ``_free_request``, the one place vLLM frees every
   request.

The policy's block ledger is sized to vLLM's pool, so its exact allocation and KVC pipelining are
reservations over vLLM's blocks: vLLM still allocates physical blocks on demand. Speculative decoding
is refused at start: the policy core advances a request by one token per step.

Refinements: a request the gateway tagged with a ``ref`` can get a sharper prediction while it runs (the
remaining-length predictor read its answer so far). The gateway posts it to the plug-in's own port
(:mod:`serving.engine.channel`); the adapter hands every waiting one to the policy (``Policy.refine``) before it
plans the next step, as a prediction of the whole length.

One rule of the adapter's own, for a vLLM defect rather than a scheduling choice: on an engine that serves LoRA
adapters, a step that prefills a request asking for prompt logprobs carries that request alone (:meth:`_alone`), since
vLLM 0.32 computes those logprobs with a LoRA mapping of one row per request and its engine core dies when another
request shares the step (:func:`serving.engine.levers.prompt_logprobs_pending`). Stock vLLM dies the same way.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

from serving.engine import levers as vllm_levers
from serving.engine.channel import RefinementInbox
from serving.engine.inputs import model_stop_ids, parse_inputs
from serving.engine.settings import SchedulerSettings
from serving.policy.base import Policy, StepPlan
from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy
from serving.policy.request import Request, after

logger = init_logger(__name__)


class LengthwiseScheduler(AsyncScheduler):
    """vLLM's AsyncScheduler, steered step by step by a lengthwise policy (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is not None:  # update() inside schedule() applies one token per request per step
            raise ValueError(f"lengthwise scheduler: speculative decoding ({spec.method}, {spec.num_speculative_tokens} "
                             "tokens per step) is not supported; drop --speculative-config, or run without --scheduler-cls")
        super().__init__(*args, **kwargs)
        self._lw_kv_queue = vllm_levers.kv_queue_name(self)
        if self._lw_kv_queue is None:
            import vllm

            raise RuntimeError(f"this vLLM ({vllm.__version__}) has a scheduler the lengthwise plug-in does not know (no "
                               "kv_holding_waiting queue); install vllm==0.32.0 (the cpu or gpu extra)")
        self.lw_settings = SchedulerSettings.from_vllm(self.vllm_config.additional_config)
        # the model's own end ids, which vLLM adds to every request's stop_token_ids (its front end read them the same way)
        self._lw_model_stops = model_stop_ids(self.vllm_config.model_config.try_get_generation_config())
        shape, self.lw_kv_blocks = vllm_levers.shape(self)
        budget = shape["max_num_batched_tokens"]
        cfg = PolicyConfig(**{**shape, "tfs": self.lw_settings.tfs or budget, **self.lw_settings.knobs})
        # lw_policy, not policy: vLLM's Scheduler keeps its own SchedulingPolicy there and its schedule() reads it
        self.lw_policy: Policy = make_policy(self.lw_settings.policy, cfg, self.lw_kv_blocks)
        self._rid_of: dict[str, int] = {}
        self._vreq_of: dict[int, VllmRequest] = {}
        self._ids = itertools.count()
        self.lw_stats: dict[str, float] = dict.fromkeys((
            "requests", "fallback_predictions", "invalid_inputs", "rejected", "finished", "aborted", "steps",
            "held_request_steps", "policy_preemptions", "vllm_preemptions", "vllm_preempted_held", "plan_mismatch_steps",
            "adapter_s", "alone_steps", "refinements_applied"), 0)
        self._lw_lora = shape["max_loras"] > 0  # LoRA on: see _alone
        self._last_log = time.monotonic()
        self.lw_inbox = RefinementInbox()
        self._ref_of: dict[int, str] = {}
        self.metrics_server = None
        if self.lw_settings.metrics_port:
            from serving.engine.channel import serve_plugin

            try:
                self.metrics_server = serve_plugin(self.lengthwise_stats, self.lw_inbox, self.lw_settings.metrics_port,
                                                   self.lw_settings.metrics_host)
            except OSError as exc:  # a busy port must not keep the engine from serving
                logger.error("lengthwise: plug-in port %s:%d unavailable (%s); counters stay in the log only, and no "
                             "refinement reaches this engine", self.lw_settings.metrics_host,
                             self.lw_settings.metrics_port, exc)
        logger.info("lengthwise scheduler: policy %s over %d KV blocks of %d tokens, budget %d, TFS %d",
                    self.lw_policy.name, self.lw_kv_blocks, cfg.block_size, budget, cfg.tfs)

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: VllmRequest) -> None:
        super().add_request(request)
        if request.request_id in self._rid_of or request.is_finished():
            return  # a streaming-input continuation of a request the policy already holds
        sp = request.sampling_params
        inputs = parse_inputs(sp.extra_args if sp is not None else None, arrival=request.arrival_time,
                              max_tokens=request.max_tokens, default_pred_len=self.lw_settings.default_pred_len,
                              sampling=sp, model_stops=self._lw_model_stops)
        self.lw_stats["requests"] += 1
        self.lw_stats["fallback_predictions"] += inputs.fallback_prediction
        if inputs.invalid:
            self.lw_stats["invalid_inputs"] += 1
            logger.warning("lengthwise: request %s: ignored malformed extra_args (%s); using the default prediction",
                           request.request_id, inputs.invalid)
        rid = next(self._ids)
        twin = Request(rid, request.arrival_time, request.num_prompt_tokens, inputs.prediction,
                       deadline=inputs.deadline, max_tokens=request.max_tokens, service=vllm_levers.service_of(request),
                       priority=inputs.priority, client=inputs.client, learnable=inputs.learnable)
        if inputs.fallback_prediction:  # the default length is nobody's prediction: no learner judges a predictor by it
            twin.extra["predicted"] = False
        try:
            self.lw_policy.add(twin, time.time())
        except ValueError as exc:  # cannot ever fit the KV pool: fail it now rather than hold it forever
            self.lw_stats["rejected"] += 1
            logger.error("lengthwise: request %s rejected: %s", request.request_id, exc)
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            return
        self._rid_of[request.request_id] = rid
        self._vreq_of[rid] = request
        if inputs.ref is not None:
            self._ref_of[rid] = inputs.ref
            self.lw_inbox.open(inputs.ref, rid)

    def _free_request(self, request: VllmRequest, delay_free_blocks: bool = False):
        rid = self._rid_of.pop(request.request_id, None)
        if rid is not None:
            del self._vreq_of[rid]
            if (ref := self._ref_of.pop(rid, None)) is not None:
                self.lw_inbox.close(ref, rid)
            aborted = vllm_levers.is_aborted(request)
            self.lw_policy.abort(rid, time.time(), completed=not aborted)  # either way it leaves every queue
            self.lw_stats["aborted" if aborted else "finished"] += 1
        return super()._free_request(request, delay_free_blocks)

    # -- the step --------------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        t0 = time.perf_counter()
        now = time.time()
        between = vllm_levers.preempted_between_steps(self)
        self._host_preempted(between, now)
        self._mirror()
        self._refine()
        plan = self._alone(self.lw_policy.schedule(now))
        levers = self._apply(plan)
        t1 = time.perf_counter()
        try:
            out = super().schedule(throttle_prefills)
        finally:
            t2 = time.perf_counter()
            vllm_levers.restore(self, self._lw_kv_queue, levers)
        actual = StepPlan(tokens={self._rid_of[k]: n for k, n in out.num_scheduled_tokens.items() if k in self._rid_of})
        if actual.tokens != plan.tokens:
            self.lw_stats["plan_mismatch_steps"] += 1
        by_vllm = set(out.preempted_req_ids or ()) - levers.preempted
        self.lw_stats["vllm_preemptions"] += len(by_vllm)
        self.lw_stats["vllm_preempted_held"] += len(by_vllm & levers.held_ids)
        self._host_preempted(by_vllm - between, now)
        self.lw_policy.update(actual, (), now)
        self.lw_stats["steps"] += 1
        self.lw_stats["adapter_s"] += (t1 - t0) + (time.perf_counter() - t2)
        if time.monotonic() - self._last_log >= self.lw_settings.log_every_s:
            self._log_stats()
        return out

    def _host_preempted(self, req_ids: set[str], now: float) -> None:
        """Tell the policy which requests vLLM preempted on its own, so it does not keep planning KV that is gone."""
        for req_id in req_ids:
            rid = self._rid_of.get(req_id)
            if rid is not None:
                self.lw_policy.host_preempted(rid, now)

    def _mirror(self) -> None:
        """Copy vLLM's truth into the policy's twins: computed tokens, and outputs including in-flight ones."""
        for rid, v in self._vreq_of.items():
            twin = self.lw_policy.requests.get(rid)
            if twin is not None:
                twin.computed, twin.generated = vllm_levers.counts(v)

    def _refine(self) -> None:
        """Hand the policy every refinement that came since the last step, as a prediction of the whole length."""
        for rid, update, _came in self.lw_inbox.take():
            v = self._vreq_of.get(rid)
            if v is None:
                continue
            pred = after(update.generated_tokens, update.pred_len, update.pred_edges, update.pred_probs, v.max_tokens)
            self.lw_stats["refinements_applied"] += self.lw_policy.refine(rid, pred)

    def _alone(self, plan: StepPlan) -> StepPlan:
        """With LoRA on, the plan cut to its first request whose prompt logprobs are still to be computed, if any (the
        module docstring says why); the others wait a step, keeping their KV. The policy reads what ran."""
        if not self._lw_lora or len(plan.tokens) < 2:
            return plan
        for rid, n in plan.tokens.items():
            if vllm_levers.prompt_logprobs_pending(self._vreq_of[rid]):
                self.lw_stats["alone_steps"] += 1
                return StepPlan(tokens={rid: n}, preempted=plan.preempted, paused=plan.paused)
        return plan

    def _apply(self, plan: StepPlan) -> vllm_levers.Levers:
        """This step's plan through vLLM's levers (:func:`serving.engine.levers.apply`)."""
        preempt = [v for rid in plan.preempted if (v := self._vreq_of.get(rid)) is not None]
        levers = vllm_levers.apply(self, self._lw_kv_queue, preempt, [self._vreq_of[rid] for rid in plan.tokens],
                                   sum(plan.tokens.values()))
        self.lw_stats["policy_preemptions"] += len(levers.preempted)
        self.lw_stats["held_request_steps"] += len(levers.held)
        return levers

    def shutdown(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
            self.metrics_server = None
        super().shutdown()

    # -- stats -----------------------------------------------------------------------------------
    def lengthwise_stats(self) -> dict[str, float]:
        """Counters for the engine log and the gateway's /metrics: the policy's and the adapter's own."""
        steps = max(1, self.lw_stats["steps"])
        p = self.lw_policy.stats
        return {
            **self.lw_stats, "policy": self.lw_policy.name, "ledger_blocks_used": self.lw_policy.kv.used,
            "ledger_blocks_total": self.lw_policy.kv.total, "pauses": p["pauses"], "hosted": p["hosted"],
            "policy_sched_us_per_step": p["sched_s"] / steps * 1e6,
            "adapter_us_per_step": self.lw_stats["adapter_s"] / steps * 1e6,
            "live": len(self._vreq_of), **self.lw_inbox.counts,
            **{f"policy_{k}": v for k, v in p.items() if k not in ("sched_s", "pauses", "hosted", "preemptions")},
        }

    def _log_stats(self) -> None:
        self._last_log = time.monotonic()
        s = self.lengthwise_stats()
        logger.info(
            "lengthwise[%s]: live %d, ledger %d/%d blocks, preemptions policy %d vllm %d (of held %d), pauses %d, "
            "hosted %d, fallback predictions %d/%d, plan mismatches %d/%d steps, scheduling %.0f+%.0f us/step",
            s["policy"], s["live"], s["ledger_blocks_used"], s["ledger_blocks_total"], s["policy_preemptions"],
            s["vllm_preemptions"], s["vllm_preempted_held"], s["pauses"], s["hosted"], s["fallback_predictions"], s["requests"],
            s["plan_mismatch_steps"], s["steps"], s["policy_sched_us_per_step"], s["adapter_us_per_step"])


__all__ = ["LengthwiseScheduler"]
