"""The placement core under hostile predictions, in the cluster simulator (which drives the same placement objects as
the gateway).

Every placement the product offers, the prediction-free ``least-kv`` and ``round-robin`` included, places small tight
workloads (1-4 instances, KV pools a few requests fill, arrivals faster than service) whose predictions are wrong in
every way at once: 10x too low, 10x too high, zero, the largest length there is, 16x multiplicative noise, or all the
mass in one wrong bucket. Whatever the predictions:

* the run ends within a bounded number of events (no deadlock: the simulator raises when instances hold work and
  nothing can run; no livelock: the steps are capped, see :func:`step_budget`);
* every request is placed once, at its arrival event, sits on exactly one instance at any moment (re-balancing moves
  it, never copies it), and finishes exactly once, on one instance;
* no instance's KV ledger ever holds more blocks than its pool (and the ledger's own check passes after every step);
* no request waits unboundedly. Placement is final at arrival (the gateway sends each request to its engine at once),
  so no bound of the form "placed within N rounds once some instance is empty" holds: a request can wait behind its own
  instance's earlier work while another instance idles. What the code guarantees, and what is tested, is a bound on who
  may go ahead of a request: (1) re-balancing moves a request only before it starts and at most once per re-balancing
  round that follows a new overrun, so at most as often as requests overran; (2) on its instance, no request that joined
  after it is admitted before it under an FCFS local policy (``vllm``), and under the aged shortest-first ones (``sjf``,
  ``lengthwise``) only requests that arrived less than ``aging_s`` after it. Its wait is therefore bounded by the work
  of finitely many requests, whatever was predicted.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from serving.perf.latency import LinearLatency
from serving.perf.slo import SLO
from serving.placement import Instance, Job, LengthHistory, Limits, placement_names, rebalance
from serving.policy.config import PolicyConfig
from serving.policy.deadline import LateTier
from serving.policy.request import Prediction, Request
from serving.sim.cluster import ClusterConfig, _ClusterRun
from tests.hostile import MODES, TraceRequest, hostile_prediction

pytestmark = pytest.mark.unit

MAX_LEN = 512                   # max_model_len: the largest length there is
BLOCK = 16
EDGES = (32, 64, 128, 256)      # the bucket edges of the "wrong bucket" predictions
LOCALS = ("vllm", "sjf", "lengthwise")
FCFS = {"vllm"}
AGING_S = 0.5                   # short, so the aging window is a bound a few-second trace can break
SLO_ARGS = (2.0, 0.03, 0.015, 0.06, 0.03)   # scale, t_p, t_g, TTFT, ATGT targets (s)
REBALANCE_S, REFRESH_S = 0.05, 0.2          # Alg. 2's heartbeat; the gateways' metrics read (several gateways)
PLACEMENTS = placement_names()
HOSTILE = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow])


def hostile(mode: str, true_len: int, rng: random.Random) -> Prediction:
    """A prediction of ``true_len`` that is wrong the way ``mode`` says, on this module's lengths and buckets."""
    return hostile_prediction(mode, true_len, rng, MAX_LEN, EDGES)


def step_budget(trace: list[TraceRequest]) -> int:
    """The most steps a run may take: every step runs at least one token, so a run without preemption needs at most
    Σ (prompt + output) steps; four times that leaves room for recompute after preemptions and stops a livelock."""
    return 4 * sum(r.prompt_tokens + r.output_tokens for r in trace) + 16


class WatchedRun(_ClusterRun):
    """The cluster simulator's own event loop and handlers (so what is tested is what ``simulate_cluster`` runs), with
    this module's checks after every event."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events = 0
        self.finished_on: dict[int, list[int]] = defaultdict(list)
        self.joined: dict[int, tuple[int, int]] = {}   # rid -> (instance, order of joining it), the latest join
        self.admitted: dict[int, int] = {}             # rid -> order of its first scheduling, fleet-wide
        self.moved: Counter[int] = Counter()
        self.overtaken = False                         # some request was admitted before one that joined its instance first
        self._joins = 0

    def _join(self, rid: int) -> None:
        self._joins += 1
        self.joined[rid] = (self.where[rid], self._joins)

    def on_arrival(self, tr) -> None:
        super().on_arrival(tr)
        i = self.where[tr.rid]  # placed at its arrival event, on an instance that holds it
        assert any(r.rid == tr.rid for r in self.fleet[i].inbox)
        self._join(tr.rid)

    def on_rebalance(self) -> None:
        before = dict(self.where)
        super().on_rebalance()
        for rid, i in self.where.items():
            if before.get(rid) != i:
                assert rid not in self.admitted, f"request {rid} moved after it started"
                self.moved[rid] += 1
                self._join(rid)

    def on_step_end(self, i: int) -> None:
        policy = self.fleet[i].policy
        before = set(policy.requests)
        super().on_step_end(i)  # with check=True the policy's own ledger check runs here
        for rid in before - set(policy.requests):
            self.finished_on[rid].append(i)
        assert 0 <= policy.kv.used <= policy.kv.total, (self.fleet[i].name, policy.kv.used, policy.kv.total)

    def start_steps(self) -> None:
        self.events += 1
        super().start_steps()
        for inst in self.fleet:
            if inst.plan is not None:
                for rid in inst.plan.tokens:
                    self.admitted.setdefault(rid, len(self.admitted))
        live = Counter(rid for inst in self.fleet for rid in (*inst.policy.requests, *(r.rid for r in inst.inbox)))
        assert all(c == 1 for c in live.values()), f"on two instances at once: {[r for r, c in live.items() if c > 1]}"


def run(placement: str, mode: str, trace: list[TraceRequest], instances: int, kv_blocks: int, local: str = "vllm",
        gateways: int = 1, seed: int = 0, preds: list[Prediction] | None = None) -> WatchedRun:
    """Simulate ``trace`` on the fleet with every check of this module (``preds``, else ``mode``'s); the finished run."""
    rng = random.Random(seed)
    if preds is None:
        preds = [hostile(mode, r.output_tokens, rng) for r in trace]
    cfg = PolicyConfig(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=256, tfs=256,
                       aging_s=AGING_S)
    slo = SLO(*SLO_ARGS)
    cc = ClusterConfig(instances, placement, local, gateways=gateways, refresh_s=REFRESH_S, rebalance_s=REBALANCE_S, seed=seed)
    w = WatchedRun(trace, preds, cc, cfg, kv_blocks, LinearLatency(2000, 20, 200), slo,
                   lambda tr, generated, pred: pred.remaining_after(generated), True, step_budget(trace))
    m = w.run()  # SimulationError on a deadlock (work left, nothing runs) or past the step budget

    n = len(trace)
    assert m.requests_completed == n
    assert sorted(w.finished_on) == sorted(r.rid for r in trace), "every request finishes"
    assert all(len(on) == 1 for on in w.finished_on.values()), "exactly once"
    assert all(w.finished_on[rid] == [w.where[rid]] for rid in w.finished_on), "on the instance it was last placed on"
    assert sum(m.extra["per_instance_requests"]) == n and m.extra["placement_stats"]["placed"] == n
    steps = sum(inst.steps for inst in w.fleet)
    assert steps <= step_budget(trace)
    assert w.events <= steps + n + w.now / REBALANCE_S + w.now / REFRESH_S + 4  # each event: a step end, arrival or beat
    assert all(not inst.has_work and inst.policy.kv.used == 0 for inst in w.fleet)

    # who may go ahead of a request: re-balancing moves it at most as often as requests overran ...
    overran = sum(j.generated > j.pred_len for j in w.jobs.values())
    assert all(k <= overran for k in w.moved.values()), (dict(w.moved), overran)
    # ... and on its instance only earlier joiners (FCFS), or requests that arrived within aging_s after it
    arrival = {r.rid: r.arrival for r in trace}
    for r in trace:
        for q in trace:
            (ir, jr), (iq, jq) = w.joined[r.rid], w.joined[q.rid]
            if ir == iq and jq > jr and w.admitted[q.rid] < w.admitted[r.rid]:
                w.overtaken = True
                assert local not in FCFS, f"{local}: request {q.rid} joined after {r.rid} and started before it"
                assert arrival[q.rid] < arrival[r.rid] + AGING_S, (
                    f"{local}: request {q.rid} (arrived {arrival[q.rid]:.3f} s) went ahead of {r.rid} (arrived "
                    f"{arrival[r.rid]:.3f} s) past the aging window of {AGING_S} s")
    return w


@st.composite
def workloads(draw, max_requests: int = 16) -> list[TraceRequest]:
    """Small tight traces: arrivals far faster than one instance serves, prompts and answers that fit one instance."""
    n = draw(st.integers(1, max_requests))
    t = 0.0
    out = []
    for rid in range(n):
        t += draw(st.floats(0.0, 0.05))
        prompt = draw(st.integers(1, 300))
        out.append(TraceRequest(rid, round(t, 4), prompt, draw(st.integers(1, MAX_LEN - prompt))))
    return out


fleets = st.tuples(st.integers(1, 4), st.integers(MAX_LEN // BLOCK, 2 * MAX_LEN // BLOCK))  # instances, KV blocks each


@pytest.mark.parametrize("placement", PLACEMENTS)
@HOSTILE
@given(mode=st.sampled_from(MODES), trace=workloads(), fleet=fleets, local=st.sampled_from(LOCALS),
       gateways=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_hostile_predictions_never_lose_duplicate_overfill_starve_or_livelock(placement, mode, trace, fleet, local, gateways,
                                                                            seed):
    w = run(placement, mode, trace, *fleet, local=local, gateways=gateways, seed=seed)
    # what the drawn examples exercised (pytest --hypothesis-show-statistics)
    event(f"re-balancing moved a request: {w.moves > 0}")
    event(f"a local policy preempted: {any(inst.policy.stats['preemptions'] for inst in w.fleet)}")
    event(f"no instance was feasible for some request: {w.gws[0].placement.stats['would_open'] > 0}")
    event(f"some request was admitted out of its joining order: {w.overtaken}")


def _tight_trace(n: int = 20, seed: int = 3) -> list[TraceRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for rid in range(n):
        t += rng.expovariate(60.0)
        prompt = rng.randint(8, 300)
        out.append(TraceRequest(rid, t, prompt, rng.randint(1, MAX_LEN - prompt)))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_under_every_mode_on_a_tight_fleet(placement, mode):
    """Each pair at least once, whatever hypothesis draws: 20 requests on two instances of one max-length context each."""
    w = run(placement, mode, _tight_trace(), instances=2, kv_blocks=MAX_LEN // BLOCK, local="lengthwise", seed=5)
    assert len(w.finished_on) == 20


@pytest.mark.parametrize("local", ["sjf", "lengthwise"])
def test_a_sixteenfold_over_prediction_is_overtaken_only_within_the_aging_window(local):
    """The aging bound holds for predictions past max_model_len too (noise16 reaches 16x the true length).

    Shortest-first ranks a waiting request by ``predicted length + alpha x arrival`` (alpha = max_model_len /
    aging_s), so a request waits for newer ones only while they arrived less than ``aging_s`` after it, provided its
    predicted length is at most max_model_len. Request 0 (a 400-token answer predicted 16x too long) arrives behind a
    backlog on one instance while short requests keep coming for 4 s: it may let through those of the next 0.5 s, not
    more."""
    trace = [TraceRequest(k + 1, 0.02 * k, 40, 40) for k in range(200)]
    trace.insert(5, TraceRequest(0, 0.085, 40, 400))
    preds = [Prediction(length=16.0 * r.output_tokens if r.rid == 0 else float(r.output_tokens)) for r in trace]
    w = run("jsq", "noise16", trace, instances=1, kv_blocks=MAX_LEN // BLOCK, local=local, preds=preds)
    assert w.admitted[0] < len(trace) - 1


def test_a_request_that_waited_aging_s_is_not_demoted_when_it_reaches_the_head_only_then():
    """The late tier (``lengthwise``) sends a hopeless request behind the on-time ones until it has waited aging_s;
    one that reaches the head of a long queue only after that has already waited it out and must not be demoted
    (it was, for a step, letting newer requests past the aging window: the fleet run above found it)."""
    tier = LateTier(aging_s=0.5)
    tier.tbt = 0.1  # a measured pace: 10 tokens take a second
    req = Request(7, arrival=1.0, prompt_len=40, pred=Prediction(length=10.0), deadline=1.2)
    assert tier.is_late(req, now=1.3, remaining=10, budget=256)       # waited 0.3 s: late, it may yield
    assert not tier.is_late(req, now=1.5, remaining=10, budget=256)   # waited aging_s: back for good


@st.composite
def fleet_views(draw) -> list[Instance]:
    """Placement views of 1-4 instances under one hostile mode: started jobs (some past their prediction, so
    re-predicted), jobs not started yet, and early finishes since the last round."""
    mode = draw(st.sampled_from(MODES))
    rng = random.Random(draw(st.integers(0, 2**16)))
    views, rid = [], 0
    for k in range(draw(st.integers(1, 4))):
        inst = Instance(f"i{k}")
        for _ in range(draw(st.integers(0, 6))):
            rid += 1
            prompt, true_len = draw(st.integers(1, 300)), draw(st.integers(1, 200))
            pred = max(1.0, hostile(mode, true_len, rng).length)
            if draw(st.booleans()):  # started: some tokens out, fewer than its true length
                gen = draw(st.integers(1, true_len))
                inst.add(Job(rid, prompt, pred, generated=gen, started=True, first_token_at=1.0 - 0.01 * gen,  # on pace
                             repredicted=LengthHistory().repredict(pred, gen) if gen >= pred else None))
            else:
                inst.add(Job(rid, prompt, pred))
        for _ in range(draw(st.integers(0, 2))):  # finished before its prediction since the last round
            rid += 1
            pred = max(1.0, hostile(mode, 200, rng).length)
            inst.add(Job(rid, draw(st.integers(1, 300)), pred, generated=draw(st.integers(0, 199)), started=True))
            inst.finish(rid)
        views.append(inst)
    return views


@settings(HOSTILE, max_examples=50)
@given(views=fleet_views(), kv_tokens=st.integers(MAX_LEN, 8 * MAX_LEN))
def test_rebalancing_moves_only_unstarted_jobs_once_and_only_after_new_errors(views, kv_tokens):
    """Why re-balancing cannot bounce a request forever: it moves a job only before it starts, at most once a round,
    and only on prediction errors it has not acted on yet (a round with no new overrun or early finish moves
    nothing), so a request moves at most as often as there were new errors; no job is lost or copied."""
    lim = Limits(kv_tokens=kv_tokens, block_size=BLOCK, max_num_seqs=16, chunk_tokens=256, latency=LinearLatency(2000, 20, 200),
                 ttft_s=1.0, atgt_s=0.05)
    before = {rid: (k, job) for k, inst in enumerate(views) for rid, job in inst.jobs.items()}
    moves = rebalance(views, lim, now=1.0)
    event(f"re-balancing moved a job: {bool(moves)}")
    after = {rid: (k, job) for k, inst in enumerate(views) for rid, job in inst.jobs.items()}
    assert after.keys() == before.keys() and sum(len(v.jobs) for v in views) == len(before), "no job lost or copied"
    assert len({m.rid for m in moves}) == len(moves), "each job moves at most once a round"
    for m in moves:
        job = before[m.rid][1]
        assert not job.started and before[m.rid][0] == m.src and after[m.rid] == (m.dst, job) and m.src != m.dst
    assert all(after[rid][0] == k for rid, (k, _) in before.items() if rid not in {m.rid for m in moves})
    assert rebalance(views, lim, now=1.5) == [], "no new errors: nothing moves"
