"""Which engine gets a request: the placement core (:mod:`serving.placement`) over one view per engine.

The gateway is the core's host (``serving/placement/state.py``): each engine has an :class:`Instance` whose
jobs are the requests the gateway sent there. A :class:`Job` is added when a request is placed (rid a
gateway counter, l_in the prompt tokens, l_pred the sidecar's prediction or the fallback length); it is
*started* when sent (non-streaming: the gateway sees nothing until the answer) or at its first streamed
token, ``generated`` counts the streamed tokens, and the job leaves with :meth:`Instance.finish` when the
answer is complete (its true length feeding Alg. 2's error and the re-prediction history) or with
:meth:`Instance.remove` when it failed or moved to another engine. Jobs are never moved after they were
sent (the gateway cannot take a request back from vLLM), so Aladdin's re-balancing (Alg. 2) is not run.

**Load the gateway did not send.** Every ``load_interval_s`` the pool reads each engine's vLLM metrics
(:mod:`serving.gateway.engine_load`). When the engine holds more requests (running + waiting) than the
gateway has jobs there, the excess (other gateway replicas, direct clients) enters the view as that many
*synthetic* jobs (negative rids), as the cluster simulator's gateways do (``serving/sim/cluster.py``):
started (not movable), each holding an equal share of the KV the engine reports in use beyond the
gateway's own started jobs, each planned to generate the mean finished length so far (the fallback
length before any finished). The part of the engine's waiting queue not taken by the gateway's own
queued requests is synthetic jobs without a first token (prefill the TTFT limit counts); the rest are
decoding. They are replaced at every report. So JSQ counts them as outstanding requests, and Aladdin's
batch, KV, context and TTFT limits see them.

A non-streamed request shows no first token, so each report also settles which of the gateway's own are
running: the engine's waiting queue is taken to hold the newest requests; older non-streamed ones get
``first_token_at`` = the report's time (decoding, no longer prefill to wait for).

**Limits.** The KV capacity comes from each engine's ``vllm:cache_config_info`` (num_gpu_blocks ×
block_size); with engines of different sizes the smallest is used for all (the core's :class:`Limits`
is one per fleet). ``max_num_seqs``, the chunk size, the latency model (a profile fitted to an engine)
and the TTFT/ATGT targets come from settings; without a latency model only the KV and batch limits
apply.

**Fallback to JSQ.** ``aladdin``, ``lengthwise``, ``lengthwise-pack``, ``least-kv`` and ``p2c`` decide on the engines'
reports. A decision whose candidate engines do not all have a report younger than ``stale_after_s`` (or before any engine
reported its KV capacity) is made by JSQ on the gateway's own jobs instead, counted by reason
(``no_capacity``, ``no_report``, ``stale``); a stale report's synthetic jobs are dropped at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from serving.gateway.engine_load import LoadReport
from serving.perf.latency import LatencyModel
from serving.placement import Instance, Job, LengthHistory, Limits, Placement, make_placement

# placements that decide on the engines' reports
LOAD_AWARE = frozenset({"least-kv", "p2c", "aladdin", "lengthwise-pack", "lengthwise"})
_PROBE = Limits(kv_tokens=1)


def canonical_placement(name: str) -> str:
    """The core's name for ``name`` (``least-outstanding`` → ``jsq``); PlacementError when unknown."""
    return make_placement(name, _PROBE).name


@dataclass(frozen=True)
class PlacementConfig:
    name: str = "jsq"
    max_num_seqs: int = 256
    chunk_tokens: int = 2048
    latency: LatencyModel | None = None
    ttft_s: float | None = None
    atgt_s: float | None = None
    others_pred_len: int = 256      # planned output of a request someone else sent
    stale_after_s: float = 6.0      # older reports make a load-aware decision fall back to JSQ
    seed: int = 0
    replica: tuple[int, int] = (0, 1)  # this gateway's (index, count) among replicas sharing the engines


@dataclass(eq=False)
class EngineView:
    """One engine as placement sees it: the core's Instance plus the engine's latest load report."""

    inst: Instance
    report: LoadReport | None = None
    others: int = 0  # synthetic jobs in inst.jobs, standing for requests the gateway did not send
    capacity: int | None = None  # KV tokens, from the engine's cache_config_info

    @property
    def own(self) -> int:
        return len(self.inst.jobs) - self.others

    def drop_others(self) -> None:
        for k in range(1, self.others + 1):
            self.inst.jobs.pop(-k, None)
        self.others = 0


class GatewayPlacement:
    """The configured core placement over the engines' views, with JSQ as the fallback when reports are missing."""

    def __init__(self, names: Sequence[str], cfg: PlacementConfig, on_fallback: Callable[[str], None] = lambda reason: None):
        self.cfg = cfg
        self.name = canonical_placement(cfg.name)
        self.views = [EngineView(Instance(n, healthy=False)) for n in names]
        self.load_aware = self.name in LOAD_AWARE
        self.jsq = make_placement("jsq", seed=cfg.seed)
        self.policy: Placement | None = None if self.load_aware else (
            self.jsq if self.name == "jsq" else make_placement(self.name, seed=cfg.seed))
        self.limits: Limits | None = None
        self.history = LengthHistory()
        self.on_fallback = on_fallback
        self._unary: set[int] = set()  # rids of placed non-streamed requests (no first token to see)

    # --- engine state ----------------------------------------------------------------------------
    def report(self, v: EngineView, report: LoadReport) -> None:
        """A fresh load report of ``v``: replace its synthetic jobs, and learn its KV capacity."""
        v.report = report
        if report.kv_tokens:
            v.capacity = v.inst.kv_tokens = report.kv_tokens  # each engine's own: a fleet may mix GPU sizes
            self._update_limits(report.block_size or 16)
        self._apply_others(v)

    def _apply_others(self, v: EngineView) -> None:
        v.drop_others()
        r = v.report
        if r is None:
            return
        own = list(v.inst.jobs.values())
        # The TTFT limit counts a job without a first token as prefill still to do. A stream shows its first token; a
        # non-streamed request shows nothing until it is done, so take the engine's waiting queue as holding the newest
        # requests: that many of ours stay queued, older ones are running from now on.
        queued = r.waiting
        for j in sorted(own, key=lambda j: j.arrival, reverse=True):
            if j.first_token_at is None:
                if queued > 0:
                    queued -= 1
                elif j.rid in self._unary:
                    j.first_token_at = r.at
        excess = r.requests - len(own)
        if excess <= 0:
            return
        waiting = min(excess, queued)  # what the queue holds beyond ours
        own_kv = sum(j.context for j in own if j.started)
        each = max(1, round(max(0.0, r.kv_used_tokens - own_kv) / max(1, excess - waiting)))
        planned = self.history.mean_beyond(0) or float(self.cfg.others_pred_len)
        for k in range(1, excess + 1):
            v.inst.jobs[-k] = Job(-k, each, planned, arrival=r.at, started=True,
                                  first_token_at=None if k <= waiting else r.at)
        v.others = excess

    def _update_limits(self, block_size: int) -> None:
        # the fleet-wide capacity stands in for an engine that has not reported yet: the smallest known, to be safe
        kv = min(v.capacity for v in self.views if v.capacity)
        if self.limits is not None and self.limits.kv_tokens == kv and self.limits.block_size == block_size:
            return
        c = self.cfg
        self.limits = Limits(kv_tokens=kv, block_size=block_size, max_num_seqs=c.max_num_seqs, chunk_tokens=c.chunk_tokens,
                             latency=c.latency, ttft_s=c.ttft_s, atgt_s=c.atgt_s)
        if self.policy is None:
            self.policy = make_placement(self.name, self.limits, self.cfg.seed, replica=self.cfg.replica)
        else:
            self.policy.limits = self.limits

    def rejoin(self, v: EngineView) -> None:
        """The engine passes its health checks again: placeable, with an empty view until its next report."""
        v.inst.healthy = True

    def take_out(self, v: EngineView) -> None:
        """The engine failed: nothing of its view is true any more (its calls are being cancelled and re-placed)."""
        v.inst.healthy = False
        v.inst.jobs.clear()
        v.inst.overruns_seen.clear()
        v.inst.early_tokens, v.inst.early_count = 0.0, 0
        v.others, v.report = 0, None

    # --- decisions -------------------------------------------------------------------------------
    def _fallback_reason(self, exclude: frozenset[str], now: float) -> str | None:
        reason = None
        for v in self.views:
            if not v.inst.healthy or v.inst.name in exclude:
                continue
            if v.report is None:
                reason = reason or "no_report"
            elif now - v.report.at > self.cfg.stale_after_s:
                v.drop_others()
                reason = reason or "stale"
        if self.load_aware and self.policy is None:
            return "no_capacity"
        return reason if self.load_aware else None

    def choose(self, job: Job, exclude: frozenset[str], now: float) -> int | None:
        """Index of the engine for ``job`` (added to its view), or None when no healthy engine outside ``exclude`` is left."""
        job.started, job.generated, job.first_token_at, job.repredicted = False, 0, None, None
        reason = self._fallback_reason(exclude, now)
        policy = self.policy
        if reason is not None or policy is None:
            policy = self.jsq
            if reason is not None and any(v.inst.healthy and v.inst.name not in exclude for v in self.views):
                self.on_fallback(reason)
        i = policy.choose([v.inst for v in self.views], job, now, exclude)
        if i is not None:
            self.views[i].inst.add(job)
        return i

    def place_on(self, v: EngineView, job: Job) -> None:
        """Put ``job`` on ``v`` again without a choice: its request goes back to the same engine."""
        job.started, job.generated, job.first_token_at, job.repredicted = False, 0, None, None
        v.inst.add(job)

    # --- a placed job's life ---------------------------------------------------------------------
    def sent(self, job: Job) -> None:
        """A non-streaming request went out: it can no longer move; it counts as running once a report says so."""
        job.started = True
        self._unary.add(job.rid)

    def tokens(self, job: Job, n: int, now: float) -> None:
        """``n`` more output tokens streamed back; past its prediction a job is re-predicted from history (Aladdin §4.3)."""
        if n <= 0:
            return
        job.started = True
        if job.first_token_at is None:
            job.first_token_at = now
        job.generated += n
        if job.generated >= job.pred_len and (job.repredicted is None or job.generated >= job.repredicted):
            job.repredicted = self.history.repredict(job.pred_len, job.generated)

    def finish(self, v: EngineView, job: Job, generated: int | None) -> None:
        """The answer is complete; ``generated`` its true length when the engine said it (usage)."""
        self._unary.discard(job.rid)
        if generated is None:
            v.inst.remove(job.rid)
            return
        job.generated = generated
        self.history.add(generated)
        v.inst.finish(job.rid)

    def drop(self, v: EngineView, job: Job) -> None:
        """The request failed on this engine or is being retried elsewhere: it leaves the view without feedback."""
        self._unary.discard(job.rid)
        if v.inst.jobs.get(job.rid) is job:
            v.inst.remove(job.rid)

    # --- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Counter]:
        """Each policy's counters (placed, would_open, rejected_*, ...): the configured one and the JSQ fallback."""
        out = {"jsq": self.jsq.stats}
        if self.policy is not None:
            out[self.policy.name] = self.policy.stats
        return out

    def state(self) -> dict:
        """What /health shows: the placement, the limits it decides with (None until a KV capacity is known), its counters."""
        lim = self.limits
        limits = None if lim is None else {
            "kv_tokens": lim.kv_tokens, "block_size": lim.block_size, "max_num_seqs": lim.max_num_seqs,
            "chunk_tokens": lim.chunk_tokens, "latency": lim.latency.describe() if lim.latency else None,
            "ttft_s": lim.ttft_s, "atgt_s": lim.atgt_s}
        return {"name": self.name, "limits": limits, "stats": {k: dict(v) for k, v in self.stats().items()}}
