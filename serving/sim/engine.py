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
from dataclasses import dataclass

import numpy as np

from serving.policy.base import make_policy
from serving.policy.config import PolicyConfig
from serving.policy.request import Prediction, Request
from serving.sim.latency import LatencyModel, StepShape, isolated_latency
from serving.sim.metrics import RequestRecord, RunMetrics, summarize


class SimulationError(RuntimeError):
    """The run cannot continue (a policy that schedules nothing while work remains, or a step cap)."""


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets. EcoServe's JCT SLO is ``scale × (t_p + t_g × RL)`` with the workload's mean t_p, t_g."""

    scale: float
    t_p: float
    t_g: float
    ttft_s: float
    tpot_s: float

    def jct_limit(self, rl: float) -> float:
        return self.scale * (self.t_p + self.t_g * rl)


def derive_slo(latency: LatencyModel, prompts: Sequence[int], outputs: Sequence[int], scale: float,
               ttft_s: float | None = None, tpot_s: float | None = None, sample: int = 200) -> SLO:
    """Measure t_p and t_g of requests running alone (a deterministic sample) and build the SLOs.

    Defaults for the per-token SLOs: TTFT within ``scale`` × 5 mean prefills, TPOT within ``scale`` ×
    the isolated decode step (what DistServe-style SLOs express).
    """
    n = len(prompts)
    idx = np.linspace(0, n - 1, min(n, sample)).astype(int) if n else []
    pairs = [isolated_latency(latency, int(prompts[i]), int(outputs[i])) for i in idx]
    t_p = float(np.mean([p for p, _ in pairs])) if pairs else 0.0
    t_g = float(np.mean([g for _, g in pairs])) if pairs else 0.0
    return SLO(scale, t_p, t_g, ttft_s if ttft_s is not None else scale * 5 * t_p, tpot_s if tpot_s is not None else scale * t_g)


def simulate(requests: Sequence, predictions: Sequence[Prediction], policy_name: str, config: PolicyConfig,
             kv_blocks: int, latency: LatencyModel, slo: SLO,
             repredict: Callable[[object, int, Prediction], float] | None = None,
             check: bool = False, max_steps: int = 50_000_000) -> RunMetrics:
    """Run ``requests`` (objects with rid, arrival, prompt_tokens, output_tokens) through one policy."""
    by_rid = {r.rid: r for r in requests}
    preds = {r.rid: p for r, p in zip(requests, predictions)}
    hook = None
    if repredict is not None:
        def hook(req: Request) -> float:
            return repredict(by_rid[req.rid], req.generated, preds[req.rid])
    policy = make_policy(policy_name, config, kv_blocks, hook)
    order = sorted(requests, key=lambda r: (r.arrival, r.rid))
    records: dict[int, RequestRecord] = {}
    truth = {r.rid: r.output_tokens for r in requests}
    now = 0.0
    nxt = 0
    steps = 0
    busy = 0.0
    kv_used_blocks = kv_used_tokens = fwd_tokens = batch = 0.0
    samples = 0
    capacity_tokens = kv_blocks * config.block_size
    t_wall = time.perf_counter()
    while nxt < len(order) or policy.has_work:
        while nxt < len(order) and order[nxt].arrival <= now:
            tr = order[nxt]
            p = preds[tr.rid]
            req = Request(tr.rid, tr.arrival, tr.prompt_tokens, p,
                          deadline=tr.arrival + slo.jct_limit(max(1.0, p.length)))
            policy.add(req, now)
            records[tr.rid] = RequestRecord(tr.rid, tr.arrival, tr.prompt_tokens, tr.output_tokens,
                                            slo.jct_limit(tr.output_tokens))
            nxt += 1
        plan = policy.schedule(now)
        if not plan.tokens:
            if nxt < len(order):
                now = max(now, order[nxt].arrival)
                continue
            raise SimulationError(f"policy {policy_name} scheduled nothing with {len(policy.requests)} requests left "
                                  f"and no arrivals pending (KV {policy.kv.used}/{policy.kv.total} blocks)")
        # the step's shape (StepShape.of, inlined: this loop is the simulator's hot path)
        prefill = decode = kv_read = 0
        attn2 = 0.0
        finished = []
        first = []
        reqs = policy.requests
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
                if r.generated == 0:
                    first.append(rid)
                if r.generated + 1 >= truth[rid]:
                    finished.append(rid)
        dt = latency.step_time(StepShape(prefill, decode, kv_read, len(plan.tokens), attn2))
        now += dt
        busy += dt
        steps += 1
        kv_used_blocks += policy.kv.used
        if check or steps % 8 == 0:  # written KV is an O(requests) sum: sampled every 8th step
            kv_used_tokens += policy.used_tokens()
            samples += 1
        fwd_tokens += prefill + decode
        batch += len(plan.tokens)
        for rid in first:
            records[rid].first_token = now
        policy.update(plan, finished, now)
        for rid in finished:
            records[rid].finish(now)
        for rid in plan.preempted:
            records[rid].preemptions += 1
        if check:
            checker = getattr(policy, "check", None)
            (checker or policy.kv.check)()
        if steps >= max_steps:
            raise SimulationError(f"policy {policy_name}: step cap {max_steps} reached at t={now:.1f}s")
    wall = time.perf_counter() - t_wall
    return summarize(
        policy=policy_name, records=list(records.values()), slo=slo, makespan=now, steps=steps,
        kv_utilization=kv_used_tokens / max(samples, 1) / capacity_tokens,
        kv_allocated=kv_used_blocks / max(steps, 1) / kv_blocks,
        forward_size=fwd_tokens / max(steps, 1), batch_size=batch / max(steps, 1),
        preemptions=policy.stats["preemptions"], pauses=policy.stats["pauses"], hosted=policy.stats["hosted"],
        sched_us_per_step=policy.stats["sched_s"] / max(steps, 1) * 1e6, wall_s=wall, busy_s=busy,
    )


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """``n`` arrival times of a Poisson process at ``rate`` req/s (first arrival at 0)."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)
