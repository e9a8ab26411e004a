"""Several models sharing one GPU mesh, each as its own engine: the simulator of MuxServe's LLM units.

A mesh that serves several models runs one engine per model (its own weights, policy and KV quota) on the same GPUs.
Each engine steps as in the single-instance simulator; what they take from each other is priced here, at each
step's start, in one of two ways of sharing:

- ``mps`` (MuxServe's flexible spatial-temporal multiplexing, MuxServe §3): each model's prefill and decode jobs get
  a percentage of the SMs under NVIDIA MPS, so a step's compute runs at its job's share. Concurrent steps share the
  HBM bandwidth as processor sharing does: a step's reads stretch by one for each step reading beside it (each
  counted by the share of its own duration it spends reading), so two steps that only read take twice as long.
  Prefills run one at a time across the mesh, as MuxServe's estimator and its scheduler's single prefill job have
  them (§3.3): a prefill waits for the one before it.
- ``temporal`` (AlpaServe-style temporal multiplexing): one step at a time on the whole mesh, first come first
  served across the models.

Not modelled: MPS's own interference beyond the bandwidth (the L2 cache, the launch queues), ADBS's moves of KV
quotas as the load shifts (each model keeps a fixed quota), and a unified KV cache's fragmentation.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from serving.perf.latency import MIN_STEP_S, RooflineLatency, StepShape
from serving.perf.slo import SLO
from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy
from serving.policy.request import Prediction
from serving.sim.engine import SimulationError, summarize_instances
from serving.sim.instance import SimInstance, new_request
from serving.sim.metrics import RequestRecord, RunMetrics
from serving.sim.workload import TraceRequest

SHARING = ("mps", "temporal")


@dataclass(frozen=True)
class MeshModel:
    """One model of a mesh: its requests and their predictions, its engine's policy and KV quota, its step model on
    the whole mesh, the SLO its requests are judged by, and (``mps``) the SM shares of its prefill and decode jobs."""

    name: str
    requests: Sequence
    predictions: Sequence[Prediction]
    policy: str
    config: PolicyConfig
    kv_blocks: int
    latency: RooflineLatency
    slo: SLO
    prefill_share: float = 1.0
    decode_share: float = 1.0

    def __post_init__(self) -> None:
        for name, v in (("prefill_share", self.prefill_share), ("decode_share", self.decode_share)):
            if not 0 < v <= 1:
                raise ValueError(f"{self.name}: {name} must be in (0, 1], got {v}")
        if len(self.requests) != len(self.predictions):
            raise ValueError(f"{self.name}: {len(self.requests)} requests but {len(self.predictions)} predictions")


class _Contention:
    """The mesh's shared resources, as each step's price sees them at its start."""

    def __init__(self, models: Sequence[MeshModel], sharing: str) -> None:
        if sharing not in SHARING:
            raise ValueError(f"unknown sharing {sharing!r}: one of {', '.join(SHARING)}")
        self.models, self.sharing = models, sharing
        self.exclusive_free = 0.0  # when the mesh (temporal) or its prefill job (mps) is next free
        self.drawing: dict[int, tuple[float, float]] = {}  # model -> (its step's end, the bandwidth share it draws)
        self.waited_s = [0.0] * len(models)

    def price(self, i: int, s: StepShape, now: float) -> float:
        """Seconds from ``now`` to the end of model ``i``'s step of shape ``s``, its wait for the mesh included."""
        m = self.models[i]
        compute, memory = m.latency.parts(s)
        overhead = m.latency.overhead_s
        if self.sharing == "temporal":
            start = max(now, self.exclusive_free)
            run = max(compute, memory) + overhead
            self.exclusive_free = start + run
        else:
            prefill = s.prefill_tokens > 0
            if prefill and s.decode_tokens:
                share = min(m.prefill_share, m.decode_share)
            else:
                share = m.prefill_share if prefill else m.decode_share
            start = max(now, self.exclusive_free) if prefill else now
            beside = sum(f for j, (end, f) in self.drawing.items() if j != i and end > start)
            reads = memory * (1 + beside)
            run = max(compute / share, reads) + overhead
            if prefill:
                self.exclusive_free = start + run
            # the share of its step this one spends streaming, as the next step to start sees it beside it: k steps
            # that only read stretch each other k times (processor sharing of the bandwidth)
            self.drawing[i] = (start + run, reads / run)
        self.waited_s[i] += start - now
        return max(start + run - now, MIN_STEP_S)


def simulate_mesh(models: Sequence[MeshModel], sharing: str = "mps", check: bool = False,
                  max_steps: int = 50_000_000, records: dict[int, RequestRecord] | None = None) -> dict[str, RunMetrics]:
    """Every model's requests through its own engine on one shared mesh; each model's metrics over its own requests
    (its span ends at its own last step). Request ids need only be unique within a model: ``records``, when given,
    receives every request's record under a mesh-wide id, its model's name as its ``service``."""
    if not models:
        raise ValueError("a mesh needs at least one model")
    contention = _Contention(models, sharing)
    records = {} if records is None else records
    truth: dict[int, int] = {}
    arrivals = []  # (arrival, global id, model index, request)
    for i, m in enumerate(models):
        for k, (r, p) in enumerate(zip(m.requests, m.predictions)):
            gid = len(truth)
            truth[gid] = r.output_tokens
            arrivals.append((r.arrival, gid, i, r, p))
    arrivals.sort(key=lambda a: (a[0], a[1]))
    fleet = []
    for i, m in enumerate(models):
        inst = SimInstance(m.name, make_policy(m.policy, m.config, m.kv_blocks), m.latency, truth, records, check)
        inst.pricer = (lambda s, now, i=i: contention.price(i, s, now))
        fleet.append(inst)
    mine: list[dict[int, RequestRecord]] = [{} for _ in models]
    last_end = [0.0] * len(models)
    ends: list[tuple[float, int]] = []
    now, nxt = 0.0, 0
    t_wall = time.perf_counter()
    while True:
        t = min(ends[0][0] if ends else math.inf, arrivals[nxt][0] if nxt < len(arrivals) else math.inf)
        if t == math.inf:
            break
        now = max(now, t)
        while ends and ends[0][0] <= now:
            _, i = heapq.heappop(ends)
            fleet[i].end()
            last_end[i] = now
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            _, gid, i, r, p = arrivals[nxt]
            nxt += 1
            m = models[i]
            tr = TraceRequest(gid, r.arrival, r.prompt_tokens, r.output_tokens, service=m.name)
            fleet[i].inbox.append(new_request(tr, p, m.slo.jct_limit))
            rec = RequestRecord(gid, r.arrival, r.prompt_tokens, r.output_tokens, m.slo.jct_limit(r.output_tokens),
                                service=m.name)
            records[gid] = mine[i][gid] = rec
        for i, inst in enumerate(fleet):  # idle engines with work start, in model order (the mesh's prices are FCFS)
            if inst.idle and inst.has_work and inst.start(now):
                heapq.heappush(ends, (inst.busy_until, i))
                if inst.steps >= max_steps:
                    raise SimulationError(f"mesh model {inst.name}: step cap {max_steps} reached at t={now:.1f}s")
        if not ends and nxt >= len(arrivals):
            stuck = [inst.name for inst in fleet if inst.has_work]
            if stuck:
                raise SimulationError(f"{', '.join(stuck)} scheduled nothing with work left and no arrivals pending")
    wall = time.perf_counter() - t_wall
    out = {}
    for i, (m, inst) in enumerate(zip(models, fleet)):
        run = summarize_instances(m.policy, [inst], mine[i], m.slo, m.config, m.kv_blocks, last_end[i], wall)
        run.extra.update({"sharing": sharing, "waited_for_mesh_s": contention.waited_s[i]})
        out[m.name] = run
    return out

