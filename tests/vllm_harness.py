"""Offline harness for vLLM V1's real scheduler (no weights, no engine process).

Builds vLLM's own ``Scheduler`` / ``AsyncScheduler`` (or a subclass) with a real
``KVCacheManager`` over a hand-made ``KVCacheConfig`` and drives it step by step
with fabricated ``ModelRunnerOutput``s, the way vLLM's upstream scheduler tests
do (``tests/v1/core/utils.py``).  Only the model runner is faked; every
scheduling decision, KV allocation, preemption and stop check is vLLM's.

Written against vllm(-cpu) 0.32.0.  Notes on that version:

* ``VllmConfig`` on the CPU platform forces ``scheduler_config.async_scheduling``
  to ``False`` (``vllm/platforms/cpu.py``), so the CPU engine runs any scheduler
  class -- ``AsyncScheduler`` subclasses included -- in the synchronous loop
  ``schedule() -> execute -> update_from_output()``.  ``make_scheduler`` sets the
  flag back after config construction when asked, to mirror a GPU config.
* ``ModelConfig`` normally inspects a built-in architecture in a subprocess
  (about 20 s on a cold ``$VLLM_CACHE_ROOT/modelinfos`` cache); the harness
  registers the Llama class in process under its own name to avoid that.
* The block pool reserves one "null" block, so ``num_blocks=N`` gives ``N - 1``
  allocatable KV blocks.
* ``Request.output_token_ids`` is a read-only ``ConstantList`` that does not
  compare equal to a ``list``: compare ``list(request.output_token_ids)``.

Fabricated sampling: every scheduled request whose chunk reaches the end of its
known tokens (``not request.is_prefill_chunk`` right after ``schedule()``, which
is exactly when the real model runner samples) gets one token whose value
encodes its output position: ``token_for_position(i) = 100 + i % 800``.  A
correct run therefore ends with ``output_token_ids == expected_tokens(n)``; a
duplicated, lost or out-of-order token is visible.  The EOS id (2) is never
produced, so requests stop at ``max_tokens`` (``FINISHED_LENGTH_CAPPED``).

Two driving modes:

* synchronous (``pipelined=False``, default): ``schedule()`` then
  ``update_from_output()`` of that same step -- ``EngineCore.step``.  With
  ``AsyncScheduler`` the placeholders it adds are consumed in the same call.
* pipelined (``pipelined=True``): mirrors ``EngineCore.step_with_batch_queue``
  with a batch queue of 2 (GPU async scheduling): step N+1 is scheduled before
  step N's output is applied, so ``num_output_placeholders`` and
  ``num_in_flight_tokens`` are non-zero while the scheduler decides.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import shutil
import tempfile
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

__all__ = [
    "EOS_TOKEN_ID",
    "ForeignBlocks",
    "RequestResult",
    "RunResult",
    "StepRecord",
    "block_ids",
    "check_queues",
    "drain",
    "expected_tokens",
    "fabricate_output",
    "make_request",
    "make_scheduler",
    "run_to_completion",
    "step",
    "step_full",
    "tiny_model_dir",
    "token_for_position",
]

EOS_TOKEN_ID = 2
VOCAB_SIZE = 1000
BATCH_QUEUE_SIZE = 2  # EngineCore batch queue under async scheduling, pp=1

_none_hash_ready = False
_ARRIVALS = itertools.count()


# --------------------------------------------------------------------------
# construction
# --------------------------------------------------------------------------


TINY_ARCH = "LengthwiseTinyLlamaForCausalLM"


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    """A local HF config dir for a 2-layer Llama (no weights, no tokenizer).

    The architecture name is vLLM's own ``LlamaForCausalLM`` registered in
    process under ``TINY_ARCH``: ModelConfig then inspects the class here
    (~1 s) instead of in a fresh subprocess that re-imports vLLM (~20 s on a
    machine whose ``$VLLM_CACHE_ROOT/modelinfos`` cache is cold), and vLLM's
    registry entry for "LlamaForCausalLM" is left untouched.
    """
    from transformers import LlamaConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM

    if TINY_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TINY_ARCH, LlamaForCausalLM)
    path = tempfile.mkdtemp(prefix="lengthwise-tiny-llama-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    LlamaConfig(
        architectures=[TINY_ARCH],
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
    ).save_pretrained(path)
    return path


def _block_hasher(block_size: int):
    global _none_hash_ready
    if not _none_hash_ready:
        # EngineCore does this (with cache_config.prefix_caching_hash_algo,
        # default sha256) when prefix caching is on.
        init_none_hash(sha256)
        _none_hash_ready = True
    return get_request_block_hasher(block_size, sha256)


def make_scheduler(
    *,
    num_blocks: int = 1000,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 4096,
    scheduler_cls: type[Scheduler] = AsyncScheduler,
    enable_prefix_caching: bool = False,
    async_scheduling: bool | None = None,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduler_reserve_full_isl: bool | None = None,
    watermark: float = 0.0,
    policy: str = "fcfs",
    log_stats: bool = False,
    use_v2_model_runner: bool | None = None,
    speculative_config=None,
    additional_config: dict | None = None,
    max_loras: int = 0,
) -> Scheduler:
    """Build a real vLLM scheduler over ``num_blocks`` KV blocks.

    ``async_scheduling=None`` means "True iff scheduler_cls is an
    AsyncScheduler" (what a GPU deployment would configure).  The value only
    changes derived config such as ``max_concurrent_batches``; how steps
    overlap is chosen per call with ``step(..., pipelined=...)``.
    ``scheduler_reserve_full_isl=None`` keeps vLLM's default (True: a waiting
    request is admitted only if its whole current sequence fits in free KV).
    ``use_v2_model_runner`` overrides the scheduler's cached flag (on CPU it is
    False because Triton is missing; GPU deployments of 0.32 default to True,
    which makes AsyncScheduler write ``next_decode_eligible_step``).
    ``speculative_config``: a ``vllm.config.SpeculativeConfig`` (e.g. method "ngram", no draft model).
    ``additional_config``: vLLM's ``--additional-config`` (a scheduler plug-in's own settings).
    ``max_loras``: an engine serving LoRA adapters, this many at once (the scheduler loads none: requests name them).
    """
    if async_scheduling is None:
        async_scheduling = issubclass(scheduler_cls, AsyncScheduler)
    model_config = ModelConfig(
        model=tiny_model_dir(),
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        max_model_len=max_model_len,
    )
    sched_kwargs = {}
    if scheduler_reserve_full_isl is not None:
        sched_kwargs["scheduler_reserve_full_isl"] = scheduler_reserve_full_isl
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
        watermark=watermark,
        policy=policy,
        scheduler_cls=scheduler_cls,
        **sched_kwargs,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        enable_prefix_caching=enable_prefix_caching,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
        additional_config=additional_config or {},
        lora_config=LoRAConfig(max_loras=max_loras, max_lora_rank=8) if max_loras else None,
    )
    # The CPU platform hook resets async_scheduling to False; restore the
    # requested value so derived properties match a GPU deployment.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    # Platform hooks may also touch block size / prefix caching; pin them.
    vllm_config.cache_config.block_size = block_size
    vllm_config.cache_config.enable_prefix_caching = enable_prefix_caching
    vllm_config.cache_config.num_gpu_blocks = num_blocks

    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                FullAttentionSpec(
                    block_size=block_size,
                    num_kv_heads=4,
                    head_size=16,
                    dtype=torch.float32,
                ),
            )
        ],
    )
    scheduler = scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=log_stats,
    )
    if use_v2_model_runner is not None:
        scheduler.use_v2_model_runner = use_v2_model_runner
    return scheduler


def _default_prompt(req_id: str, prompt_len: int) -> list[int]:
    """Per-request distinct prompt (no accidental shared prefix)."""
    seed = zlib.crc32(req_id.encode())
    return [3 + (seed + 7 * i) % (VOCAB_SIZE - 3) for i in range(prompt_len)]


def make_request(
    req_id: str,
    prompt_len: int,
    max_tokens: int,
    extra_args: dict | None = None,
    arrival_time: float | None = None,
    *,
    prompt_token_ids: list[int] | None = None,
    priority: int = 0,
    block_size: int = 16,
    lora: tuple[str, int] | None = None,
) -> Request:
    """A vLLM ``Request`` as EngineCore would build it (with a block hasher).

    ``prompt_token_ids`` overrides the default per-request distinct prompt
    (use it to create shared prefixes).  ``arrival_time`` defaults to a
    deterministic per-process counter (0.0, 1.0, ...); it only matters for the
    "priority" policy -- FCFS queue order is ``add_request`` order.
    ``block_size`` must match the scheduler's (it sizes the prefix-cache block
    hasher). ``lora``: the adapter's name and id, for an engine serving adapters.
    """
    if prompt_token_ids is None:
        prompt_token_ids = _default_prompt(req_id, prompt_len)
    assert len(prompt_token_ids) == prompt_len
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra_args)
    # EngineCore's input processor sets the EOS id from the model config.
    params.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=params,
        pooling_params=None,
        arrival_time=float(next(_ARRIVALS)) if arrival_time is None else arrival_time,
        priority=priority,
        block_hasher=_block_hasher(block_size),
        lora_request=LoRARequest(lora[0], lora[1], f"/adapters/{lora[0]}") if lora else None,
    )


# --------------------------------------------------------------------------
# fabricated model runner
# --------------------------------------------------------------------------


def token_for_position(output_index: int) -> int:
    """Token the fake model samples at output position ``output_index``."""
    return 100 + output_index % 800


def expected_tokens(max_tokens: int) -> list[int]:
    return [token_for_position(i) for i in range(max_tokens)]


def fabricate_output(
    scheduler: Scheduler, scheduler_output: SchedulerOutput
) -> ModelRunnerOutput:
    """The ModelRunnerOutput the real runner would return for this step.

    Must be called right after ``schedule()`` (before any update): a request
    samples iff its scheduled chunk is not a partial prefill.  After
    ``schedule()``, ``num_computed_tokens`` already counts this step's tokens,
    so the sampled token's output index is ``num_computed_tokens -
    num_prompt_tokens`` in both the sync and the async scheduler.
    """
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        req = scheduler.requests[req_id]
        if req.is_prefill_chunk:
            sampled.append([])
        else:
            idx = req.num_computed_tokens - req.num_prompt_tokens
            sampled.append([token_for_position(idx)])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        pooler_output=[],
    )


# --------------------------------------------------------------------------
# stepping
# --------------------------------------------------------------------------


@dataclass
class StepRecord:
    """What one ``step_full`` call did.

    ``scheduled`` describes the step scheduled by this call (None in pipelined
    mode when nothing was scheduled); ``new_tokens`` / ``finished_ids`` come
    from the ``update_from_output`` performed by this call (in pipelined mode
    that is the *previous* scheduled step, or nothing while the queue fills).
    """

    step: int | None  # scheduler.current_step of the scheduled step
    scheduler_output: SchedulerOutput | None
    num_scheduled_tokens: dict[str, int]
    preempted_ids: set[str]
    new_req_ids: list[str]
    resumed_req_ids: list[str]
    updated_step: int | None  # current_step of the step whose output was applied
    new_tokens: dict[str, list[int]]
    finished_ids: list[str]
    finish_reasons: dict[str, str]

    def summary(self) -> dict:
        return {
            "step": self.step,
            "num_scheduled_tokens": dict(self.num_scheduled_tokens),
            "preempted": sorted(self.preempted_ids),
            "new": list(self.new_req_ids),
            "resumed": list(self.resumed_req_ids),
            "finished": list(self.finished_ids),
        }


# scheduler -> deque[(step, SchedulerOutput, ModelRunnerOutput)] (pipelined)
_INFLIGHT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _schedule(scheduler: Scheduler):
    so = scheduler.schedule()
    return scheduler.current_step, so, fabricate_output(scheduler, so)


def _apply(scheduler: Scheduler, so: SchedulerOutput, mro: ModelRunnerOutput):
    outs = scheduler.update_from_output(so, mro)
    new_tokens: dict[str, list[int]] = {}
    finished: list[str] = []
    reasons: dict[str, str] = {}
    for eco in outs.values():
        for o in eco.outputs:
            if o.new_token_ids:
                new_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finished.append(o.request_id)
                reasons[o.request_id] = str(o.finish_reason)
    return new_tokens, finished, reasons


def _record(sched_item, applied) -> StepRecord:
    if sched_item is None:
        step_no, so = None, None
    else:
        step_no, so, _ = sched_item
    if applied is None:
        upd_step, new_tokens, finished, reasons = None, {}, [], {}
    else:
        upd_step, (new_tokens, finished, reasons) = applied
    cached = so.scheduled_cached_reqs if so is not None else None
    return StepRecord(
        step=step_no,
        scheduler_output=so,
        num_scheduled_tokens=dict(so.num_scheduled_tokens) if so else {},
        preempted_ids=set(so.preempted_req_ids) if so else set(),
        new_req_ids=[r.req_id for r in so.scheduled_new_reqs] if so else [],
        resumed_req_ids=(
            [r for r in cached.req_ids if r in cached.resumed_req_ids]
            if cached
            else []
        ),
        updated_step=upd_step,
        new_tokens=new_tokens,
        finished_ids=finished,
        finish_reasons=reasons,
    )


def step_full(scheduler: Scheduler, pipelined: bool = False) -> StepRecord:
    """One engine-loop iteration (see module docstring for the two modes)."""
    if not pipelined:
        if _INFLIGHT.get(scheduler):
            raise RuntimeError("outputs still in flight from pipelined steps; call drain() first")
        item = _schedule(scheduler)
        applied = (item[0], _apply(scheduler, item[1], item[2]))
        return _record(item, applied)

    # Mirrors EngineCore.step_with_batch_queue with batch_queue_size=2.
    queue = _INFLIGHT.setdefault(scheduler, deque())
    assert len(queue) < BATCH_QUEUE_SIZE
    item = None
    if scheduler.has_requests():
        item = _schedule(scheduler)
        queue.appendleft(item)
        executed = item[1].total_num_scheduled_tokens > 0
        if len(queue) < BATCH_QUEUE_SIZE and (executed or scheduler.has_requests()):
            return _record(item, None)
    elif not queue:
        return _record(None, None)
    old_step, old_so, old_mro = queue.pop()
    return _record(item, (old_step, _apply(scheduler, old_so, old_mro)))


def step(
    scheduler: Scheduler, pipelined: bool = False
) -> tuple[SchedulerOutput | None, list[str]]:
    """``(scheduler_output of the step scheduled now, finished request ids)``."""
    rec = step_full(scheduler, pipelined=pipelined)
    return rec.scheduler_output, rec.finished_ids


def drain(scheduler: Scheduler) -> list[StepRecord]:
    """Apply outputs still in flight (pipelined mode) without scheduling."""
    queue = _INFLIGHT.get(scheduler)
    records = []
    while queue:
        old_step, old_so, old_mro = queue.pop()
        records.append(_record(None, (old_step, _apply(scheduler, old_so, old_mro))))
    return records


def check_queues(scheduler: Scheduler) -> None:
    """Every unfinished request is in exactly one of ``running``, ``waiting`` and the queue of requests that wait
    holding KV (``kv_holding_waiting`` in 0.32, ``skipped_waiting`` in 0.26: the name the plug-in finds)."""
    from serving.engine.levers import kv_queue_name

    seen: dict[str, int] = {}
    for queue in (scheduler.running, scheduler.waiting, getattr(scheduler, kv_queue_name(scheduler))):
        for r in queue:
            seen[r.request_id] = seen.get(r.request_id, 0) + 1
    live = {rid for rid, r in scheduler.requests.items() if not r.is_finished()}
    assert set(seen) == live and all(n == 1 for n in seen.values()), (sorted(live), seen)


class ForeignBlocks:
    """KV blocks held outside the scheduler's view (as a KV connector's transfers hold them), for ``before_step``.

    Every ``period`` iterations, from a quarter to three quarters of the period, up to ``k`` free blocks of
    the scheduler's pool are held here, so a plan that counts the whole pool over-promises and vLLM's own
    allocation fails mid-step.
    """

    def __init__(self, k: int = 3, period: int = 40) -> None:
        self.k, self.period, self.held = k, period, []

    def __call__(self, scheduler: Scheduler, i: int) -> None:
        pool = scheduler.kv_cache_manager.block_pool
        phase = i % self.period
        if phase == self.period // 4 and not self.held:
            self.held = pool.get_new_blocks(min(self.k, pool.get_num_free_blocks()))
        elif phase == 3 * self.period // 4 and self.held:
            pool.free_blocks(self.held)
            self.held = []


def block_ids(scheduler: Scheduler, req_id: str) -> list[int]:
    """KV block ids currently held by a request (single KV group)."""
    return list(scheduler.kv_cache_manager.get_block_ids(req_id)[0])


# --------------------------------------------------------------------------
# whole runs
# --------------------------------------------------------------------------


@dataclass
class RequestResult:
    req_id: str
    output_tokens: list[int]  # as streamed through EngineCoreOutputs
    request_output_tokens: list[int]  # Request.output_token_ids at the end
    status: RequestStatus
    finish_reason: str | None
    arrival_step: int
    first_scheduled_step: int | None
    finish_step: int | None  # step whose output finished the request
    scheduled_steps: list[int]
    num_preemptions: int
    tokens_scheduled: int = 0  # all tokens scheduled (incl. recompute)


@dataclass
class RunResult:
    requests: dict[str, RequestResult]
    steps: list[dict] = field(default_factory=list)  # StepRecord.summary()
    records: list[StepRecord] = field(default_factory=list)
    num_steps: int = 0

    @property
    def total_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.requests.values())


def run_to_completion(
    scheduler: Scheduler,
    requests: Iterable[Request],
    arrivals: dict[str, int] | None = None,
    max_steps: int = 10_000,
    pipelined: bool = False,
    before_step: Callable[[Scheduler, int], None] | None = None,
) -> RunResult:
    """Add requests (``arrivals[req_id]`` = loop iteration at which it is
    added, default 0) and step until everything finished and nothing is in
    flight.  ``before_step(scheduler, i)`` runs before each iteration (hook
    for poking levers).  Raises if ``max_steps`` is exceeded."""
    # Requests already inside the scheduler are tracked too (their
    # ``output_tokens`` then only holds what was streamed during this run).
    reqs = {r.request_id: r for r in scheduler.requests.values()}
    new_reqs = {r.request_id: r for r in requests}
    reqs.update(new_reqs)
    arrivals = {rid: arrivals.get(rid, 0) for rid in new_reqs} if arrivals else dict.fromkeys(new_reqs, 0)
    pending = sorted(new_reqs, key=lambda rid: arrivals[rid])
    results = {
        rid: RequestResult(
            req_id=rid,
            output_tokens=[],
            request_output_tokens=[],
            status=r.status,
            finish_reason=None,
            arrival_step=arrivals.get(rid, 0),
            first_scheduled_step=None,
            finish_step=None,
            scheduled_steps=[],
            num_preemptions=0,
        )
        for rid, r in reqs.items()
    }
    run = RunResult(requests=results)
    if not pipelined:
        for rec in drain(scheduler):  # switching from pipelined stepping
            run.records.append(rec)

    def absorb(rec: StepRecord) -> None:
        for rid, n in rec.num_scheduled_tokens.items():
            res = results[rid]
            res.scheduled_steps.append(rec.step)
            res.tokens_scheduled += n
            if res.first_scheduled_step is None:
                res.first_scheduled_step = rec.step
        for rid, toks in rec.new_tokens.items():
            results[rid].output_tokens.extend(toks)
        for rid in rec.finished_ids:
            assert results[rid].finish_step is None, f"{rid} finished twice"
            results[rid].finish_step = rec.updated_step
            results[rid].finish_reason = rec.finish_reasons[rid]
        run.records.append(rec)
        if rec.step is not None:
            run.steps.append(rec.summary())

    i = 0
    while True:
        while pending and arrivals.get(pending[0], 0) <= i:
            scheduler.add_request(reqs[pending.pop(0)])
        inflight = _INFLIGHT.get(scheduler)
        if not pending and not scheduler.has_requests() and not inflight:
            break
        if i >= max_steps:
            raise RuntimeError(
                f"not finished after {max_steps} steps: "
                f"running={[r.request_id for r in scheduler.running]} "
                f"waiting={[r.request_id for r in scheduler.waiting]}"
            )
        if before_step is not None:
            before_step(scheduler, i)
        absorb(step_full(scheduler, pipelined=pipelined))
        i += 1
    for rec in drain(scheduler):
        absorb(rec)
    run.num_steps = i
    for rid, r in reqs.items():
        res = results[rid]
        res.status = r.status
        res.request_output_tokens = list(r.output_token_ids)
        res.num_preemptions = r.num_preemptions
    return run
