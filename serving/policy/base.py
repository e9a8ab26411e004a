"""The one interface every scheduling policy implements (the registry that names them is ``registry.py``).

A host (the simulator, or the vLLM adapter) drives a policy like vLLM drives its scheduler:

    policy.add(request, now)                 # on arrival
    plan = policy.schedule(now)              # what runs this step, with how many tokens each
    ... the engine runs the step ...
    policy.update(plan, finished_ids, now)   # apply tokens, retire finished requests

The policy owns its queues and the :class:`~serving.policy.kv.BlockLedger`; the host owns time and the
truth (which requests emitted their last token).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from serving.policy.config import PolicyConfig
from serving.policy.kv import BlockLedger
from serving.policy.request import Phase, Prediction, Request, blocks_for


@dataclass(slots=True)
class StepPlan:
    """One step's decision: tokens per request id (in batch order) and what was preempted or paused."""

    tokens: dict[int, int] = field(default_factory=dict)
    preempted: list[int] = field(default_factory=list)  # recompute: KV dropped, back to the waiting queue
    paused: list[int] = field(default_factory=list)     # offload-free: KV kept, out of the batch

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())


Repredict = Callable[[Request], float]


class PolicyError(ValueError):
    """Unknown policy name or bad policy configuration."""


_SCHEDULED = (Phase.RUNNING, Phase.PREFILL)  # phases whose requests get tokens in the steps to come


class Policy(ABC):
    """Base class: request bookkeeping shared by all policies; subclasses decide ``_schedule``."""

    name = "base"

    def __init__(self, config: PolicyConfig, kv_blocks: int, repredict: Repredict | None = None) -> None:
        self.cfg = config
        self.kv = BlockLedger(kv_blocks)
        self.requests: dict[int, Request] = {}
        self.repredict = repredict or (lambda r: r.pred.remaining_after(r.generated))
        self.stats = {"preemptions": 0, "pauses": 0, "steps": 0, "sched_s": 0.0, "hosted": 0, "relocations": 0}

    # -- host-facing API -------------------------------------------------------------------------
    def add(self, req: Request, now: float) -> None:
        if req.rid in self.requests:
            raise ValueError(f"request {req.rid} added twice")
        if req.prompt_len <= 0:
            raise ValueError(f"request {req.rid}: prompt must have at least one token")
        if blocks_for(req.prompt_len + 1, self.cfg.block_size) > self.kv.total:
            raise ValueError(f"request {req.rid}: prompt of {req.prompt_len} tokens cannot fit the KV cache")
        req.phase = Phase.WAITING
        self.plan_rl(req, req.pred.length)
        self.requests[req.rid] = req
        self._enqueue_new(req, now)

    def schedule(self, now: float) -> StepPlan:
        t0 = time.perf_counter()
        plan = self._schedule(now)
        for rid in plan.tokens:
            r = self.requests[rid]
            if r.first_scheduled is None:
                r.first_scheduled = now
        self.stats["steps"] += 1
        self.stats["sched_s"] += time.perf_counter() - t0
        return plan

    def update(self, plan: StepPlan, finished: Iterable[int], now: float) -> None:
        """Apply the step: advance token counters, then retire ``finished`` (their last token came out)."""
        t0 = time.perf_counter()
        done = set(finished)
        reqs = self.requests
        for rid, n in plan.tokens.items():  # Request.advance, inlined for the hot path
            r = reqs[rid]
            c = r.computed + n
            seq = r.prompt_len + r.generated
            if n <= 0 or c > seq:
                r.advance(n)  # raises with the details
            r.computed = c
            if c == seq:
                r.generated += 1
        for rid in done:
            req = self.requests.pop(rid)
            req.phase = Phase.FINISHED
            self._on_finish(req, now)
            self._completed(req)
            self.kv.release(rid)
        self._after_step(plan, done, now)
        self.stats["sched_s"] += time.perf_counter() - t0

    def abort(self, rid: int, now: float, completed: bool = False) -> bool:
        """Drop a request wherever it is (client gone, engine abort); its blocks are freed, nobody else moves.
        ``completed``: it left because its answer is whole (a host, like vLLM's, that frees every request one way), so
        its length is known.

        Returns False for an unknown or already finished id, so a host may call it unconditionally.
        """
        req = self.requests.pop(rid, None)
        if req is None:
            return False
        self._on_abort(req, now)
        if completed:
            self._completed(req)
        req.phase = Phase.FINISHED
        self.kv.release(rid)
        return True

    def refine(self, rid: int, pred: Prediction) -> bool:
        """A sharper prediction for a request already in the engine (a remaining-length predictor read the answer so
        far): it replaces the request's prediction, and every later decision (its rank, the KV it is planned to need)
        starts from it. ``pred`` is of the whole length (tokens written so far included). False, and nothing changed,
        when the request is gone: an update that comes after the answer ended is dropped."""
        req = self.requests.get(rid)
        if req is None:
            return False
        req.pred = pred
        req.extra["refined"] = req.extra.get("refined", 0) + 1
        self.plan_rl(req, pred.length)
        self._on_refine(req)
        self.stats["refinements"] = self.stats.get("refinements", 0) + 1
        return True

    def host_preempted(self, rid: int, now: float) -> bool:
        """The host dropped ``rid``'s KV on its own (vLLM's recompute preemption when a block allocation failed).

        The request leaves the batch with its ledger blocks released and queues again for recompute, as after
        the policy's own preemption. Returns False for an unknown or finished id.
        """
        req = self.requests.get(rid)
        if req is None:
            return False
        self._on_host_preempt(req, now)
        return True

    def max_seq_len(self, req: Request) -> int:
        """The longest ``req`` can grow: the context limit, or prompt + max_tokens when set."""
        limit = self.cfg.max_model_len
        return limit if req.max_tokens is None else min(limit, req.prompt_len + req.max_tokens)

    def plan_rl(self, req: Request, total_rl: float) -> int:
        """Set the RL the policy plans for: a prediction, clamped to what the request can still produce."""
        req.planned_rl = int(min(max(req.generated + 1, round(total_rl)),
                                 max(req.generated + 1, self.max_seq_len(req) - req.prompt_len)))
        return req.planned_rl

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    def used_tokens(self) -> int:
        """KV tokens actually written (for utilization): computed tokens of every live request."""
        return sum(r.computed for r in self.requests.values())

    def adapter_slot(self, req: Request) -> bool:
        """vLLM's rule for LoRA adapters, kept by every policy's admission: the running requests span at most
        ``max_loras`` distinct adapters (vLLM asserts it of every step's running requests and skips a waiting request
        whose adapter would be one too many). A base-model request (service "") takes no slot."""
        if not self.cfg.max_loras or not req.service:
            return True
        live = {r.service for r in self.requests.values() if r.phase in _SCHEDULED and r.service}
        return req.service in live or len(live) < self.cfg.max_loras

    # -- subclass hooks --------------------------------------------------------------------------
    @abstractmethod
    def _enqueue_new(self, req: Request, now: float) -> None: ...

    @abstractmethod
    def _schedule(self, now: float) -> StepPlan: ...

    def _on_finish(self, req: Request, now: float) -> None:
        """Remove ``req`` from the policy's own structures (its blocks are released after)."""

    def _on_abort(self, req: Request, now: float) -> None:
        """Remove an aborted ``req`` from every queue it may be in (running or not)."""
        self._on_finish(req, now)

    def _completed(self, req: Request) -> None:
        """``req``'s whole answer came out (``generated`` is its length): for policies that learn from lengths."""

    def _on_refine(self, req: Request) -> None:
        """What a subclass derived from the old prediction (a queue position, a cached belief) is made again."""

    def _on_host_preempt(self, req: Request, now: float) -> None:
        """Default for ``host_preempted``: out of every queue as on abort, KV gone, queued again as on arrival."""
        self._on_abort(req, now)
        self.kv.release(req.rid)
        req.computed = 0
        req.preemptions += 1
        req.phase = Phase.WAITING
        self._enqueue_new(req, now)

    def _after_step(self, plan: StepPlan, finished: set[int], now: float) -> None:
        """Per-step bookkeeping after tokens were applied."""
