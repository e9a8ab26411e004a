"""lengthwise: vLLM's continuous batching, admitted by the projected peak of KV use, shortest predicted first.

EcoServe's exact allocation reserves each GT's whole predicted RL up front, although on average only half
of it is written at any moment; its KVC pipelining recovers part of that idle half with nested halves.
This policy does the general version of the same idea: it admits a waiting request only if, projecting
every running request forward (one token per step until its padded predicted RL, then release), the KV
in use never exceeds the pool at any future step. The peak of that piecewise-linear curve sits just
before some request finishes, so one sort and one pass over the running set check it (O(n log n)).

Steps are filled to the target forward size (TFS), not vLLM's larger default token budget, so long
prompts are chunked and running decodes keep their pace. Blocks are still allocated on demand as in
vLLM, so nothing is reserved and idle. When a request outlives its prediction, its remaining RL is
re-predicted (conditional on the length so far); if the pool runs out anyway, vLLM's recompute
preemption is the fallback. The waiting queue is ordered by predicted RL with linear aging (``sjf``),
or FCFS in the ``lengthwise-fcfs`` ablation, and a request that can no longer meet its deadline at the
engine's measured pace yields to those that can (the late tier, :mod:`serving.policy.deadline`).
Ablation chain: ``sarathi`` (vLLM with the TFS budget) → ``lengthwise-fcfs`` (+ projected-peak
admission) → ``lengthwise-sjf`` (+ shortest predicted first) → ``lengthwise`` (+ the late tier).
"""

from __future__ import annotations

import bisect
import math

from serving.policy.base import StepPlan
from serving.policy.baselines import SJFPolicy
from serving.policy.deadline import LateTier
from serving.policy.request import Request


class LengthwisePolicy(SJFPolicy):
    name = "lengthwise"

    @property
    def budget(self) -> int:
        """Tokens per step capped at the target forward size, as EcoServe and Sarathi-Serve do: past it a
        step only grows slower, and every running decode waits for it."""
        return self.cfg.tfs

    def __init__(self, *args, fcfs: bool = False, late_tier: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fcfs = fcfs
        if fcfs:
            self.name = "lengthwise-fcfs"
            self.priority = False
        elif not late_tier:
            self.name = "lengthwise-sjf"
        self.tier = LateTier(self.cfg.aging_s, self.cfg.late_margin) if late_tier and not fcfs else None
        self.limit = self.kv.total - math.ceil(self.cfg.reserve * self.kv.total)
        self.stats["peak_refusals"] = 0
        self.stats["late"] = 0
        self._projection: list[tuple[int, int]] | None = None
        self._projected_tokens = 0
        self._busy = False  # the previous step ran requests: the interval to this one is a TBT

    def _key(self, req: Request) -> tuple:
        if self.fcfs:
            return ()
        return (self.tier is not None and req.rid in self.tier.late, *super()._key(req))

    def _expected_remaining(self, req: Request) -> int:
        """Tokens the late tier expects ``req`` still to write: what its prediction has left."""
        return req.planned_rl - req.generated

    def _yields(self, req: Request, now: float, budget: int) -> bool:
        tier = self.tier
        if tier is None or not tier.is_late(req, now, self._expected_remaining(req), budget):
            return False
        self.waiting.pop()
        tier.demote(req)
        self.waiting.push(self._rank(req), req)
        self.stats["late"] += 1
        return True

    def _on_refine(self, req: Request) -> None:
        self._projection = None  # the KV it is projected to need changed
        super()._on_refine(req)

    def _on_finish(self, req: Request, now: float) -> None:
        super()._on_finish(req, now)
        if self.tier is not None:
            self.tier.forget(req.rid)

    def _on_abort(self, req: Request, now: float) -> None:
        super()._on_abort(req, now)
        if self.tier is not None:
            self.tier.forget(req.rid)

    def _remaining(self, r: Request) -> int:
        """Padded predicted tokens still to come; re-predicted once the request outlived its prediction."""
        rem = r.planned_rl - r.generated
        if rem <= 0:
            rem = self.plan_rl(r, r.generated + self.repredict(r)) - r.generated
        return max(1, min(math.ceil(rem * (1 + self.cfg.padding)), self.max_seq_len(r) - r.seq_len + 1))

    def _schedule(self, now: float) -> StepPlan:
        self._projection = None  # running requests advanced: rebuild on the first admission test
        if self.tier is not None:
            self.tier.observe(now, self._busy)
            for rid in self.tier.due(now):  # waited aging_s: back among the on-time requests
                req = self.requests.get(rid)
                if req is not None and req in self.waiting:
                    self.waiting.remove(req)
                    self.waiting.push(self._rank(req), req)
        plan = super()._schedule(now)
        self._busy = bool(plan.tokens)
        return plan

    def _admissible(self, req: Request) -> bool:
        if not self.running:  # liveness: a projection over the pool (a huge prediction) must not block an idle engine
            return True
        bs = self.cfg.block_size
        if self._projection is None:  # sorted once per step; admitted requests are inserted in place
            self._projection = sorted((self._remaining(r), r.seq_len) for r in self.running)
            self._projected_tokens = sum(c for _, c in self._projection)
        item = (self._remaining(req), req.seq_len)
        items = self._projection
        at = bisect.bisect_left(items, item)
        tokens = self._projected_tokens + item[1]
        n = len(items) + 1
        for k in range(len(items) + 1):  # usage just before each request's projected finish
            rem, c = item if k == at else items[k - (k > at)]
            if (tokens + (rem - 1) * n) / bs + n > self.limit:
                self.stats["peak_refusals"] += 1
                return False
            tokens -= c
            n -= 1
        items.insert(at, item)
        self._projected_tokens += item[1]
        return True
