"""One simulated engine instance: a policy stepped against a latency model, with the truth the host knows.

Both the single-instance simulator and the cluster simulator drive instances through this class, so a
step is priced, recorded and applied one way. Requests that reach an instance join it at its next step
boundary (as vLLM's scheduler sees new requests only between steps); a step runs from ``start(now)``
to ``busy_until``, when ``end()`` applies it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from serving.perf.latency import LatencyModel, StepShape
from serving.policy.base import Policy
from serving.policy.request import Request, capped_length
from serving.sim.metrics import RequestRecord


@dataclass(slots=True)
class StepResult:
    now: float
    first: list[int]        # requests whose first output token came out
    emitted: list[int]      # every request that produced a token this step
    finished: list[int]     # requests whose last token came out
    preempted: list[int]


@dataclass(eq=False)
class SimInstance:
    name: str
    policy: Policy
    latency: LatencyModel
    truth: dict[int, int]                 # rid -> true RL (shared with the host)
    records: dict[int, RequestRecord]     # shared with the host
    check: bool = False
    busy_until: float = math.inf          # end of the running step; inf when idle
    inbox: list[Request] = field(default_factory=list)
    steps: int = 0
    busy_s: float = 0.0
    kv_used_blocks: float = 0.0
    kv_used_tokens: float = 0.0
    kv_samples: int = 0
    fwd_tokens: float = 0.0
    batch: float = 0.0
    plan: object = None                  # the running step's StepPlan
    # prices a step that shares its GPUs with other instances' (serving.sim.mesh): (shape, now) -> seconds from now
    # to the step's end, waits included; None: the latency model alone prices it
    pricer: Callable[[StepShape, float], float] | None = None
    _emit: tuple = ()

    @property
    def idle(self) -> bool:
        return self.busy_until == math.inf

    @property
    def has_work(self) -> bool:
        return bool(self.inbox) or self.policy.has_work

    def start(self, now: float) -> bool:
        """Admit the inbox, let the policy plan a step and price it; False when it schedules nothing."""
        policy = self.policy
        if self.inbox:
            for req in self.inbox:
                policy.add(req, now)
            self.inbox.clear()
        plan = policy.schedule(now)
        if not plan.tokens:
            return False
        # the step's shape (StepShape.of, inlined: this is the simulator's hot path)
        prefill = decode = kv_read = 0
        attn2 = 0.0
        finished, first, emitted = [], [], []
        reqs = policy.requests
        truth = self.truth
        for rid, n in plan.tokens.items():
            r = reqs[rid]
            c = r.computed
            seq = r.prompt_len + r.generated
            if n == 1 and c == seq - 1 and r.generated > 0:
                decode += 1
                kv_read += c
            else:
                prefill += n
                kv_read += c + n
                attn2 += n * (c + n / 2)
            if c + n == seq:
                emitted.append(rid)
                if r.generated == 0:
                    first.append(rid)
                if r.generated + 1 >= truth[rid]:
                    finished.append(rid)
        shape = StepShape(prefill, decode, kv_read, len(plan.tokens), attn2)
        dt = self.latency.step_time(shape) if self.pricer is None else self.pricer(shape, now)
        self.busy_until = now + dt
        self.busy_s += dt
        self.steps += 1
        self.kv_used_blocks += policy.kv.used
        if self.check or self.steps % 8 == 0:  # written KV is an O(requests) sum: sampled every 8th step
            self.kv_used_tokens += policy.used_tokens()
            self.kv_samples += 1
        self.fwd_tokens += prefill + decode
        self.batch += len(plan.tokens)
        self.plan = plan
        self._emit = (first, emitted, finished)
        return True

    def end(self) -> StepResult:
        """Apply the running step at its end time; the instance is idle afterwards."""
        now = self.busy_until
        plan = self.plan
        first, emitted, finished = self._emit
        records = self.records
        for rid in first:
            records[rid].first_token = now
        self.policy.update(plan, finished, now)
        for rid in finished:
            records[rid].finish(now)
        for rid in plan.preempted:
            records[rid].preemptions += 1
        if self.check:
            checker = getattr(self.policy, "check", None)
            (checker or self.policy.kv.check)()
        self.busy_until = math.inf
        self.plan = None
        return StepResult(now, first, emitted, finished, plan.preempted)


def new_request(tr, pred, jct_limit: Callable[[float], float], max_tokens: int | None = None) -> Request:
    """The policy's view of a trace request: its prediction and EcoServe's deadline from the predicted RL.

    With ``max_tokens`` (the request's cap) the policy holds it and sees the predicted length clamped to it, as the
    scheduler plug-in does with a request's ``max_tokens`` (``serving/engine/inputs.py``); the deadline stays the one
    the gateway sets, from the prediction as made."""
    deadline = tr.arrival + jct_limit(max(1.0, pred.length))
    if max_tokens is not None:
        pred = dataclasses.replace(pred, length=capped_length(pred.length, max_tokens))
    return Request(tr.rid, tr.arrival, tr.prompt_tokens, pred, deadline=deadline, max_tokens=max_tokens,
                   service=tr.service)
