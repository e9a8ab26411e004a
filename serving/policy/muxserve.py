"""MuxServe's adaptive batch scheduling (ADBS; MuxServe §3.3 and its Algorithm 3) of several services in one engine,
as their policy in our code.

MuxServe colocates several LLMs on one GPU unit and shares its KV cache between them. ADBS gives each LLM a quota of
KV token blocks, so that no LLM takes the whole pool (MuxServe's figure 9: first come, first served let the popular
LLM's long requests starve the others); it picks prefill jobs round-robin over the LLMs, prefill first, then fills
the rest of the step with decoding jobs round-robin while resources last; and it moves quota periodically from LLMs
that use little of theirs to LLMs that use all of theirs. The initial quotas follow each LLM's request rate.

In our code:

- A *service* is a model or a LoRA adapter the engine serves (``Request.service``); services of one engine share one
  KV pool and every batch, so a block is a block whatever its service.
- It runs inside vLLM's loop (:class:`~serving.policy.baselines.VLLMPolicy`): running requests decode first, as the
  engine steps them (MuxServe's decode jobs run until resources run out, as they do here); waiting requests are
  admitted round-robin over the services, one per service per turn, the turn's first service moving on each step.
- ``resource_enough`` is the service's quota: a waiting request is admitted only if its whole sequence fits in what
  is left of its service's quota (and in the pool). A request over quota waits without blocking other services'.
- When the pool cannot grow a running request, the victim is the newest request of the service furthest over its
  quota (used blocks / quota), so a service that borrowed pays first.
- Quotas are set in proportion to each service's arrivals so far whenever a service is first seen (the rate
  normalisation of MuxServe's token-block usage), each at least one full-length request; after that they move only
  by adaptation: every ``QUOTA_PERIOD`` steps a service using less than half its quota gives half its unused blocks to
  the services whose waiting requests its quota held back.
"""

from __future__ import annotations

from collections import Counter

from serving.policy.base import StepPlan
from serving.policy.baselines import VLLMPolicy
from serving.policy.request import Request, blocks_for

QUOTA_PERIOD = 50
"""Steps between two quota moves (MuxServe adapts 'periodically' and prints no period)."""
LOW_USE = 0.5
"""A service using less than this share of its quota gives blocks away."""


class MuxServePolicy(VLLMPolicy):
    """MuxServe's ADBS over services, in vLLM's loop (see the module docstring)."""

    name = "muxserve"
    priority = True  # vLLM's loop then takes the victim this policy names, wherever it stands in the running list

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.arrivals: Counter[str] = Counter()
        self.quota: dict[str, int] = {}
        self._turn = 0  # the service that admits first this step, as an index into the sorted services
        self._steps = 0
        self._deferred: list[Request] = []  # over quota this step: back in the queue after it
        self._held_back: set[str] = set()  # services whose quota kept a waiting request out since the last move

    # -- quotas ------------------------------------------------------------------------------------------------------
    def _set_quotas(self) -> None:
        """Quotas in proportion to each service's arrivals so far, every service at least one request's worth."""
        total = sum(self.arrivals.values())
        floor = blocks_for(self.cfg.max_model_len, self.cfg.block_size)
        self.quota = {s: max(floor, round(self.kv.total * n / total)) for s, n in self.arrivals.items()}

    def used(self, service: str) -> int:
        """KV blocks the service's requests hold now, running or waiting with blocks."""
        return sum(self.kv.of(r.rid) for r in self.running if r.service == service) + sum(
            self.kv.of(r.rid) for r in self.waiting if r.service == service)

    def _adapt(self) -> None:
        """Move half of a little-used service's unused quota to the services its quota held back."""
        takers = sorted(self._held_back)
        self._held_back.clear()
        if not takers:
            return
        for s in sorted(self.quota):
            if s in takers:
                continue
            used = self.used(s)
            if used < LOW_USE * self.quota[s]:
                give = (self.quota[s] - used) // 2
                self.quota[s] -= give
                for i, t in enumerate(takers):
                    self.quota[t] += give // len(takers) + (1 if i < give % len(takers) else 0)

    # -- the loop ----------------------------------------------------------------------------------------------------
    def _enqueue_new(self, req: Request, now: float) -> None:
        new = req.service not in self.arrivals
        self.arrivals[req.service] += 1
        if new:  # a service first seen: shares are set afresh (later ones move only by adaptation)
            self._set_quotas()
        super()._enqueue_new(req, now)

    def _interleave(self) -> None:
        """Order the queue round-robin over services (each service's own requests first come, first served), the
        turn's first service moving on each step."""
        services = sorted(self.arrivals)
        start = self._turn % len(services) if services else 0
        pos: Counter[str] = Counter()
        queued = list(self.waiting)
        for req in queued:
            self.waiting.remove(req)
        for req in queued:
            turn = (services.index(req.service) - start) % len(services)
            self.waiting.push((pos[req.service], turn), req)
            pos[req.service] += 1

    def _yields(self, req: Request, now: float, budget: int) -> bool:
        need = blocks_for(req.seq_len, self.cfg.block_size) - self.kv.of(req.rid)
        if self.used(req.service) + need <= self.quota.get(req.service, self.kv.total):
            return False
        self._held_back.add(req.service)
        self._deferred.append(self.waiting.pop())  # out of the way of the other services for this step
        return True

    def _victim(self) -> Request:
        over = {s: self.used(s) / max(1, q) for s, q in self.quota.items()}
        return max(self.running, key=lambda r: (over.get(r.service, 0.0), r.arrival))

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        super()._preempt(victim, plan)
        self._interleave()  # put back at the head by vLLM's rule; its service's turn decides here

    def _schedule(self, now: float) -> StepPlan:
        self._steps += 1
        if self._steps % QUOTA_PERIOD == 0:
            self._adapt()
        self._interleave()
        plan = super()._schedule(now)
        for req in self._deferred:
            self.waiting.push((0, 0), req)
        self._deferred.clear()
        self._turn += 1
        return plan
