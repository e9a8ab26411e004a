"""Baseline policies: vLLM V1's default scheduler and the classic schedulers EcoServe compares with.

``vllm`` follows ``vllm/v1/core/sched/scheduler.py`` (0.32) step for step, minus features a simulator
has no use for (speculative decoding, encoders, connectors, prefix caching):

1. Running requests, in list order, each get ``min(uncomputed tokens, token budget)`` tokens. When the
   KV pool cannot grow one of them, the newest running request (``running[-1]``; for the priority
   policy the one with the worst ``(priority, arrival)``) is preempted by recompute — blocks freed,
   ``computed = 0``, put back at the head of the waiting queue — until it fits or the request itself
   was the victim.
2. Only if nothing was preempted this step, waiting requests are admitted in queue order while the
   budget, ``max_num_seqs`` and KV allow. Admission needs the whole sequence to fit in the free blocks
   (vLLM's ``scheduler_reserve_full_isl``), but allocates only the blocks of the scheduled chunk.

``vllm-v0`` is the older prefill-first scheduler without chunked prefill that the papers compared with.
``sarathi`` is the same loop with the budget set to the target forward size (stall-free chunked
prefill: decodes first, prefill chunks fill the rest). ``sjf`` is vLLM's priority policy with the
predicted RL as priority, aged so nobody starves. ``orca`` and ``fcfs-max-alloc`` reserve KV for the
maximum sequence length at admission, so they never preempt.
"""

from __future__ import annotations

from serving.policy.base import Policy, StepPlan
from serving.policy.request import Phase, Request, SortedQueue, blocks_for


class VLLMPolicy(Policy):
    """vLLM V1 default: FCFS, chunked prefill within the token budget, KV on demand, recompute preemption."""

    name = "vllm"
    priority = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.running: list[Request] = []
        self.waiting = SortedQueue()
        self.prioritised = False  # a request of a priority class other than 0 came: victims are chosen by class

    @property
    def budget(self) -> int:
        return self.cfg.max_num_batched_tokens

    def _key(self, req: Request) -> tuple:
        return ()

    def _rank(self, req: Request) -> tuple:
        """The waiting order: the request's priority class first (a catalogue's ``priority``, lower first, as vLLM's
        priority policy takes it), then the policy's own key within the class."""
        return (req.priority, *self._key(req))

    def _on_refine(self, req: Request) -> None:
        if req in self.waiting:  # a preempted request waits by a rank its old prediction gave
            self.waiting.remove(req)
            self.waiting.push(self._rank(req), req)

    def _enqueue_new(self, req: Request, now: float) -> None:
        self.prioritised = self.prioritised or req.priority != 0
        self.waiting.push(self._rank(req), req)

    def _victim(self) -> Request:
        if self.priority:
            return max(self.running, key=lambda r: (self._rank(r), r.arrival))
        if self.prioritised:  # the newest of the worst class goes, as vLLM's newest goes
            worst = max(r.priority for r in self.running)
            return next(r for r in reversed(self.running) if r.priority == worst)
        return self.running[-1]

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.kv.release(victim.rid)
        victim.computed = 0
        victim.phase = Phase.WAITING
        victim.preemptions += 1
        self.stats["preemptions"] += 1
        plan.preempted.append(victim.rid)
        self.waiting.push(self._rank(victim), victim, front=not self.priority)

    def _schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        budget = self.budget
        bs = self.cfg.block_size
        i = 0
        held = self.kv.held
        max_len = self.cfg.max_model_len
        running = self.running
        tokens = plan.tokens
        while i < len(running) and budget > 0:
            req = running[i]
            c = req.computed
            n = req.prompt_len + req.generated - c
            if n > budget:  # noqa: PLR1730 (hot path: min() is a call)
                n = budget
            if c + n > max_len:
                n = max_len - c
            if n <= 0:
                i += 1
                continue
            rid = req.rid
            need = (c + n + bs - 1) // bs
            if need <= held.get(rid, 0):  # the common case: a decode inside its last block
                tokens[rid] = n
                budget -= n
                i += 1
                continue
            scheduled = True
            while need > held.get(req.rid, 0) and not self.kv.grow_to(req.rid, need):
                victim = self._victim()
                idx = self.running.index(victim) if self.priority or self.prioritised else len(self.running) - 1
                del self.running[idx]
                if idx < i:
                    i -= 1
                budget += plan.tokens.pop(victim.rid, 0)
                self._preempt(victim, plan)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                # vLLM breaks here; with the priority policy the victim can precede better-ranked running
                # requests, and skipping them could leave the step empty, which a host reads as "idle"
                continue
            plan.tokens[req.rid] = n
            budget -= n
            i += 1
        if not plan.preempted:
            no_slot: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
                req = self.waiting.peek()
                if self._yields(req, now, budget):  # re-queued behind others: look at the new head
                    continue
                if not self.adapter_slot(req):  # vLLM skips it and admits the next one
                    no_slot.append(self.waiting.pop())
                    continue
                if blocks_for(req.seq_len, bs) - self.kv.of(req.rid) > self.kv.free or not self._admissible(req):
                    break
                n = min(req.uncomputed, budget)
                self.kv.grow_to(req.rid, blocks_for(req.computed + n, bs))
                self.waiting.pop()
                req.phase = Phase.RUNNING
                self.running.append(req)
                plan.tokens[req.rid] = n
                budget -= n
            for req in reversed(no_slot):  # back where they stood
                self.waiting.push(self._rank(req), req, front=True)
        return plan

    def _on_host_preempt(self, req: Request, now: float) -> None:
        if req in self.waiting:  # not admitted here: only its KV goes
            self.kv.release(req.rid)
            req.computed = 0
            return
        self.running.remove(req)
        self._preempt(req, StepPlan())  # where the policy's own victims go (vLLM's queue head, or by priority)

    def _admissible(self, req: Request) -> bool:
        """Extra admission test for subclasses (vLLM itself only needs the whole sequence to fit)."""
        return True

    def _yields(self, req: Request, now: float, budget: int) -> bool:
        """Subclasses may move the head of the queue behind others (and say so) instead of admitting it."""
        return False

    def _on_finish(self, req: Request, now: float) -> None:
        self.running.remove(req)

    def _on_abort(self, req: Request, now: float) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)



class SarathiPolicy(VLLMPolicy):
    """Sarathi-Serve / FastGen: stall-free chunked prefill to the target forward size, block allocation."""

    name = "sarathi"

    @property
    def budget(self) -> int:
        return self.cfg.tfs



class SJFPolicy(VLLMPolicy):
    """Shortest predicted job first via vLLM's priority policy, with linear aging.

    Priority = predicted RL − α·(time waited), α = max_model_len / aging_s, written in the static form
    ``predicted RL + α·arrival`` so the queue never needs re-sorting: after ``aging_s`` seconds a
    request outranks any fresh arrival, which bounds starvation. The predicted RL is clamped to
    [0, max_model_len] for the rank: the bound needs it, and a prediction past what a request can
    produce (16x noise, no ``max_tokens``) would otherwise let newer requests pass it for far longer.
    """

    name = "sjf"
    priority = True

    def _key(self, req: Request) -> tuple:
        alpha = self.cfg.max_model_len / self.cfg.aging_s
        return (min(max(req.pred.length, 0.0), self.cfg.max_model_len) + alpha * req.arrival,)



class VLLMV0Policy(VLLMPolicy):
    """vLLM v0's default scheduler (no chunked prefill), the baseline EcoServe and its peers measured.

    Prefill-prioritised: while whole waiting prompts fit the token budget, the free blocks (less a 1%
    watermark) and ``max_num_seqs``, a step runs only prefills, FCFS, and every decode stalls. Otherwise
    the step decodes every running request one token, preempting the newest by recompute when a block
    cannot be appended. Kept to show how far today's scheduler (``vllm``) has moved the baseline.
    """

    name = "vllm-v0"

    @property
    def budget(self) -> int:
        return max(self.cfg.max_num_batched_tokens, self.cfg.max_model_len)

    def _schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        budget = self.budget
        bs = self.cfg.block_size
        watermark = max(1, self.kv.total // 100)
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting.peek()
            n = req.uncomputed
            if n > budget or (blocks_for(req.computed + n, bs) - self.kv.of(req.rid)
                              > self.kv.free - (watermark if self.running else 0)) or not self.adapter_slot(req):
                break
            self.kv.grow_to(req.rid, blocks_for(req.computed + n, bs))
            self.waiting.pop()
            req.phase = Phase.RUNNING
            self.running.append(req)
            plan.tokens[req.rid] = n
            budget -= n
        if plan.tokens:
            return plan
        i = 0
        held = self.kv.held
        while i < len(self.running):
            req = self.running[i]
            need = blocks_for(req.seq_len, bs)
            scheduled = True
            while need > held.get(req.rid, 0) and not self.kv.grow_to(req.rid, need):
                victim = self.running.pop()
                plan.tokens.pop(victim.rid, None)
                self._preempt(victim, plan)
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            plan.tokens[req.rid] = req.uncomputed
            i += 1
        return plan



class MaxAllocPolicy(Policy):
    """FCFS with max-allocation: KV for prompt + max output reserved at admission (ORCA, FasterTransformer).

    Never preempts, but reserved-and-unused KV caps the batch. ``batch_size`` limits concurrent
    requests (ORCA: 8); ``chunked`` lets prefill chunks share the token budget (otherwise a prompt runs
    whole in one step, as ORCA does).
    """

    name = "fcfs-max-alloc"

    def __init__(self, cfg, kv_blocks, repredict=None, batch_size: int | None = None, chunked: bool = True) -> None:
        super().__init__(cfg, kv_blocks, repredict)
        self.batch_size = batch_size or cfg.max_num_seqs
        self.chunked = chunked
        self.running: list[Request] = []
        self.waiting = SortedQueue()

    def _max_blocks(self, req: Request) -> int:
        limit = self.cfg.max_model_len if req.max_tokens is None else min(self.cfg.max_model_len, req.prompt_len + req.max_tokens)
        return min(blocks_for(max(limit, req.seq_len + 1), self.cfg.block_size), self.kv.total)

    def _enqueue_new(self, req: Request, now: float) -> None:
        self.waiting.push((), req)

    def _schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        budget = self.cfg.max_num_batched_tokens if self.chunked else 1 << 62
        for req in self.running:
            if budget <= 0:
                break
            n = min(req.uncomputed, budget)
            plan.tokens[req.rid] = n
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.batch_size:
            req = self.waiting.peek()
            if not self.adapter_slot(req) or not self.kv.grow_to(req.rid, self._max_blocks(req)):
                break
            self.waiting.pop()
            req.phase = Phase.RUNNING
            self.running.append(req)
            n = min(req.uncomputed, budget)
            plan.tokens[req.rid] = n
            budget -= n
        return plan

    def _on_finish(self, req: Request, now: float) -> None:
        self.running.remove(req)

    def _on_abort(self, req: Request, now: float) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
