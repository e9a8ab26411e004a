"""Several engine instances behind one or more gateways: the simulator for placement (SPEC §6–§7).

Each instance runs its own local policy (any of the policy core's) on its own KV pool; a global
placement (serving.placement, the same objects the gateway uses) picks an instance for each arrival.
Events are arrivals, step ends on any instance, and the placement heartbeat (Aladdin Alg. 2's
re-balancing). Deterministic: ties are broken by instance index and the placements' own seeds.

Several gateways: each arrival goes to a random replica (as kube-proxy's default mode picks a Service
endpoint), and each replica keeps its own view,
as deployed replicas do: the jobs it placed itself, tracked exactly, plus what it last read from the
engines' metrics about the rest (their count and KV in use; not their predictions) every
``refresh_s``. Between reads a replica does not see the others' new requests, which is what sharing
instances costs.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.perf.latency import LatencyModel
from serving.perf.slo import SLO
from serving.placement import Instance, Job, LengthHistory, Limits, make_placement, rebalance
from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy
from serving.policy.request import Prediction
from serving.sim.engine import SimulationError, repredict_hook, summarize_instances
from serving.sim.instance import SimInstance, new_request
from serving.sim.metrics import RequestRecord, RunMetrics


@dataclass(frozen=True)
class ClusterConfig:
    instances: int
    placement: str = "jsq"
    local_policy: str = "vllm"
    gateways: int = 1
    refresh_s: float = 1.0         # how often a gateway reads the engines' metrics (several gateways only)
    rebalance_s: float = 0.5       # Alg. 2 heartbeat, for placements that re-balance
    seed: int = 0

    def __post_init__(self) -> None:
        if self.instances < 1 or self.gateways < 1:
            raise ValueError("a cluster needs at least one instance and one gateway")
        if self.refresh_s <= 0 or self.rebalance_s <= 0:
            raise ValueError("refresh_s and rebalance_s must be positive")


def instance_limits(config: PolicyConfig, kv_blocks: int, latency: LatencyModel, slo: SLO) -> Limits:
    """Aladdin's per-instance limits from a simulation setup: its KV pool, step model and per-token SLOs."""
    return Limits(kv_tokens=kv_blocks * config.block_size, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                  chunk_tokens=config.max_num_batched_tokens, latency=latency, ttft_s=slo.ttft_s, atgt_s=slo.tpot_s)


class _Gateway:
    """One gateway replica: its placement object and its view of every instance."""

    def __init__(self, cc: ClusterConfig, limits: Limits, index: int) -> None:
        self.placement = make_placement(cc.placement, limits, seed=cc.seed * 1000 + index, replica=(index, cc.gateways))
        self.views = [Instance(f"instance-{i}") for i in range(cc.instances)]
        self.synthetic = 0  # jobs standing for other gateways' load, from the last metrics read

    def refresh(self, truth: Sequence[dict[int, Job]], owner: dict[int, int], me: int, history: LengthHistory, now: float) -> None:
        """Replace the stand-ins for other gateways' jobs with what the engines report now.

        An engine's metrics give its running and waiting counts and its KV in use, not predictions: each
        stand-in holds an equal share of that KV and is planned at the mean finished length; running ones
        count as decoding (a first token), waiting ones as prefill still to do, as the gateway does.
        """
        mean = history.mean_beyond(0) or 256.0
        for i, view in enumerate(self.views):
            for rid in [r for r in view.jobs if r < 0]:
                view.remove(rid)
            others = [j for j in truth[i].values() if owner[j.rid] != me]
            if not others:
                continue
            ctx = sum(j.context for j in others) / len(others)
            for j in others:
                self.synthetic += 1
                view.add(Job(-self.synthetic, max(1, round(ctx)), mean, started=True,
                             first_token_at=now if j.first_token_at is not None else None))


def simulate_cluster(requests: Sequence, predictions: Sequence[Prediction], cc: ClusterConfig, config: PolicyConfig,
                     kv_blocks: int, latency: LatencyModel, slo: SLO,
                     repredict: Callable[[object, int, Prediction], float] | None = None,
                     check: bool = False, max_steps: int = 50_000_000) -> RunMetrics:
    """Run ``requests`` through ``cc.instances`` instances placed by ``cc.placement``; metrics over the whole fleet."""
    by_rid = {r.rid: r for r in requests}
    preds = {r.rid: p for r, p in zip(requests, predictions)}
    truth_len = {r.rid: r.output_tokens for r in requests}
    records: dict[int, RequestRecord] = {}
    hook = repredict_hook(repredict, by_rid, preds)
    fleet = [SimInstance(f"instance-{i}", make_policy(cc.local_policy, config, kv_blocks, hook), latency, truth_len, records, check)
             for i in range(cc.instances)]
    limits = instance_limits(config, kv_blocks, latency, slo)
    gws = [_Gateway(cc, limits, g) for g in range(cc.gateways)]
    shared = cc.gateways > 1
    truth_jobs: list[dict[int, Job]] = [{} for _ in fleet]  # every job on each instance, whoever placed it
    where: dict[int, int] = {}
    owner: dict[int, int] = {}
    jobs: dict[int, Job] = {}
    history = LengthHistory()
    moves = 0
    order = sorted(requests, key=lambda r: (r.arrival, r.rid))
    rebalancing = any(g.placement.rebalances for g in gws)
    next_beat = cc.rebalance_s if rebalancing else math.inf
    next_refresh = cc.refresh_s if shared else math.inf
    # the event loop touches only the instances an event concerns (a fleet-wide scan per event made 48-instance runs
    # O(N^2)): ``ends`` holds one (busy_until, index) per running step; ``dirty`` the instances whose queues changed
    ends: list[tuple[float, int]] = []
    dirty: set[int] = set()
    dealer = random.Random(cc.seed)  # the load balancer in front of the gateways: a random replica per request
    now = 0.0
    nxt = 0
    t_wall = time.perf_counter()
    while True:
        t_end = ends[0][0] if ends else math.inf
        t_arr = order[nxt].arrival if nxt < len(order) else math.inf
        busy = nxt < len(order) or bool(ends) or any(inst.has_work for inst in fleet)  # a running step is work
        t_beat = min(next_beat, next_refresh) if busy else math.inf
        t = min(t_end, t_arr, t_beat)
        if t == math.inf:
            break
        now = max(now, t)
        ended = []
        while ends and ends[0][0] <= now:
            ended.append(heapq.heappop(ends)[1])
        for i in sorted(ended):  # step ends first, as the single-instance loop does; ties in instance order
            inst = fleet[i]
            res = inst.end()
            for rid in res.emitted:
                j = jobs[rid]
                j.generated += 1
                if j.first_token_at is None:
                    j.first_token_at = res.now
                if j.generated >= j.pred_len and (j.repredicted is None or j.generated >= j.repredicted):
                    j.repredicted = history.repredict(j.pred_len, j.generated)
            for rid in res.finished:
                history.add(truth_len[rid])
                gws[owner[rid]].views[i].finish(rid)
                truth_jobs[i].pop(rid, None)
            dirty.add(i)
            if inst.steps >= max_steps * len(fleet):
                raise SimulationError(f"step cap reached at t={now:.1f}s")
        while nxt < len(order) and order[nxt].arrival <= now:
            tr = order[nxt]
            nxt += 1
            g = dealer.randrange(cc.gateways) if shared else 0
            pred = preds[tr.rid]
            job = Job(tr.rid, tr.prompt_tokens, max(1.0, pred.length), arrival=tr.arrival)
            i = gws[g].placement.choose(gws[g].views, job, now)
            assert i is not None  # simulated instances are always healthy
            gws[g].views[i].add(job)
            truth_jobs[i][tr.rid] = job
            jobs[tr.rid], where[tr.rid], owner[tr.rid] = job, i, g
            records[tr.rid] = RequestRecord(tr.rid, tr.arrival, tr.prompt_tokens, tr.output_tokens, slo.jct_limit(tr.output_tokens))
            fleet[i].inbox.append(new_request(tr, pred, slo.jct_limit))
            dirty.add(i)
        if now >= next_refresh:
            for g, gw in enumerate(gws):
                gw.refresh(truth_jobs, owner, g, history, now)
            next_refresh = now + cc.refresh_s
        if now >= next_beat:
            for gw in gws:
                if gw.placement.rebalances:
                    for mv in rebalance(gw.views, limits, now):
                        moves += _move(fleet, mv.rid, mv.src, mv.dst, by_rid[mv.rid], preds[mv.rid], slo)
                        truth_jobs[mv.dst][mv.rid] = truth_jobs[mv.src].pop(mv.rid)
                        where[mv.rid] = mv.dst
                        dirty.update((mv.src, mv.dst))
            next_beat = now + cc.rebalance_s
        for i in sorted(dirty):  # a busy instance stays dirty until its step ends
            inst = fleet[i]
            if inst.idle:
                dirty.discard(i)
                if inst.has_work and inst.start(now):
                    heapq.heappush(ends, (inst.busy_until, i))
                    for rid in inst.plan.tokens:
                        jobs[rid].started = True
        if t_end == math.inf and nxt >= len(order) and all(inst.idle for inst in fleet):
            stuck = [inst.name for inst in fleet if inst.has_work]
            if stuck:
                raise SimulationError(f"{', '.join(stuck)} scheduled nothing with work left and no arrivals pending")
    m = summarize_instances(f"{cc.placement}/{cc.local_policy}", fleet, records, slo, config, kv_blocks, now,
                            time.perf_counter() - t_wall)
    stats: Counter[str] = Counter()
    for gw in gws:
        stats.update(gw.placement.stats)
    placed = Counter(where.values())
    m.extra.update({"instances": cc.instances, "gateways": cc.gateways, "placement": cc.placement, "local_policy": cc.local_policy,
                    "instances_used": len(placed), "per_instance_requests": [placed.get(i, 0) for i in range(len(fleet))],
                    "per_instance_busy": [inst.busy_s / max(now, 1e-9) for inst in fleet], "moves": moves,
                    "placement_stats": dict(stats)})
    return m


def _move(fleet: list[SimInstance], rid: int, src: int, dst: int, tr, pred: Prediction, slo: SLO) -> int:
    """Take a not-yet-started request off ``src`` (its inbox or its policy's queue) and queue it on ``dst``."""
    inst = fleet[src]
    for k, req in enumerate(inst.inbox):
        if req.rid == rid:
            fleet[dst].inbox.append(inst.inbox.pop(k))
            return 1
    req = inst.policy.requests.get(rid)
    if req is None or req.first_scheduled is not None:
        raise SimulationError(f"re-balancing moved request {rid}, which had already started on {inst.name}")
    inst.policy.abort(rid, req.arrival)
    fleet[dst].inbox.append(new_request(tr, pred, slo.jct_limit))
    return 1
