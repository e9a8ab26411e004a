"""What the Ray Serve router decides with: each engine replica's routing stats as placement :class:`Instance` views.

Why a module without Ray in it: the decision is the placement core's (:mod:`serving.placement`, the same policy objects
the gateway and the cluster simulator drive); this module only turns what replicas report into the core's views, so it
is tested, and reasoned about, as plain data.

**What a replica reports** (:class:`ReplicaStats`, the dict its ``record_routing_stats`` returns, collected by Ray
Serve's controller every ``request_routing_stats_period_s`` and pushed to every handle): the time it was taken, its KV
capacity in tokens and block size, its batch limits, and one row per request it holds (:class:`JobRow`: the request id,
prompt tokens, predicted output tokens, tokens generated so far, whether its first token came). Unlike the HTTP
gateway, which infers other senders' requests from vLLM's ``/metrics``, a replica knows each of its requests, so the
view has no synthetic jobs.

**What the router adds**: the requests it sent itself since (``own``), each until Ray says it completed, and not
already in the report; between two reports those are the only news.

**Fallback.** A decision needs a report younger than ``stale_after_s`` from every candidate and at least one KV
capacity; otherwise :meth:`StatsPlacement.decide` returns no index and a reason (``no_hint``: the request carries no
predicted length; ``no_report``, ``stale``, ``no_capacity``), and the router uses Ray's power-of-two choice instead,
counting the reason. Report times are the replicas' wall clocks: hosts must keep their clocks in sync (NTP) within a
small part of ``stale_after_s``.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from serving.gateway.placement import PlacementConfig, canonical_placement
from serving.placement import Instance, Job, Limits, Placement, make_placement

FALLBACK_REASONS = ("no_hint", "no_report", "stale", "no_capacity")
ROUTE_KWARG = "route"  # the handle call's keyword argument that carries a :class:`RouteHint`


def job_key(rid: str) -> int:
    """A request id as the placement core's integer job id: stable across processes (not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the ingress tells the router about one request: its id, prompt tokens and predicted output tokens."""

    rid: str
    prompt_len: int
    pred_len: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, raw: Any) -> RouteHint | None:
        """The hint in a handle call's ``route`` argument; None when absent or malformed (the router then falls back)."""
        if isinstance(raw, RouteHint):
            return raw
        if not isinstance(raw, Mapping):
            return None
        try:
            hint = cls(str(raw["rid"]), int(raw["prompt_len"]), float(raw["pred_len"]))
        except (KeyError, TypeError, ValueError):
            return None
        return hint if hint.prompt_len >= 0 and math.isfinite(hint.pred_len) and hint.pred_len >= 1 else None

    def job(self) -> Job:
        return Job(job_key(self.rid), self.prompt_len, self.pred_len)


@dataclass(frozen=True, slots=True)
class JobRow:
    """One request a replica holds, as it reports it."""

    rid: str
    prompt_len: int
    pred_len: float
    generated: int
    first_token: bool


@dataclass(frozen=True)
class ReplicaStats:
    """One replica's routing stats (``record_routing_stats``); ``at`` is its ``time.time()`` when taken."""

    at: float
    kv_tokens: int | None
    block_size: int = 16
    max_num_seqs: int = 256
    chunk_tokens: int = 2048
    jobs: tuple[JobRow, ...] = ()

    @property
    def kv_used_tokens(self) -> int:
        """KV tokens its requests hold now (prompt plus generated of those that started)."""
        return sum(j.prompt_len + j.generated for j in self.jobs if j.first_token)

    def as_dict(self) -> dict[str, Any]:
        """The dict Ray Serve carries (plain JSON types: Ray hashes its ``str`` to notice a change)."""
        return {"at": self.at, "kv_tokens": self.kv_tokens, "kv_used_tokens": self.kv_used_tokens,
                "block_size": self.block_size, "max_num_seqs": self.max_num_seqs, "chunk_tokens": self.chunk_tokens,
                "jobs": [[j.rid, j.prompt_len, j.pred_len, j.generated, j.first_token] for j in self.jobs]}

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> ReplicaStats | None:
        """The stats in a replica's routing-stats dict; None when it has none (not reported yet) or they are malformed."""
        if not raw or "at" not in raw:
            return None
        try:
            kv = raw.get("kv_tokens")
            return cls(float(raw["at"]), int(kv) if kv else None, int(raw.get("block_size") or 16),
                       int(raw.get("max_num_seqs") or 256), int(raw.get("chunk_tokens") or 2048),
                       tuple(JobRow(str(r), int(p), float(q), int(g), bool(f)) for r, p, q, g, f in raw.get("jobs") or ()))
        except (TypeError, ValueError):
            return None


def instance_of(name: str, stats: ReplicaStats, own: Sequence[Job] = ()) -> Instance:
    """The placement view of one replica: the jobs it reported plus ``own`` jobs (sent by this router) it did not report.

    A reported job has started (it is on the engine: it cannot move); it is prefilling until its first token.
    """
    inst = Instance(name, kv_tokens=stats.kv_tokens)
    for r in stats.jobs:
        key = job_key(r.rid)
        if key not in inst.jobs:
            inst.jobs[key] = Job(key, r.prompt_len, max(1.0, r.pred_len), arrival=stats.at, generated=r.generated, started=True,
                                 first_token_at=stats.at if r.first_token else None)
    for j in own:
        inst.jobs.setdefault(j.rid, j)
    return inst


@dataclass(frozen=True, slots=True)
class Decision:
    """The index of the chosen replica, or None with the reason the router must fall back."""

    index: int | None
    reason: str | None = None


class StatsPlacement:
    """The configured core placement over the replicas' reported views (one per router: it keeps the policy's state)."""

    def __init__(self, cfg: PlacementConfig) -> None:
        self.cfg = cfg
        self.name = canonical_placement(cfg.name)
        self.policy: Placement | None = None
        self.limits: Limits | None = None
        self.fallbacks: Counter[str] = Counter()

    def _limits(self, reports: Sequence[ReplicaStats]) -> Limits | None:
        """The fleet's limits: the smallest KV capacity and batch limits reported (an instance's own KV is on its view)."""
        known = [s for s in reports if s.kv_tokens]
        if not known:
            return None
        c = self.cfg
        lim = Limits(kv_tokens=min(s.kv_tokens for s in known if s.kv_tokens), block_size=known[0].block_size,
                     max_num_seqs=min(s.max_num_seqs for s in known), chunk_tokens=min(s.chunk_tokens for s in known),
                     latency=c.latency, ttft_s=c.ttft_s, atgt_s=c.atgt_s)
        old = self.limits
        if old is None or (old.kv_tokens, old.block_size, old.max_num_seqs, old.chunk_tokens) != (
                lim.kv_tokens, lim.block_size, lim.max_num_seqs, lim.chunk_tokens):
            self.limits = lim
            if self.policy is None:
                self.policy = make_placement(self.name, lim, c.seed, replica=c.replica)
            else:
                self.policy.limits = lim
        return self.limits

    def decide(self, replicas: Sequence[tuple[str, Mapping[str, Any] | None]], hint: RouteHint | None,
               own: Mapping[str, Sequence[Job]], now: float) -> Decision:
        """Which of ``replicas`` (name, routing stats) gets the request ``hint`` describes, at wall-clock ``now``.

        ``own`` maps a replica name to the jobs this router sent there that have not completed. A fallback's reason is
        counted in :attr:`fallbacks`.
        """
        reason = self._reason(replicas, hint, now)
        if reason is not None:
            self.fallbacks[reason] += 1
            return Decision(None, reason)
        assert hint is not None and self.policy is not None
        views = [instance_of(name, ReplicaStats.parse(raw), own.get(name, ())) for name, raw in replicas]  # type: ignore[arg-type]
        return Decision(self.policy.choose(views, hint.job(), now))

    def _reason(self, replicas: Sequence[tuple[str, Mapping[str, Any] | None]], hint: RouteHint | None,
                now: float) -> str | None:
        if hint is None:
            return "no_hint"
        if not replicas:
            return "no_report"
        reports = []
        for _, raw in replicas:
            stats = ReplicaStats.parse(raw)
            if stats is None:
                return "no_report"
            if now - stats.at > self.cfg.stale_after_s:
                return "stale"
            reports.append(stats)
        return "no_capacity" if self._limits(reports) is None else None

    def stats(self) -> dict[str, dict[str, int]]:
        """The policy's counters (placed, would_open, rejected_*) and the fallbacks by reason."""
        return {"policy": dict(self.policy.stats) if self.policy else {}, "fallbacks": dict(self.fallbacks)}
