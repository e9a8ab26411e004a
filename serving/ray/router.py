"""``LengthwiseRequestRouter``: Ray Serve's request router for the engine replicas, deciding with the placement core.

Ray Serve runs one router per deployment handle, in the process that holds the handle (the ingress replicas). For each
request it calls :meth:`choose_replicas` with the request (``PendingRequest``: the handle call's ``args``/``kwargs``
and Ray's metadata) and the replicas, each with the routing stats its ``record_routing_stats`` last returned. The
ingress passes the request's predicted length as the call's ``route`` keyword (:class:`~serving.ray.routing.RouteHint`);
:class:`~serving.ray.routing.StatsPlacement` turns the stats into the core's views and asks the configured policy.

The answer is a ranking: the chosen replica first, then the others, so a chosen replica whose queue Ray finds full
(``max_ongoing_requests``) passes the request to the next rather than stalling it. Without a usable decision (no hint,
a replica without stats or with stale ones, no KV capacity known) the router is Ray's power-of-two choice, the class Ray
Serve uses by default (``PowerOfTwoChoicesRequestRouter.choose_replicas``, with its locality and multiplexing), and the
reason is counted (:attr:`LengthwiseRequestRouter.fallbacks`, and the Ray metric
``lengthwise_ray_router_fallbacks`` by reason).

Requests are matched to routing decisions by Ray's internal request id (the base router's out-of-order matching; the
power-of-two class's FIFO matching would hand one request's decision to another). The jobs this router sent and Ray has
not reported complete are added to each replica's view until the replica reports them itself.

Configuration (``request_router_kwargs``, JSON): ``placement`` (a placement name), ``stale_after_s``, ``seed``,
``others_pred_len``, ``ttft_s``, ``atgt_s``, ``ingresses``.

**Several ingress replicas.** Each ingress replica holds its own handle, so its own router, which sees the others'
requests only in the replicas' next stats: the placement is told it is one of ``ingresses`` senders (the gateway's
``--replicas``), so ``lengthwise`` picks at random among the two least loaded instead of all of them herding to the
least loaded, and ``lengthwise-pack`` fills its own share first. Its index is the ingress replica's rank in Ray Serve,
which also offsets the seed, so no two routers draw the same choices.

**Overhead.** Every router here times its ``choose_replicas`` (:class:`~serving.ray.timing.RouterTiming`: decisions and
seconds, kept per process and in the Ray metric ``lengthwise_ray_router_choose_seconds``), and so does
:class:`TimedPowerOfTwoRouter`, Ray's default router with only that timing added, the baseline ``lengthwise bench ray``
compares against. The ingress reports both on ``/health`` (``routers``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from serving.gateway.placement import PlacementConfig
from serving.placement import Job
from serving.ray.routing import ROUTE_KWARG, RouteHint, StatsPlacement
from serving.ray.timing import RouterTiming

log = logging.getLogger("serving.ray")


def ingress_rank() -> int:
    """The rank of the Serve replica this process runs (the ingress holding the handle), 0 outside a replica."""
    try:
        from ray import serve

        return int(serve.get_replica_context().rank.rank)
    except Exception:  # noqa: BLE001 - not in a Serve replica (a driver, a test): the only sender
        return 0


class TimedPowerOfTwoRouter(RouterTiming, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router (power-of-two choice), unchanged but for the timing of its decisions."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        try:
            return await super().choose_replicas(candidate_replicas, pending_request)
        finally:
            self._timed(time.perf_counter() - t0)


class LengthwiseRequestRouter(RouterTiming, LocalityMixin, MultiplexMixin, RequestRouter):
    """Ranks replicas with the configured placement policy over their routing stats; power-of-two choice without them."""

    def initialize_state(self, placement: str = "lengthwise", stale_after_s: float = 6.0, seed: int = 0,
                         others_pred_len: int = 256, ttft_s: float | None = None, atgt_s: float | None = None,
                         ingresses: int = 1, **_: Any) -> None:
        """Ray calls this with the deployment's ``request_router_kwargs``."""
        count = max(1, ingresses)
        index = ingress_rank() % count
        self.placement = StatsPlacement(PlacementConfig(name=placement, stale_after_s=stale_after_s, seed=seed + index,
                                                        others_pred_len=others_pred_len, ttft_s=ttft_s, atgt_s=atgt_s,
                                                        replica=(index, count)))
        self._sent: dict[str, tuple[str, Job]] = {}  # Ray's internal request id -> (replica, job) until completed
        self._metric = None
        try:
            from ray.util.metrics import Counter

            self._metric = Counter("lengthwise_ray_router_fallbacks", "routing decisions made by power-of-two choice "
                                   "instead of the placement policy, by reason", tag_keys=("reason",))
        except Exception:  # noqa: BLE001 - metrics are optional (no Ray metrics agent in this process)
            self._metric = None

    @property
    def fallbacks(self) -> dict[str, int]:
        return dict(self.placement.fallbacks)

    def _own(self) -> dict[str, list[Job]]:
        out: dict[str, list[Job]] = {}
        for name, job in self._sent.values():
            out.setdefault(name, []).append(job)
        return out

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        t0 = time.perf_counter()
        try:
            return await self._choose(candidate_replicas, pending_request)
        finally:
            self._timed(time.perf_counter() - t0)

    async def _choose(self, candidate_replicas: list[RunningReplica],
                      pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        if not hasattr(self, "placement"):  # Ray calls initialize_state only with kwargs; be usable without
            self.initialize_state()
        hint = RouteHint.parse(pending_request.kwargs.get(ROUTE_KWARG)) if pending_request is not None else None
        replicas = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)  # one order in every router (shares)
        decision = self.placement.decide([(r.replica_id.unique_id, r.routing_stats) for r in replicas], hint, self._own(),
                                         time.time())
        if decision.index is None:
            if decision.reason and self._metric is not None:
                self._metric.inc(tags={"reason": decision.reason})
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        chosen = replicas[decision.index]
        assert pending_request is not None and hint is not None
        pending_request.routing_context.should_backoff = True  # a full replica: back off before the next try
        job = hint.job()
        job.started = True
        self._sent[pending_request.metadata.internal_request_id] = (chosen.replica_id.unique_id, job)
        return [[chosen], [r for r in replicas if r is not chosen]]

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._sent.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        dead = replica_id.unique_id
        for key in [k for k, (name, _) in self._sent.items() if name == dead]:
            del self._sent[key]
