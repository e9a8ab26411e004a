"""SeaLLM's doubling-budget (DB) scheduling of several services in one engine (SeaLLM §4.2 and its Algorithm 2), as
their policy in our code.

A *service* is a model or a LoRA adapter the engine serves (``Request.service``). SeaLLM predicts no request's length:
it profiles each service, the mean ``L_s`` and the spread ``V_s`` of its requests' execution time, and gives every
request a budget ``Q = L_s + V_s`` of execution that its own execution spends. A request's priority is
``O_r = Q_r x L_s`` (the remaining budget times the service's mean; smaller runs first): the c-mu rule that minimises
the expected normalised latency when the remaining time is estimated by the budget. A request that spends its budget
gets a new one twice as large (``2 (L_s + V_s)``, then twice that, ...) and its priority is reset from it, so a
request far longer than its service's mean sinks behind the others instead of blocking them. A request that has
waited past the starvation threshold (``aging_s``) is served first.

In our code:

- Execution time is counted in output tokens: decode dominates a request's time and every step advances each request
  by one token, so a service's profile is the mean and standard deviation of its finished requests' output lengths
  (Welford's running moments). A service with no finished request yet takes the profile of all finished requests,
  and before any, ``max_model_len / 4``.
- It runs inside vLLM's loop (:class:`~serving.policy.baselines.VLLMPolicy` with the priority order): waiting requests
  are admitted by priority, and when KV runs out the running request with the worst priority is preempted by
  recompute. SeaLLM also preempts running requests for better-ranked waiting ones between iterations; here a running
  request leaves the batch only under KV pressure, as vLLM's priority policy does.
- SeaLLM batches one phase of one service per iteration, since its services are separate models; in one vLLM engine
  the services are LoRA adapters of one base and share every batch, so this order is the whole policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving.policy.baselines import VLLMPolicy
from serving.policy.request import Request, SortedQueue


@dataclass
class ServiceProfile:
    """Running mean and variance of one service's execution time (output tokens), Welford's update."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0


class SeaLLMPolicy(VLLMPolicy):
    """SeaLLM's doubling-budget order over services, in vLLM's loop (see the module docstring)."""

    name = "seallm"
    priority = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.profiles: dict[str, ServiceProfile] = {}
        self.overall = ServiceProfile()
        self._spent: dict[int, float] = {}  # rid -> output tokens at which its current budget started
        self._budget: dict[int, float] = {}  # rid -> its current budget Q (output tokens)
        self._now = 0.0

    # -- the service's profile and the request's budget -------------------------------------------------------------
    def profile(self, service: str) -> tuple[float, float]:
        """(L_s, V_s): the service's mean and spread of output tokens, else everyone's, else a quarter context."""
        p = self.profiles.get(service)
        if p is not None and p.n:
            return p.mean, p.std
        if self.overall.n:
            return self.overall.mean, self.overall.std
        return self.cfg.max_model_len / 4, 0.0

    def _remaining_budget(self, req: Request) -> float:
        """Q_r: what is left of the request's current budget, doubling it (from the profile as it is now) each time it
        is spent."""
        mean, spread = self.profile(req.service)
        base = max(1.0, mean + spread)
        start = self._spent.setdefault(req.rid, 0.0)
        budget = self._budget.setdefault(req.rid, base)
        while req.generated - start >= budget:  # spent: a fresh budget twice the last
            start += budget
            budget *= 2
        self._spent[req.rid], self._budget[req.rid] = start, budget
        return budget - (req.generated - start)

    def _key(self, req: Request) -> tuple:
        starved = self._now - req.arrival >= self.cfg.aging_s and req.generated == 0
        return (0 if starved else 1, self._remaining_budget(req) * self.profile(req.service)[0])

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _schedule(self, now: float):
        self._now = now
        if self.waiting:  # keys move with the profiles, the budgets and the clock: order the queue afresh each step
            requeued = SortedQueue()
            for req in self.waiting:
                requeued.push(self._rank(req), req)
            self.waiting = requeued
        return super()._schedule(now)

    def _completed(self, req: Request) -> None:
        self.profiles.setdefault(req.service, ServiceProfile()).add(req.generated)
        self.overall.add(req.generated)

    def _on_finish(self, req: Request, now: float) -> None:
        super()._on_finish(req, now)
        self._spent.pop(req.rid, None)
        self._budget.pop(req.rid, None)

    def _on_abort(self, req: Request, now: float) -> None:
        super()._on_abort(req, now)
        self._spent.pop(req.rid, None)
        self._budget.pop(req.rid, None)
