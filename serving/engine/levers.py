"""Every vLLM scheduler internal the plug-in reads or sets, in one module: a vLLM upgrade is this module's work.

vLLM's V1 scheduler has no public interface for a plug-in that decides each step; the levers the plug-in pulls are
attributes and methods of ``vllm.v1.core.sched.scheduler.Scheduler`` and ``vllm.v1.request.Request`` that vLLM may
rename in any release. :class:`~serving.engine.scheduler.LengthwiseScheduler` touches none of them itself, except
``_free_request``, which it overrides by name (the one place vLLM frees every request). What is used, and where:

- the queues: ``running`` (a list), ``waiting`` and the queue of requests that wait holding KV
  (``kv_holding_waiting`` in vLLM 0.32; ``skipped_waiting`` in 0.26, which holds requests blocked on a grammar, remote
  KV or a stream, and those a step skipped, e.g. over ``max_loras``), with ``remove_requests`` /
  ``prepend_requests``, and ``FCFSRequestQueue`` for the views a step is shown;
- a step's budget ``max_num_scheduled_tokens``, ``current_step``, the scheduler's ``policy`` (FCFS or PRIORITY); at start
  ``block_size``, ``max_num_running_reqs``, ``max_model_len``, ``kv_cache_config.num_blocks`` and ``lora_config``;
- per request: ``next_decode_eligible_step`` (a held request skips the step), ``priority``, ``status``,
  ``num_computed_tokens``, ``num_output_tokens``, ``num_output_placeholders`` (async scheduling's in-flight token),
  ``num_prompt_tokens`` and ``sampling_params.prompt_logprobs`` (:func:`prompt_logprobs_pending`);
- ``_preempt_request`` (a recompute preemption, as vLLM's own schedule() makes one) and ``reset_preempted_req_ids``
  (requests vLLM preempted between steps).

Each is pinned by tests that drive the real scheduler (tests/test_vllm_levers.py), so an upgrade that moves one fails
there first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.request_queue import FCFSRequestQueue, RequestQueue, SchedulingPolicy
from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus

KV_QUEUES = ("kv_holding_waiting", "skipped_waiting")  # the name in vLLM 0.32, in 0.26 (the newest CUDA build for torch 2.11)


def kv_queue_name(scheduler: Any) -> str | None:
    """Which attribute holds the requests that wait holding KV (a KV connector's loads...) in this vLLM; None: unknown."""
    return next((n for n in KV_QUEUES if hasattr(scheduler, n)), None)


def shape(scheduler: Any) -> tuple[dict[str, int], int]:
    """The engine's batch as :class:`~serving.policy.config.PolicyConfig` fields (with its LoRA slots, ``max_loras``,
    when it serves adapters), and its KV pool in blocks (less the null block vLLM's pool keeps)."""
    lora = scheduler.lora_config
    return ({"block_size": scheduler.block_size, "max_num_seqs": scheduler.max_num_running_reqs,
             "max_num_batched_tokens": scheduler.max_num_scheduled_tokens, "max_model_len": scheduler.max_model_len,
             "max_loras": lora.max_loras if lora else 0},
            scheduler.kv_cache_config.num_blocks - 1)


def preempted_between_steps(scheduler: Any) -> set[str]:
    """Requests vLLM preempted since the last step (``reset_prefix_cache``)."""
    return set(scheduler.reset_preempted_req_ids)


def counts(request: VllmRequest) -> tuple[int, int]:
    """(computed tokens, generated tokens including async scheduling's in-flight placeholders)."""
    return request.num_computed_tokens, request.num_output_tokens + request.num_output_placeholders


def prompt_logprobs_pending(request: VllmRequest) -> bool:
    """The request asks for prompt logprobs and part of its prompt is still to be computed: a step that computes it
    produces logits for its prompt's positions.

    Why the plug-in asks: vLLM 0.32 computes those logits through the LoRA logits layer with the step's LoRA mapping,
    which has one row per *request* (``sampler_indices``), not one per prompt position. On an engine with
    ``--enable-lora`` a step that prefills such a request beside any other request fails there (on the CPU build
    ``einsum(): subscript b has size 2 ... previously seen size 5`` in ``bgmv_shrink``) and the engine core dies; with
    as many requests as positions it runs with the wrong adapter per position. Alone in its step, the one row
    broadcasts and the logits are right (vllm-project/vllm#16668, open; #29955)."""
    sp = request.sampling_params
    return sp is not None and sp.prompt_logprobs is not None and request.num_computed_tokens < request.num_prompt_tokens


def is_running(request: VllmRequest) -> bool:
    return request.status == RequestStatus.RUNNING


def is_aborted(request: VllmRequest) -> bool:
    return request.status == RequestStatus.FINISHED_ABORTED


def service_of(request: VllmRequest) -> str:
    """The service a request is for: its LoRA adapter's name, or "" for the base model."""
    lora = getattr(request, "lora_request", None)
    return str(getattr(lora, "lora_name", "") or "") if lora is not None else ""


@dataclass(slots=True)
class Levers:
    """What :func:`apply` changed in vLLM's scheduler for one step, for :func:`restore` and the counters."""

    budget: int
    waiting: RequestQueue
    kv_holding: RequestQueue
    held: list[tuple[VllmRequest, int]] = field(default_factory=list)  # (request, its own next_decode_eligible_step)
    held_ids: set[str] = field(default_factory=set)
    priorities: list[tuple[VllmRequest, int]] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # preempted by the adapter for the plan


def _view(queue: RequestQueue, members: list[VllmRequest]) -> FCFSRequestQueue:
    """Take ``members`` out of ``queue`` into a queue vLLM pops in exactly this order (whatever its policy)."""
    if members:
        queue.remove_requests(members)
    return FCFSRequestQueue(members)


def apply(scheduler: Any, kv_queue: str, preempt: list[VllmRequest], batch: list[VllmRequest],
          tokens: int) -> Levers:
    """Set vLLM's levers for one step: ``preempt`` those requests (recompute), hold every running request not in
    ``batch`` (it keeps its KV and skips the step), order ``running`` held first then ``batch``'s order, show the two
    waiting queues holding only the requests of ``batch`` they hold, in its order, and cap the budget at ``tokens``.

    Held requests first (skipped, so they take no budget), then the plan's batch order: when a block allocation fails,
    vLLM's victim is ``running[-1]`` (FCFS) or the largest ``(priority, arrival_time)`` (PRIORITY, set to the same ranks
    for this step): the request the plan would let go first, never one it holds, never one already scheduled this step.
    """
    s = scheduler
    levers = Levers(budget=s.max_num_scheduled_tokens, waiting=s.waiting, kv_holding=getattr(s, kv_queue))
    timestamp = time.monotonic()  # the clock vLLM's own schedule() passes to _preempt_request (request events)
    for v in preempt:
        if is_running(v):
            s.running.remove(v)
            s._preempt_request(v, timestamp)
            levers.preempted.add(v.request_id)
    rank = {v.request_id: i for i, v in enumerate(batch)}
    this_step = s.current_step + 1  # schedule() increments current_step before it looks
    for v in s.running:
        if v.request_id not in rank:
            levers.held.append((v, v.next_decode_eligible_step))
            levers.held_ids.add(v.request_id)
            v.next_decode_eligible_step = this_step + 1
    s.running.sort(key=lambda v: rank.get(v.request_id, -1))
    if s.policy == SchedulingPolicy.PRIORITY:
        for i, v in enumerate(s.running):
            levers.priorities.append((v, v.priority))
            v.priority = i
    admitted = [v for v in batch if not is_running(v)]
    # every request vLLM holds that is not running sits in one of its two waiting queues; each is presented holding
    # only the admitted requests it has, in the plan's order
    kv_holding = set(levers.kv_holding) if levers.kv_holding else ()
    setattr(s, kv_queue, _view(levers.kv_holding, [v for v in admitted if v in kv_holding]))
    s.waiting = _view(levers.waiting, [v for v in admitted if v not in kv_holding])
    s.max_num_scheduled_tokens = min(levers.budget, tokens)
    return levers


def restore(scheduler: Any, kv_queue: str, levers: Levers) -> None:
    """Undo the step's levers: budget, eligibility and priorities back; both queues whole again."""
    s = scheduler
    s.max_num_scheduled_tokens = levers.budget
    for v, old in levers.held:
        v.next_decode_eligible_step = old
    for v, old in levers.priorities:  # before the queues: a priority heap orders by them
        v.priority = old
    # what vLLM did not take from a view, plus what it put there (requests it preempted or skipped), goes back to the
    # front of the real queue, in the view's order
    for name, real in (("waiting", levers.waiting), (kv_queue, levers.kv_holding)):
        left = list(getattr(s, name))
        if left:
            real.prepend_requests(reversed(left))  # FCFS prepend_requests reverses; a heap orders itself
        setattr(s, name, real)
