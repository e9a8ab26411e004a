"""The Ray Serve router decides as the placement core does, and falls back to power-of-two choice, counted, without stats.

Three levels: :class:`StatsPlacement` (plain data, hypothesis over replica states) against the core's policies fed the
same state; :class:`LengthwiseRequestRouter` itself over Ray's in-memory replica stand-ins (``FakeRunningReplica``);
and a real local Ray Serve application of two cheap replicas that report fixed routing stats, where the requests go
where the core says.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.placement import PlacementConfig
from serving.placement import Instance, Job, Limits, make_placement
from serving.ray.routing import JobRow, ReplicaStats, RouteHint, StatsPlacement, instance_of, job_key

POLICIES = ["round-robin", "jsq", "least-kv", "p2c", "aladdin", "lengthwise-pack", "lengthwise"]

rows = st.builds(JobRow, rid=st.text("abcdef0123456789", min_size=4, max_size=8), prompt_len=st.integers(1, 3000),
                 pred_len=st.integers(1, 2000).map(float), generated=st.integers(0, 2500), first_token=st.booleans())
replica = st.tuples(st.sampled_from([4096, 16384, 262144]), st.sampled_from([8, 64, 256]), st.lists(rows, max_size=8))


def _expected(policy: str, states: list, hint: RouteHint, now: float, seed: int) -> int | None:
    """The core's own answer for the same state, built here from the raw rows (not through the module under test)."""
    limits = Limits(kv_tokens=min(kv for kv, _, _ in states), block_size=16, max_num_seqs=min(m for _, m, _ in states))
    views = []
    for i, (kv, _, jobs) in enumerate(states):
        inst = Instance(f"r{i}", kv_tokens=kv)
        for r in jobs:
            key = job_key(r.rid)
            inst.jobs.setdefault(key, Job(key, r.prompt_len, r.pred_len, arrival=now - 1, generated=r.generated, started=True,
                                          first_token_at=now - 1 if r.first_token else None))
        views.append(inst)
    return make_placement(policy, limits, seed).choose(views, Job(job_key(hint.rid), hint.prompt_len, hint.pred_len), now)


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(policy=st.sampled_from(POLICIES), states=st.lists(replica, min_size=1, max_size=4), prompt=st.integers(1, 4000),
       pred=st.integers(1, 2000), seed=st.integers(0, 5))
def test_choice_is_the_placement_cores(policy, states, prompt, pred, seed):
    now = 1_000_000.0
    stats = [ReplicaStats(now - 1, kv, 16, m, 2048, tuple(jobs)).as_dict() for kv, m, jobs in states]
    hint = RouteHint("lw-new", prompt, float(pred))
    sp = StatsPlacement(PlacementConfig(name=policy, seed=seed))
    got = sp.decide([(f"r{i}", s) for i, s in enumerate(stats)], hint, {}, now)
    assert got.reason is None
    assert got.index == _expected(policy, states, hint, now, seed)


@pytest.mark.unit
def test_views_carry_the_reported_jobs_and_the_routers_own():
    stats = ReplicaStats(10.0, 8192, jobs=(JobRow("a", 100, 50, 10, True), JobRow("b", 30, 20, 0, False)))
    back = ReplicaStats.parse(stats.as_dict())
    assert back == stats and stats.as_dict()["kv_used_tokens"] == 110
    mine = Job(job_key("c"), 40, 8)
    dup = Job(job_key("a"), 1, 1)  # already reported: the report's row wins
    inst = instance_of("x", back, [mine, dup])
    assert set(inst.jobs) == {job_key("a"), job_key("b"), job_key("c")}
    assert inst.jobs[job_key("a")].generated == 10 and inst.jobs[job_key("a")].first_token_at == 10.0
    assert inst.jobs[job_key("b")].first_token_at is None and inst.kv_tokens == 8192


@pytest.mark.unit
def test_own_jobs_change_the_decision():
    """Two idle replicas; the router already sent three requests to r0 that r0 has not reported yet: JSQ picks r1."""
    now = 100.0
    idle = ReplicaStats(now, 8192).as_dict()
    sp = StatsPlacement(PlacementConfig(name="jsq"))
    own = {"r0": [Job(job_key(f"o{i}"), 10, 10) for i in range(3)]}
    assert sp.decide([("r0", idle), ("r1", idle)], RouteHint("n", 10, 10), own, now).index == 1


@pytest.mark.unit
@pytest.mark.parametrize(("stats", "hint", "reason"), [
    ([{"at": 99.0, "kv_tokens": 8192}, {"at": 99.0, "kv_tokens": 8192}], None, "no_hint"),
    ([{"at": 99.0, "kv_tokens": 8192}, {}], RouteHint("x", 1, 1), "no_report"),
    ([{"at": 99.0, "kv_tokens": 8192}, {"at": "soon"}], RouteHint("x", 1, 1), "no_report"),
    ([{"at": 99.0, "kv_tokens": 8192}, {"at": 80.0, "kv_tokens": 8192}], RouteHint("x", 1, 1), "stale"),
    ([{"at": 99.0}, {"at": 99.0, "kv_tokens": 0}], RouteHint("x", 1, 1), "no_capacity"),
])
def test_missing_or_stale_stats_fall_back_counted(stats, hint, reason):
    sp = StatsPlacement(PlacementConfig(name="lengthwise", stale_after_s=6.0))
    for _ in range(2):
        got = sp.decide([(f"r{i}", s) for i, s in enumerate(stats)], hint, {}, 100.0)
        assert got.index is None and got.reason == reason
    assert sp.stats()["fallbacks"] == {reason: 2}


@pytest.mark.unit
@pytest.mark.parametrize("raw", [None, {}, {"rid": "a"}, {"rid": "a", "prompt_len": "x", "pred_len": 3},
                                 {"rid": "a", "prompt_len": 3, "pred_len": 0}, {"rid": "a", "prompt_len": 3, "pred_len": "nan"}])
def test_malformed_hints_are_no_hints(raw):
    assert RouteHint.parse(raw) is None


# --- the router itself, over Ray's in-memory replica stand-ins ------------------------------------------------------------


def _router(placement: str, replicas: dict[str, dict], **kwargs):
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID
    from ray.serve._private.test_utils import FakeRunningReplica

    from serving.ray.router import LengthwiseRequestRouter

    class Reporting(FakeRunningReplica):
        def __init__(self, name: str, stats: dict):
            super().__init__(name)
            self.stats = stats

        @property
        def routing_stats(self) -> dict:
            return self.stats

    router = LengthwiseRequestRouter(deployment_id=DeploymentID(name="engine"), handle_source=DeploymentHandleSource.UNKNOWN)
    # stats stay fresh however loaded the machine: building the first router imports Ray's metrics, seconds under load,
    # and staleness itself is tested on StatsPlacement above
    router.initialize_state(placement=placement, stale_after_s=300.0, **kwargs)
    fakes = [Reporting(n, s) for n, s in replicas.items()]
    router.update_replicas(fakes)
    return router, fakes


def _pending(route: dict | None, rid: str = "req-1"):
    from ray.serve._private.common import RequestMetadata
    from ray.serve.request_router import PendingRequest

    return PendingRequest(args=[], kwargs={"route": route} if route else {}, metadata=RequestMetadata(rid, rid),
                          future=asyncio.get_running_loop().create_future())


@pytest.mark.unit
def test_router_ranks_the_cores_choice_first_and_forgets_completed_requests():
    async def main():
        now = time.time()
        busy = ReplicaStats(now, 8192, jobs=tuple(JobRow(f"j{i}", 100, 100, 5, True) for i in range(4))).as_dict()
        idle = ReplicaStats(now, 8192).as_dict()
        router, (_, b) = _router("jsq", {"a": busy, "b": idle})
        ranks = await router.choose_replicas(router._replicas_list, _pending({"rid": "x", "prompt_len": 10, "pred_len": 10}))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [["b"], ["a"]]
        assert router.fallbacks == {} and len(router._sent) == 1
        assert router.timing()["decisions"] == 1 and router.timing()["choose_s"] > 0
        router.on_request_completed(b.replica_id, "req-1")
        assert router._sent == {}

    asyncio.run(main())


@pytest.mark.unit
def test_router_without_stats_is_power_of_two_and_counts_it():
    async def main():
        router, _ = _router("lengthwise", {"a": {}, "b": {}, "c": {}})
        for i in range(5):
            ranks = await router.choose_replicas(router._replicas_list,
                                                 _pending({"rid": f"x{i}", "prompt_len": 10, "pred_len": 10}, f"q{i}"))
            assert len(ranks) == 1 and len(ranks[0]) == 2  # two random candidates: Ray's procedure
        ranks = await router.choose_replicas(router._replicas_list, _pending(None, "q-none"))
        assert len(ranks[0]) == 2
        assert router.fallbacks == {"no_report": 5, "no_hint": 1} and router._sent == {}
        from serving.ray.timing import router_timings

        mine = router_timings()["LengthwiseRequestRouter"]  # this process's routers: this one and the test above's
        assert mine["decisions"] >= 6 and mine["fallbacks"]["no_report"] >= 5

    asyncio.run(main())


def _graded(now: float) -> dict[str, dict]:
    """Three replicas holding 0, 2 and 4 running jobs."""
    return {n: ReplicaStats(now, 8192, jobs=tuple(JobRow(f"{n}{i}", 100, 100, 5, True) for i in range(k))).as_dict()
            for n, k in (("c", 4), ("a", 0), ("b", 2))}


@pytest.mark.unit
@pytest.mark.parametrize("ingresses", [1, 2])
def test_one_ingress_takes_the_least_loaded_several_pick_among_the_two_least_loaded(ingresses):
    """A lone router sees every request it sends, so the least loaded is right; routers of several ingress replicas
    see each other's only at the next stats, and all sending to the same least-loaded replica in between is herding."""
    async def main():
        chosen = []
        for i in range(40):
            router, _ = _router("lengthwise", _graded(time.time()), ingresses=ingresses, seed=i)
            ranks = await router.choose_replicas(router._replicas_list,
                                                 _pending({"rid": f"x{i}", "prompt_len": 10, "pred_len": 10}, f"q{i}"))
            chosen.append(ranks[0][0].replica_id.unique_id)
        return chosen

    chosen = asyncio.run(main())
    assert set(chosen) == ({"a"} if ingresses == 1 else {"a", "b"}), chosen


@pytest.mark.unit
def test_every_router_orders_the_replicas_alike():
    """Shares (lengthwise-pack) and tie-breaks need the same replica order in every ingress replica's router, whatever
    order Ray lists the candidates in."""
    async def main():
        picks = []
        for reverse in (False, True):
            router, fakes = _router("jsq", {n: ReplicaStats(time.time(), 8192).as_dict() for n in ("b", "c", "a")})
            order = fakes[::-1] if reverse else fakes
            ranks = await router.choose_replicas(order, _pending({"rid": "x", "prompt_len": 10, "pred_len": 10}))
            picks.append([[r.replica_id.unique_id for r in rank] for rank in ranks])
        return picks

    first, second = asyncio.run(main())
    assert first == second == [["a"], ["b", "c"]]


# --- a real local Ray Serve application: two cheap replicas reporting fixed routing stats -------------------------------

BUSY = [JobRow(f"busy-{i}", 200, 300.0, 20, True) for i in range(4)]  # what replica rank 0 reports; rank 1 reports none


class FixedLoad:
    """A replica that runs no engine: it answers its rank and reports fixed routing stats (rank 0 busy, rank 1 idle)."""

    def __init__(self) -> None:
        from ray import serve

        self.rank = serve.get_replica_context().rank.rank
        self.reports = 0

    def record_routing_stats(self) -> dict:
        self.reports += 1
        return ReplicaStats(time.time(), 8192, max_num_seqs=16, jobs=tuple(BUSY) if self.rank == 0 else ()).as_dict()

    def __call__(self, route: dict | None = None) -> int:
        return self.rank

    def reported(self) -> tuple[int, int]:
        return self.rank, self.reports


@pytest.fixture(scope="module")
def serve_cluster(tmp_path_factory):
    import os
    from pathlib import Path

    import ray
    from ray import serve

    root = Path(__file__).resolve().parents[1]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 0})
        yield serve
    finally:
        serve.shutdown()
        ray.shutdown()


def _app(serve, placement: str):
    from ray.serve.config import RequestRouterConfig

    from serving.ray.router import LengthwiseRequestRouter

    cfg = RequestRouterConfig(request_router_class=LengthwiseRequestRouter, request_routing_stats_period_s=0.2,
                              request_router_kwargs={"placement": placement, "stale_after_s": 5.0})
    dep = serve.deployment(FixedLoad, name=f"fixed-{placement}", num_replicas=2, ray_actor_options={"num_cpus": 0},
                           request_router_config=cfg)
    return serve.run(dep.bind(), name=placement, route_prefix=None)


def _decisions() -> int:
    from serving.ray.timing import router_timings

    return router_timings().get("LengthwiseRequestRouter", {}).get("decisions", 0)


def _core_choice(placement: str) -> int:
    """Rank of the replica the placement core picks for a new request over what the two replicas report."""
    views = [Instance("r0", kv_tokens=8192), Instance("r1", kv_tokens=8192)]
    for r in BUSY:
        views[0].add(Job(job_key(r.rid), r.prompt_len, r.pred_len, generated=r.generated, started=True, first_token_at=0.0))
    return make_placement(placement, Limits(kv_tokens=8192, max_num_seqs=16)).choose(views, Job(1, 50, 40.0))


@pytest.mark.parametrize("placement", ["jsq", "aladdin"])
def test_live_requests_go_where_the_core_says(serve_cluster, placement):
    handle = _app(serve_cluster, placement)
    deadline = time.time() + 60
    seen: dict[int, int] = {}
    while time.time() < deadline and (len(seen) < 2 or min(seen.values()) < 3):
        rank, n = handle.reported.remote().result(timeout_s=30)
        seen[rank] = n
        time.sleep(0.05)
    assert len(seen) == 2, f"both replicas report routing stats: {seen}"
    time.sleep(1.0)  # the controller pushes the latest stats to the handle's router
    want = _core_choice(placement)
    before = _decisions()
    got = [handle.remote(route=RouteHint(f"lw-{placement}-{i}", 50, 40.0).as_dict()).result(timeout_s=30) for i in range(20)]
    assert got == [want] * 20, f"{placement}: the core picks rank {want}; the router sent {got}"
    # the handle's router is Ray's copy of the class (its module pickled by value): its timing still reaches this process's
    # registry, where the ingress's /health reads it
    assert _decisions() - before >= 20
    serve_cluster.delete(placement)
