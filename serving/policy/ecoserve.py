"""EcoServe (Shen & Sen): decoupled PT/GT queues, time-synced GT groups, ordering, KVC pipelining.

The four ablation switches, as the paper's §4 defines its variants:

* **D** — decoupled: PTs and GTs wait in separate queues. A PT is allocated KV for its prompt only and
  fills the step up to the TFS; after prefill it becomes a GT that waits, holding its prompt KV, until
  the pool can take its exact allocation (remaining predicted RL × (1 + padding)). GTs may not use the
  reserved fraction of KV, which is kept for PTs and for GTs that outlive their prediction. Without D
  (coupled exact allocation, as S3 does) a request is allocated prompt + padded RL when its PT starts.
* **S** — time-synced batching: GTs whose remaining predicted RL rounds to the same multiple of
  ``group_tokens`` form a group; admitting one admits its group (split when the pool cannot take all),
  so a group starts, and if predictions hold, finishes together.
* **O** — ordering (``serving.policy.ordering``): deadline ranges, then occupied KV, then length, with a
  binary search for the task that best fills what is left. Without O the queues are FCFS.
* **P** — KVC pipelining (``serving.policy.pipelining``): newly admitted GTs lend the unused tail of
  their allocation to shorter GTs, nested down to ``pipeline_depth`` levels.

Under-prediction (all variants): a GT that reaches the end of its allocation first extends it from any
free KV, the reserve included, by its re-predicted remaining RL; if the pool cannot, it is paused
without offloading (keeps its KV), re-predicted, and queued again ahead of new GTs.

Liveness: if nothing is running and the head GT cannot get its allocation, it starts with what is free;
if nothing is free, queued GTs are preempted by recompute from the back until it can. Neither happens in
normal operation.
"""

from __future__ import annotations

import bisect
import math

from serving.policy.base import Policy, PolicyError, StepPlan
from serving.policy.ordering import find_fitting, order_key
from serving.policy.pipelining import Lend, nested_slots
from serving.policy.request import Phase, Request, SortedQueue, blocks_for

_NEW, _RESUMED = 1, 0


class EcoServe(Policy):
    name = "ecoserve"

    def __init__(self, cfg, kv_blocks, repredict=None, *, decouple: bool = True, sync: bool = True,
                 order: bool = True, pipeline: bool = True) -> None:
        super().__init__(cfg, kv_blocks, repredict)
        self.D, self.S, self.O, self.P = decouple, sync, order, pipeline
        flags = "".join(f for f, on in zip("SDOP", (sync, decouple, order, pipeline)) if on)
        self.name = "ecoserve" if flags == "SDOP" else f"ecoserve-{flags or 'none'}"
        self.reserve_blocks = math.ceil(cfg.reserve * kv_blocks)
        self.pt_queue = SortedQueue()
        self.prefilling: list[Request] = []
        self.gt_queue = SortedQueue()
        self.groups: dict[int, list[Request]] = {}
        self.by_rl: list[tuple[int, int, Request]] = []  # queued GTs by padded remaining RL, for pipelining
        self.running: dict[int, Request] = {}
        self.cap: dict[int, int] = {}       # tokens a running GT may hold before it is under-provisioned
        self.origin: dict[int, int] = {}    # computed tokens when the GT started: its region's offset 0
        self.lends: dict[int, list[Lend]] = {}
        self.host_of: dict[int, Lend] = {}
        self._seq = 0

    @classmethod
    def from_flags(cls, flags: str, cfg, kv_blocks, repredict=None) -> EcoServe:
        f = flags.upper()
        if not f or set(f) - set("DSOP"):
            raise PolicyError(f"ecoserve variant {flags!r}: use letters from D, S, O, P (e.g. ecoserve-SDO)")
        return cls(cfg, kv_blocks, repredict, decouple="D" in f, sync="S" in f, order="O" in f, pipeline="P" in f)

    # -- sizes -------------------------------------------------------------------------------------
    def _remaining(self, r: Request) -> int:
        return max(1, r.planned_rl - r.generated)

    def _padded(self, tokens: int) -> int:
        return math.ceil(tokens * (1 + self.cfg.padding))

    def _target(self, r: Request, tokens: int) -> int:
        """Blocks to hold ``tokens`` more tokens of ``r``, never beyond its context limit."""
        return blocks_for(min(r.computed + tokens, self.max_seq_len(r)), self.cfg.block_size)

    def _group(self, r: Request) -> int:
        return -(-self._remaining(r) // self.cfg.group_tokens)

    # -- queues ------------------------------------------------------------------------------------
    def _enqueue_new(self, req: Request, now: float) -> None:
        self._queue_pt(req, _NEW)

    def _queue_pt(self, r: Request, tier: int) -> None:
        r.phase = Phase.WAITING
        self.pt_queue.push(order_key(self.cfg, tier, r.deadline, 0, r.seq_len, self.O), r, front=tier == _RESUMED and not self.O)

    def _queue_gt(self, r: Request, tier: int) -> None:
        r.phase = Phase.PAUSED if tier == _RESUMED else Phase.GT_QUEUED
        rem = self._remaining(r)
        key = order_key(self.cfg, tier, r.deadline, self.kv.of(r.rid) * self.cfg.block_size, rem, self.O)
        self.gt_queue.push(key, r)
        self.groups.setdefault(self._group(r), []).append(r)
        self._seq += 1
        entry = (self._padded(rem), self._seq, r)
        r.extra["rl_entry"] = entry
        bisect.insort(self.by_rl, entry, key=lambda e: (e[0], e[1]))

    def _unqueue_gt(self, r: Request) -> None:
        self.gt_queue.remove(r)
        members = self.groups[self._group(r)]
        members.remove(r)
        if not members:
            del self.groups[self._group(r)]
        entry = r.extra.pop("rl_entry")
        i = bisect.bisect_left(self.by_rl, (entry[0], entry[1]), key=lambda e: (e[0], e[1]))
        del self.by_rl[i]

    # -- starting and stopping GTs -----------------------------------------------------------------
    def _start_gt(self, r: Request, cap: int) -> None:
        r.phase = Phase.RUNNING
        self.running[r.rid] = r
        self.cap[r.rid] = cap
        self.origin[r.rid] = r.computed

    def _stop_gt(self, r: Request) -> None:
        self.running.pop(r.rid, None)
        self.cap.pop(r.rid, None)
        self.origin.pop(r.rid, None)

    def _admit_gt(self, r: Request, avail: int) -> bool:
        """Give ``r`` its exact allocation if it fits in ``avail`` blocks; start it."""
        target = self._target(r, self._padded(self._remaining(r)))
        if target - self.kv.of(r.rid) > avail or not self.adapter_slot(r):
            return False
        self._unqueue_gt(r)
        self.kv.grow_to(r.rid, target)
        self._start_gt(r, target * self.cfg.block_size)
        return True

    def _own_cap(self, r: Request) -> int:
        return self.kv.of(r.rid) * self.cfg.block_size

    def _extend(self, r: Request) -> bool:
        """Under-provisioned GT: grow by its re-predicted remaining RL from any free KV (reserve included)."""
        rem = self.plan_rl(r, r.generated + self.repredict(r)) - r.generated
        target = self._target(r, self._padded(rem))
        lend = self.host_of.get(r.rid)
        own = self.kv.of(r.rid)
        # a hosted GT's written tokens live in its host's span: moving out means owning all of them
        if not self.kv.grow_to(r.rid, target if lend is None else
                               max(target, own + blocks_for(r.computed - self.origin[r.rid] + self._padded(rem),
                                                            self.cfg.block_size))):
            return False
        if lend is not None:
            self._release_lends(r)
            del self.host_of[r.rid]
            self.stats["relocations"] += 1
            self.origin[r.rid] = r.computed
        self.cap[r.rid] = self._own_cap(r) if lend is None else r.computed + self._padded(rem)
        return True

    def _pause(self, r: Request, plan: StepPlan) -> None:
        """Offload-free preemption: out of the batch with its KV, re-predicted, queued ahead of new GTs."""
        self._evict_lends(r, plan)  # none are live: a GT pauses only after passing every lent span
        self._stop_gt(r)
        r.pauses += 1
        self.stats["pauses"] += 1
        plan.paused.append(r.rid)
        self.plan_rl(r, r.generated + self.repredict(r))
        self._queue_gt(r, _RESUMED)

    def _preempt(self, r: Request, plan: StepPlan) -> None:
        """Recompute preemption (only for a hosted GT that cannot move out, or the liveness guard)."""
        self._release_lends(r)
        if r.rid in self.running:
            self._stop_gt(r)
        elif r in self.gt_queue:
            self._unqueue_gt(r)
        self.host_of.pop(r.rid, None)
        plan.tokens.pop(r.rid, None)
        self.kv.release(r.rid)
        r.computed = 0
        r.preemptions += 1
        self.stats["preemptions"] += 1
        plan.preempted.append(r.rid)
        self._queue_pt(r, _RESUMED)

    def _evict_hosted(self, h: Request, plan: StepPlan) -> None:
        """The writer reached ``h``'s span: move ``h`` to blocks of its own, or preempt it."""
        if not self._extend(h):
            self._preempt(h, plan)

    def _evict_lends(self, writer: Request, plan: StepPlan) -> None:
        for lend in self.lends.pop(writer.rid, []):
            h = self.requests.get(lend.hosted)
            if h is not None and self.host_of.get(h.rid) is lend:
                self._evict_hosted(h, plan)

    # -- the step ----------------------------------------------------------------------------------
    def _schedule(self, now: float) -> StepPlan:
        plan = StepPlan()
        self._run_gts(plan)
        started = self._admit_gts()
        if self.P:
            for r in list(started):
                started += self._pipeline(r, self.cap[r.rid] - r.computed, self.cfg.pipeline_depth)
        for r in started:
            plan.tokens[r.rid] = 1
        self._liveness(plan)
        self._fill_pts(plan)
        return plan

    def _run_gts(self, plan: StepPlan) -> None:
        """Running GTs decode one token each; hosted spans are vacated as their writer arrives."""
        for r in list(self.running.values()):
            if r.rid not in self.running:
                continue  # preempted while evicting an earlier writer's lends
            lends = self.lends.get(r.rid)
            if lends:
                pos = r.computed - self.origin[r.rid]
                while lends and lends[0].offset <= pos:
                    lend = lends.pop(0)
                    h = self.requests.get(lend.hosted)
                    if h is not None and self.host_of.get(h.rid) is lend:
                        self._evict_hosted(h, plan)
            if r.computed + 1 > self.cap[r.rid] and not self._extend(r):
                if r.rid in self.host_of:  # its tokens live in the writer's span, which it cannot keep
                    self._preempt(r, plan)
                else:
                    self._pause(r, plan)
                continue
            plan.tokens[r.rid] = 1

    def _admit_gts(self) -> list[Request]:
        """SyncDecouple step ①: fill the non-reserved KV with queued GTs (groups with S, best fit with O)."""
        started: list[Request] = []
        i = 0
        while i < len(self.gt_queue):
            avail = self.kv.free - self.reserve_blocks
            if avail <= 0 or self._active() >= self.cfg.max_num_seqs:
                break
            j, end = 0, len(self.gt_queue)
            if self.O:  # the longest task that fits, segment by segment in priority order
                j, end = find_fitting(self.gt_queue, max(1, int(avail * self.cfg.block_size / (1 + self.cfg.padding))), i)
                if j < 0:
                    i = end
                    continue
            r = self.gt_queue.peek(j)
            if not self._admit_gt(r, avail):
                if not self.O:
                    break  # FCFS: head-of-line waits
                i = end
                continue
            started.append(r)
            if self.S:
                for mate in list(self.groups.get(self._group(r), ())):
                    if self._active() >= self.cfg.max_num_seqs or not self._admit_gt(mate, self.kv.free - self.reserve_blocks):
                        break  # the group is split: the rest waits for the next free KV
                    started.append(mate)
        return started

    def _active(self) -> int:
        return len(self.running) + len(self.prefilling)

    def _pipeline(self, writer: Request, region: int, depth: int) -> list[Request]:
        """Step ②: lend the writer's idle halves to the longest queued GTs that finish in time."""
        hosted: list[Request] = []
        for offset, limit, level in nested_slots(region, self.cfg.buffer, depth):
            if self._active() >= self.cfg.max_num_seqs:
                break
            j = bisect.bisect_right(self.by_rl, limit, key=lambda e: e[0]) - 1
            if j < 0:
                continue
            span, _, h = self.by_rl[j]
            self._unqueue_gt(h)
            self._start_gt(h, h.computed + span)
            self._lend(Lend(writer.rid, h.rid, offset, span))
            self.stats["hosted"] += 1
            hosted.append(h)
            if depth > level:
                hosted += self._pipeline(h, span, depth - level)
        return hosted

    def _lend(self, lend: Lend) -> None:
        bisect.insort(self.lends.setdefault(lend.writer, []), lend, key=lambda x: x.offset)
        self.host_of[lend.hosted] = lend

    def _release_lends(self, r: Request) -> None:
        """``r`` leaves its region (finished, moved out or preempted): its hosted GTs stay safe.

        If ``r`` was itself hosted, its region lies in its writer's blocks: the nested spans are re-lent
        by that writer at their absolute offsets. If ``r`` owned its blocks (it finished), the blocks of
        each live span pass to the hosted GT.
        """
        own_lend = self.host_of.get(r.rid)
        for lend in self.lends.pop(r.rid, []):
            h = self.requests.get(lend.hosted)
            if h is None or self.host_of.get(h.rid) is not lend:
                continue
            if own_lend is not None:
                self._lend(Lend(own_lend.writer, h.rid, own_lend.offset + lend.offset, lend.length))
            else:
                moved = min(blocks_for(lend.length, self.cfg.block_size), self.kv.of(r.rid))
                self.kv.shrink(r.rid, moved)
                self.kv.add(h.rid, moved)
                del self.host_of[h.rid]

    def _liveness(self, plan: StepPlan) -> None:
        """If no GT or PT can run and GTs wait, start the head with what is free (or free some by recompute)."""
        # loop: one preemption may not free enough, and an empty plan tells the host nothing can run
        while not plan.tokens and not self.prefilling and self.gt_queue:
            head = self.gt_queue.peek(0)
            grow = min(self.kv.free, self._target(head, self._padded(self._remaining(head))) - self.kv.of(head.rid))
            if head.computed + 1 <= (self.kv.of(head.rid) + max(grow, 0)) * self.cfg.block_size:
                self._unqueue_gt(head)
                self.kv.grow_to(head.rid, self.kv.of(head.rid) + max(grow, 0))
                self._start_gt(head, self._own_cap(head))
                plan.tokens[head.rid] = 1
            elif len(self.gt_queue) > 1:
                self._preempt(self.gt_queue.peek(len(self.gt_queue) - 1), plan)
            else:
                return

    def _fill_pts(self, plan: StepPlan) -> None:
        """Step ③: PTs (chunks) fill the step up to the TFS."""
        budget = self.cfg.tfs - len(plan.tokens)
        for r in self.prefilling:
            if budget <= 0:
                return
            n = min(r.uncomputed, budget)
            plan.tokens[r.rid] = n
            budget -= n
        bs = self.cfg.block_size
        while self.pt_queue and budget > 0 and self._active() < self.cfg.max_num_seqs:
            j = 0
            if self.O:
                i = 0
                while i < len(self.pt_queue):
                    k, end = find_fitting(self.pt_queue, budget, i)
                    if k >= 0:
                        j = k
                        break
                    i = end
            r = self.pt_queue.peek(j)
            extra = 0 if self.D else self._padded(self._remaining(r))
            need = blocks_for(min(r.seq_len + extra, self.max_seq_len(r)), bs) - self.kv.of(r.rid)
            if need > self._pt_room() or not self.adapter_slot(r):
                break
            self.pt_queue.pop(j)
            self.kv.grow_to(r.rid, self.kv.of(r.rid) + need)
            r.phase = Phase.PREFILL
            self.prefilling.append(r)
            n = min(r.uncomputed, budget)
            plan.tokens[r.rid] = n
            budget -= n

    def _pt_room(self) -> int:
        """Blocks a new PT may take.

        Coupled: anything outside the reserve. Decoupled: the reserve always (the paper keeps it "for
        adding PTs at each iteration"), and beyond it only what leaves the head GT able to start — a
        prompt admitted into KV the waiting GTs need would only lengthen the GT queue, holding KV idle.
        """
        if not self.D:
            return self.kv.free - self.reserve_blocks
        if not self.gt_queue:
            return self.kv.free
        head = self.gt_queue.peek(0)
        head_need = self._target(head, self._padded(self._remaining(head))) - self.kv.of(head.rid)
        return min(self.kv.free, max(self.reserve_blocks, self.kv.free - self.reserve_blocks - head_need))

    def _after_step(self, plan: StepPlan, finished: set[int], now: float) -> None:
        for rid in plan.tokens:
            r = self.requests.get(rid)
            if r is None or r.phase is not Phase.PREFILL or r.uncomputed != 1:
                continue
            self.prefilling.remove(r)
            if self.D:
                self._queue_gt(r, _RESUMED if r.preemptions else _NEW)
            else:
                self._start_gt(r, self._own_cap(r))

    def _on_host_preempt(self, r: Request, now: float) -> None:
        if r in self.pt_queue:  # not admitted here: only its KV goes
            self.kv.release(r.rid)
            r.computed = 0
            return
        if r in self.prefilling:
            self.prefilling.remove(r)
        self._preempt(r, StepPlan())  # lends, ledger and queues as for the policy's own preemption (a resumed PT)

    def _on_abort(self, r: Request, now: float) -> None:
        if r in self.pt_queue:
            self.pt_queue.remove(r)
        elif r in self.gt_queue:
            self._unqueue_gt(r)
        self._on_finish(r, now)

    def _on_finish(self, r: Request, now: float) -> None:
        if r in self.prefilling:
            self.prefilling.remove(r)
        self._release_lends(r)
        self._stop_gt(r)
        self.host_of.pop(r.rid, None)

    def check(self) -> None:
        """Invariants for tests: ledger within capacity; every running GT within its allocation."""
        self.kv.check()
        for rid, r in self.running.items():
            assert r.computed <= self.cap[rid], (rid, r.computed, self.cap[rid])
            lend = self.host_of.get(rid)
            if lend is None:
                assert self.cap[rid] <= self._own_cap(r), (rid, self.cap[rid], self._own_cap(r))
            else:
                w = self.requests.get(lend.writer)
                if w is not None and w.rid in self.origin:
                    assert w.computed - self.origin[w.rid] <= lend.offset, (w.rid, rid)
