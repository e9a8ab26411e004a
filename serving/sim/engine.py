"""The discrete-event simulator: one engine instance stepping a policy over a trace.

Events are arrivals and step completions. Each step the policy (the same object the vLLM adapter
drives) decides the batch; the latency model prices it; time advances by that price; the simulator,
which alone knows each request's true RL, reports which requests emitted their last token. When
nothing can run, time jumps to the next arrival. Deterministic: no randomness here at all — arrivals and
predictions are fixed before the run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from serving.perf.latency import LatencyModel
from serving.perf.slo import SLO
from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy
from serving.policy.request import Prediction, Request
from serving.sim.instance import SimInstance, new_request
from serving.sim.metrics import RequestRecord, RunMetrics, summarize
from serving.sim.refinement import RefinedNoise


class SimulationError(RuntimeError):
    """The run cannot continue (a policy that schedules nothing while work remains, or a step cap)."""


def simulate(requests: Sequence, predictions: Sequence[Prediction], policy_name: str, config: PolicyConfig,
             kv_blocks: int, latency: LatencyModel, slo: SLO,
             repredict: Callable[[object, int, Prediction], float] | None = None,
             check: bool = False, max_steps: int = 50_000_000, max_tokens: int | None = None,
             records: dict[int, RequestRecord] | None = None, refinements: RefinedNoise | None = None) -> RunMetrics:
    """Run ``requests`` (objects with rid, arrival, prompt_tokens, output_tokens) through one policy; ``max_tokens``
    is every request's cap, as an engine would get it (see :func:`~serving.sim.instance.new_request`). ``records``,
    when given, receives each request's record (a bench that reports means the summary leaves out).
    ``refinements``: a sharper prediction handed to the policy when a request has written each of its points
    (:mod:`serving.sim.refinement`)."""
    by_rid = {r.rid: r for r in requests}
    preds = {r.rid: p for r, p in zip(requests, predictions)}
    policy = make_policy(policy_name, config, kv_blocks, repredict_hook(repredict, by_rid, preds))
    order = sorted(requests, key=lambda r: (r.arrival, r.rid))
    records = {} if records is None else records
    inst = SimInstance("instance-0", policy, latency, {r.rid: r.output_tokens for r in requests}, records, check)
    now = 0.0
    nxt = 0
    refined: set[tuple[int, int]] = set()
    t_wall = time.perf_counter()
    while nxt < len(order) or inst.has_work:
        while nxt < len(order) and order[nxt].arrival <= now:
            tr = order[nxt]
            inst.inbox.append(new_request(tr, preds[tr.rid], slo.jct_limit, max_tokens))
            records[tr.rid] = RequestRecord(tr.rid, tr.arrival, tr.prompt_tokens, tr.output_tokens,
                                            slo.jct_limit(tr.output_tokens), service=tr.service)
            nxt += 1
        if not inst.start(now):
            if nxt < len(order):
                now = max(now, order[nxt].arrival)
                continue
            raise SimulationError(f"policy {policy_name} scheduled nothing with {len(policy.requests)} requests left "
                                  f"and no arrivals pending (KV {policy.kv.used}/{policy.kv.total} blocks)")
        now = inst.end().now
        if refinements is not None:
            _refine(policy, refinements, by_rid, refined)
        if inst.steps >= max_steps:
            raise SimulationError(f"policy {policy_name}: step cap {max_steps} reached at t={now:.1f}s")
    m = summarize_instances(policy_name, [inst], records, slo, config, kv_blocks, now, time.perf_counter() - t_wall)
    if refinements is not None:
        m.extra["refinements"] = policy.stats.get("refinements", 0)
    return m


def repredict_hook(repredict: Callable[[object, int, Prediction], float] | None, by_rid: dict, preds: dict):
    """The policy's re-prediction callback, answered by the host's length oracle (None: the policy's own rule), from
    the request's refined prediction once it has one."""
    if repredict is None:
        return None

    def hook(req: Request) -> float:
        return repredict(by_rid[req.rid], req.generated, req.pred if req.extra.get("refined") else preds[req.rid])
    return hook


def _refine(policy, refinements: RefinedNoise, by_rid: dict, done: set[tuple[int, int]]) -> None:
    """Hand the policy each refinement due: a request that has just written one of the points' tokens."""
    points = refinements.sigma
    for req in list(policy.requests.values()):
        k = req.generated
        if k in points and (req.rid, k) not in done:
            done.add((req.rid, k))
            pred = refinements.at(by_rid[req.rid], k)
            if pred is not None:
                policy.refine(req.rid, pred)


def _stat(instances: Sequence[SimInstance], key: str) -> float:
    return sum(i.policy.stats[key] for i in instances)


def summarize_instances(name: str, instances: Sequence[SimInstance], records: dict[int, RequestRecord], slo: SLO,
                        config: PolicyConfig, kv_blocks: int, makespan: float, wall_s: float) -> RunMetrics:
    """One summary over one or more instances: KV and batch figures are per-step averages over all of them."""
    steps = sum(i.steps for i in instances)
    samples = sum(i.kv_samples for i in instances)
    return summarize(
        policy=name, records=list(records.values()), slo=slo, makespan=makespan, steps=steps,
        kv_utilization=sum(i.kv_used_tokens for i in instances) / max(samples, 1) / (kv_blocks * config.block_size),
        kv_allocated=sum(i.kv_used_blocks for i in instances) / max(steps, 1) / kv_blocks,
        forward_size=sum(i.fwd_tokens for i in instances) / max(steps, 1),
        batch_size=sum(i.batch for i in instances) / max(steps, 1),
        preemptions=_stat(instances, "preemptions"), pauses=_stat(instances, "pauses"), hosted=_stat(instances, "hosted"),
        sched_us_per_step=_stat(instances, "sched_s") / max(steps, 1) * 1e6, wall_s=wall_s,
        busy_s=sum(i.busy_s for i in instances),
    )


def poisson_arrivals(n: int, rate: float, seed: int, cv: float = 1.0) -> np.ndarray:
    """``n`` arrival times at ``rate`` req/s (first arrival at 0): a Poisson process, or with ``cv`` other than 1 a
    Gamma renewal process whose gaps spread ``cv`` times their mean (bursts where ``cv`` > 1) at the same rate."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    if not cv > 0 or math.isinf(cv):
        raise ValueError(f"cv must be a positive number, got {cv}")
    rng = np.random.default_rng(seed)
    if cv == 1.0:
        gaps = rng.exponential(1.0 / rate, size=n)
    else:
        gaps = rng.gamma(1.0 / cv**2, cv**2 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)
