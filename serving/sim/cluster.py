"""Several engine instances behind one or more gateways: the simulator for placement.

Each instance runs its own local policy (any of the policy core's) on its own KV pool; a global
placement (serving.placement, the same objects the gateway uses) picks an instance for each arrival.
Events are arrivals, step ends on any instance, and the placement heartbeat (Aladdin Alg. 2's
re-balancing). Deterministic: ties are broken by instance index and the placements' own seeds. Each kind of
event has its own handler on the run's state (:class:`_ClusterRun`), as in Vidur's event classes, so the
loop itself only orders them.

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
    serves: tuple[frozenset[str], ...] | None = None  # each instance's services (a plan's); None: every one everywhere

    def __post_init__(self) -> None:
        if self.instances < 1 or self.gateways < 1:
            raise ValueError("a cluster needs at least one instance and one gateway")
        if self.serves is not None and len(self.serves) != self.instances:
            raise ValueError(f"serves names {len(self.serves)} instances' services, for {self.instances} instances")
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

    def refresh(self, truth: Sequence[dict[int, Job]], owner: dict[int, int], me: int, history: LengthHistory,
                now: float) -> None:
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
    return _ClusterRun(requests, predictions, cc, config, kv_blocks, latency, slo, repredict, check, max_steps).run()


class _ClusterRun:
    """One run of :func:`simulate_cluster`: its state, and one handler per kind of event.

    At each event time the handlers run in a fixed order, which is the simulator's tie-breaking: step ends
    (:meth:`on_step_end`, in instance order), then arrivals (:meth:`on_arrival`), the gateways' metrics read
    (:meth:`on_refresh`), the re-balancing heartbeat (:meth:`on_rebalance`), and last the instances whose queues
    changed start their next step (:meth:`start_steps`).
    """

    def __init__(self, requests: Sequence, predictions: Sequence[Prediction], cc: ClusterConfig, config: PolicyConfig,
                 kv_blocks: int, latency: LatencyModel, slo: SLO,
                 repredict: Callable[[object, int, Prediction], float] | None, check: bool, max_steps: int) -> None:
        self.cc, self.config, self.kv_blocks, self.slo, self.max_steps = cc, config, kv_blocks, slo, max_steps
        self.by_rid = {r.rid: r for r in requests}
        self.preds = {r.rid: p for r, p in zip(requests, predictions)}
        self.truth_len = {r.rid: r.output_tokens for r in requests}
        self.records: dict[int, RequestRecord] = {}
        hook = repredict_hook(repredict, self.by_rid, self.preds)
        self.fleet = [SimInstance(f"instance-{i}", make_policy(cc.local_policy, config, kv_blocks, hook), latency, self.truth_len,
                                  self.records, check)
                      for i in range(cc.instances)]
        self.limits = instance_limits(config, kv_blocks, latency, slo)
        self.gws = [_Gateway(cc, self.limits, g) for g in range(cc.gateways)]
        self.shared = cc.gateways > 1
        self.truth_jobs: list[dict[int, Job]] = [{} for _ in self.fleet]  # every job on each instance, whoever placed it
        self.where: dict[int, int] = {}
        self.owner: dict[int, int] = {}
        self.jobs: dict[int, Job] = {}
        self.history = LengthHistory()
        self.moves = 0
        self.order = sorted(requests, key=lambda r: (r.arrival, r.rid))
        rebalancing = any(g.placement.rebalances for g in self.gws)
        self.next_beat = cc.rebalance_s if rebalancing else math.inf
        self.next_refresh = cc.refresh_s if self.shared else math.inf
        # the event loop touches only the instances an event concerns (a fleet-wide scan per event made 48-instance runs
        # O(N^2)): ``ends`` holds one (busy_until, index) per running step; ``dirty`` the instances whose queues changed
        self.ends: list[tuple[float, int]] = []
        self.dirty: set[int] = set()
        self.dealer = random.Random(cc.seed)  # the load balancer in front of the gateways: a random replica per request
        self.now = 0.0
        self.nxt = 0

    def run(self) -> RunMetrics:
        """The event loop: advance to the next event time and run every handler due then, in order."""
        t_wall = time.perf_counter()
        while True:
            t_end = self.ends[0][0] if self.ends else math.inf
            t_arr = self.order[self.nxt].arrival if self.nxt < len(self.order) else math.inf
            # a running step is work
            busy = self.nxt < len(self.order) or bool(self.ends) or any(inst.has_work for inst in self.fleet)
            t_beat = min(self.next_beat, self.next_refresh) if busy else math.inf
            t = min(t_end, t_arr, t_beat)
            if t == math.inf:
                break
            self.now = max(self.now, t)
            ended = []
            while self.ends and self.ends[0][0] <= self.now:
                ended.append(heapq.heappop(self.ends)[1])
            for i in sorted(ended):  # step ends first, as the single-instance loop does; ties in instance order
                self.on_step_end(i)
            while self.nxt < len(self.order) and self.order[self.nxt].arrival <= self.now:
                tr = self.order[self.nxt]
                self.nxt += 1
                self.on_arrival(tr)
            if self.now >= self.next_refresh:
                self.on_refresh()
            if self.now >= self.next_beat:
                self.on_rebalance()
            self.start_steps()
            if t_end == math.inf:
                self.check_stuck()
        return self.metrics(time.perf_counter() - t_wall)

    def on_step_end(self, i: int) -> None:
        """Instance ``i``'s step ended: count the tokens it emitted, and forget the requests it finished."""
        inst = self.fleet[i]
        res = inst.end()
        for rid in res.emitted:
            j = self.jobs[rid]
            j.generated += 1
            if j.first_token_at is None:
                j.first_token_at = res.now
            if j.generated >= j.pred_len and (j.repredicted is None or j.generated >= j.repredicted):
                j.repredicted = self.history.repredict(j.pred_len, j.generated)
        for rid in res.finished:
            self.history.add(self.truth_len[rid])
            self.gws[self.owner[rid]].views[i].finish(rid)
            self.truth_jobs[i].pop(rid, None)
        self.dirty.add(i)
        if inst.steps >= self.max_steps * len(self.fleet):
            raise SimulationError(f"step cap reached at t={self.now:.1f}s")

    def on_arrival(self, tr) -> None:
        """A request arrives: the load balancer picks a gateway, whose placement picks an instance."""
        now, slo = self.now, self.slo
        g = self.dealer.randrange(self.cc.gateways) if self.shared else 0
        pred = self.preds[tr.rid]
        job = Job(tr.rid, tr.prompt_tokens, max(1.0, pred.length), arrival=tr.arrival)
        gw = self.gws[g]
        i = gw.placement.choose(gw.views, job, now, self.not_serving(tr.service))
        if i is None:
            raise SimulationError(f"no instance serves {tr.service!r}: the plan leaves it out")
        gw.views[i].add(job)
        self.truth_jobs[i][tr.rid] = job
        self.jobs[tr.rid], self.where[tr.rid], self.owner[tr.rid] = job, i, g
        self.records[tr.rid] = RequestRecord(tr.rid, tr.arrival, tr.prompt_tokens, tr.output_tokens,
                                             slo.jct_limit(tr.output_tokens), service=tr.service)
        self.fleet[i].inbox.append(new_request(tr, pred, slo.jct_limit))
        self.dirty.add(i)

    def not_serving(self, service: str | None) -> frozenset[str]:
        """The instances a request of ``service`` is never placed on (a plan's), as the gateway excludes the engines
        that do not serve a model."""
        if self.cc.serves is None:
            return frozenset()
        return frozenset(f"instance-{i}" for i, names in enumerate(self.cc.serves) if service not in names)

    def on_refresh(self) -> None:
        """Every gateway reads the engines' metrics (several gateways only)."""
        for g, gw in enumerate(self.gws):
            gw.refresh(self.truth_jobs, self.owner, g, self.history, self.now)
        self.next_refresh = self.now + self.cc.refresh_s

    def on_rebalance(self) -> None:
        """The heartbeat of Aladdin's Alg. 2: each re-balancing gateway moves not-yet-started requests."""
        for gw in self.gws:
            if gw.placement.rebalances:
                for mv in rebalance(gw.views, self.limits, self.now):
                    if f"instance-{mv.dst}" in self.not_serving(self.by_rid[mv.rid].service):
                        continue  # a plan's instance that does not serve it
                    self.moves += _move(self.fleet, mv.rid, mv.src, mv.dst, self.by_rid[mv.rid], self.preds[mv.rid], self.slo)
                    self.truth_jobs[mv.dst][mv.rid] = self.truth_jobs[mv.src].pop(mv.rid)
                    self.where[mv.rid] = mv.dst
                    self.dirty.update((mv.src, mv.dst))
        self.next_beat = self.now + self.cc.rebalance_s

    def start_steps(self) -> None:
        """Each idle instance whose queues changed starts its next step, if it schedules any."""
        for i in sorted(self.dirty):  # a busy instance stays dirty until its step ends
            inst = self.fleet[i]
            if inst.idle:
                self.dirty.discard(i)
                if inst.has_work and inst.start(self.now):
                    heapq.heappush(self.ends, (inst.busy_until, i))
                    for rid in inst.plan.tokens:
                        self.jobs[rid].started = True

    def check_stuck(self) -> None:
        """No step was running, no arrival is pending and every instance is idle: any work left is stuck."""
        if self.nxt >= len(self.order) and all(inst.idle for inst in self.fleet):
            stuck = [inst.name for inst in self.fleet if inst.has_work]
            if stuck:
                raise SimulationError(f"{', '.join(stuck)} scheduled nothing with work left and no arrivals pending")

    def metrics(self, wall_s: float) -> RunMetrics:
        """The fleet's metrics, with the placement's own numbers in ``extra``."""
        cc, fleet, now = self.cc, self.fleet, self.now
        m = summarize_instances(f"{cc.placement}/{cc.local_policy}", fleet, self.records, self.slo, self.config, self.kv_blocks,
                                now, wall_s)
        stats: Counter[str] = Counter()
        for gw in self.gws:
            stats.update(gw.placement.stats)
        placed = Counter(self.where.values())
        m.extra.update({"instances": cc.instances, "gateways": cc.gateways, "placement": cc.placement,
                        "local_policy": cc.local_policy, "instances_used": len(placed),
                        "per_instance_requests": [placed.get(i, 0) for i in range(len(fleet))],
                        "per_instance_busy": [inst.busy_s / max(now, 1e-9) for inst in fleet], "moves": self.moves,
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
