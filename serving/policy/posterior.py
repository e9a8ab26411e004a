"""The posterior policy: every request's length as a belief that sharpens as it runs, ranked by what it is worth.

What it knows of a request, and how it uses it:

- **The prediction as a distribution**: the bucket probabilities the gateway forwards, or a point prediction widened
  by the actual/predicted ratios its predictor has shown on this service (:mod:`serving.policy.priors`).
- **The service's history**: a prior over lengths learnt from the service's finished requests (SeaLLM's profile,
  kept as a histogram), mixed with the per-request belief by the weight under which the service's recent lengths
  were likeliest: a predictor that knows nothing leaves the service prior, as SeaLLM has it; one whose beliefs were
  right leaves its own, and with exact lengths the order is SRPT.
- **What a request has written**: the belief is conditioned on the tokens written so far
  (:class:`~serving.policy.belief.LengthBelief`), for the rank of a preempted request, the KV it is projected to
  need and which running request yields under KV pressure.
- **The SLO the operator set** (``slo_kind``): ``normalised`` and ``jct`` weight each finish by ``1 / L`` (mean
  normalised latency; a JCT deadline also scales with the length), and ``jct`` keeps the late tier (a request that
  can no longer meet its deadline yields); ``ttft+tpot`` ranks unweighted (most first tokens soonest) and puts a
  request that has already waited past its TTFT target behind those that can still make it.

The rank (``posterior_index``) is the c-mu rule on the posterior, expected remaining tokens times expected length
(SeaLLM's priority with the belief in place of its doubling budget), or the Gittins index of the whole belief (the
``lengthwise-gittins`` ablation: it lost, since a step serves 256 requests, not one).

Admission is the projected peak of :class:`~serving.policy.lengthwise.LengthwisePolicy`, each request projected at the
``kv_quantile`` of its remaining length instead of one padded number; the step budget is the TFS. A request that
has waited ``aging_s`` goes ahead of everything (the starvation bound).

Named ablations: ``lengthwise-prior`` (the service prior alone, no per-request prediction: SeaLLM's order with the
histogram's posterior in place of the budget), ``lengthwise-own`` (the per-request belief alone, no service prior).
"""

from __future__ import annotations

import heapq
import math

from serving.policy.belief import LengthBelief
from serving.policy.lengthwise import LengthwisePolicy
from serving.policy.priors import ServicePriors
from serving.policy.request import Request, SortedQueue

_AGED, _MISSED = 0, 1


class PosteriorPolicy(LengthwisePolicy):
    name = "lengthwise-posterior"

    def __init__(self, *args, use_prior: bool = True, use_prediction: bool = True, index: str | None = None,
                 **kwargs) -> None:
        kind = args[0].slo_kind if args else kwargs["config"].slo_kind
        super().__init__(*args, late_tier=kind == "jct", **kwargs)
        self.index = index or self.cfg.posterior_index
        self.name = type(self).name  # the parent names itself by its late tier; this policy's name is its own
        if not use_prior:
            self.name = "lengthwise-own"
        elif not use_prediction:
            self.name = "lengthwise-prior"
        elif index == "gittins":
            self.name = "lengthwise-gittins"
        self.use_prior, self.use_prediction = use_prior, use_prediction
        self.kind = kind
        self.weighted = kind != "ttft+tpot"
        self.priors = ServicePriors(self.cfg.prior_window, self.cfg.prior_client_share)
        self.beliefs: dict[int, LengthBelief] = {}
        self._spans: dict[int, tuple[float, float, float]] = {}  # rid -> (age from, age to, KV quantile of its length)
        self.aged: set[int] = set()
        self.missed: set[int] = set()
        self._events: list[tuple[float, int, int]] = []  # (when, kind, rid): aging and missed-TTFT moments, a heap
        self.stats.update(resorts=0, missed_ttft=0)

    # -- the belief ------------------------------------------------------------------------------------------------
    def belief_of(self, req: Request) -> LengthBelief:
        b = self.beliefs.get(req.rid)
        if b is None:
            b = self.beliefs[req.rid] = self._build(req)
        return b

    def _build(self, req: Request) -> LengthBelief:
        cap = max(1, self.max_seq_len(req) - req.prompt_len)
        profile = self.priors.profile(req.service) if self.use_prior else None
        if not self.use_prediction and profile is not None and profile.prior is not None:
            return LengthBelief(profile.prior.xs, profile.prior.ps, cap)
        own = self._own(req, profile, cap)
        if profile is None or profile.prior is None or profile.skill >= 1.0:
            return own
        return LengthBelief.mixture([(profile.skill, own), (1.0 - profile.skill, profile.prior)], cap)

    @staticmethod
    def _own(req: Request, profile, cap: float) -> LengthBelief:
        """The per-request belief: the bucket distribution, or the point widened by the predictor's measured ratios."""
        pred = req.pred
        if pred.edges and pred.probs:
            return LengthBelief.from_buckets(pred.edges, pred.probs, cap)
        if profile is not None and profile.ratios:
            return LengthBelief.scaled(pred.length, profile.ratios, cap)
        return LengthBelief.point(pred.length, cap)

    def rank(self, req: Request) -> float:
        b = self.belief_of(req)
        if self.index == "mean":
            rem = b.remaining(req.generated)
            return rem * (rem + req.generated) if self.weighted else rem
        return b.gittins_rank(req.generated, self.weighted)

    # -- ordering --------------------------------------------------------------------------------------------------
    def _enqueue_new(self, req: Request, now: float) -> None:
        if req.rid not in self.beliefs:  # on arrival (a host preemption re-queues it: its moments are set)
            heapq.heappush(self._events, (req.arrival + self.cfg.aging_s, _AGED, req.rid))
            if self.kind == "ttft+tpot" and self.cfg.ttft_s is not None:
                heapq.heappush(self._events, (req.arrival + self.cfg.ttft_s, _MISSED, req.rid))
        super()._enqueue_new(req, now)

    def _key(self, req: Request) -> tuple:
        rid = req.rid
        if rid in self.aged:
            return (0, 0, 0.0)
        late = (self.tier is not None and rid in self.tier.late) or rid in self.missed
        return (1, int(late), self.rank(req))

    def _requeue(self, req: Request) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
            self.waiting.push(self._rank(req), req)

    def _schedule(self, now: float):
        events = self._events
        while events and events[0][0] <= now:
            _, what, rid = heapq.heappop(events)
            req = self.requests.get(rid)
            if req is None:
                continue
            if what == _AGED:
                self.aged.add(rid)
            elif req.first_scheduled is None:
                self.missed.add(rid)
                self.stats["missed_ttft"] += 1
            self._requeue(req)
        return super()._schedule(now)

    def _expected_remaining(self, req: Request) -> int:
        """The late tier's estimate: the belief's conditional mean (a request aged past ``aging_s`` is never late:
        :meth:`LateTier.is_late` says so by its wait)."""
        return math.ceil(self.belief_of(req).remaining(req.generated))

    # -- KV: the projected peak at a quantile of each remaining length ----------------------------------------------
    def _remaining(self, r: Request) -> int:
        g = r.generated
        span = self._spans.get(r.rid)
        if span is None or not span[0] <= g < span[1]:  # the hot path: one lookup per running request per step
            span = self._spans[r.rid] = self.belief_of(r).quantile_span(g, self.cfg.kv_quantile)
        rem = max(1.0, span[2] - g)
        return max(1, min(math.ceil(rem), self.max_seq_len(r) - r.seq_len + 1))

    # -- learning and forgetting -----------------------------------------------------------------------------------
    def _completed(self, req: Request) -> None:
        own = None
        if req.extra.get("predicted", True):  # what the per-request belief gave the length that came
            cap = max(1, self.max_seq_len(req) - req.prompt_len)
            own = self._own(req, self.priors.profile(req.service), cap).mass_near(req.generated)
        changed = self.priors.learn(req, own)
        if not changed or not self.waiting:
            return
        # early on a profile moves a lot: the waiting requests it describes get new beliefs and the queue is re-sorted;
        # once it has seen a few hundred lengths, new arrivals get the new profile and the queue keeps its order
        stale = [r for r in self.waiting if self._described_by(r, changed)]
        if not stale:
            return
        for r in stale:
            self.beliefs.pop(r.rid, None)
            self._spans.pop(r.rid, None)
        requeued = SortedQueue()
        for r in self.waiting:
            requeued.push(self._rank(r), r)
        self.waiting = requeued
        self.stats["resorts"] += 1

    def _described_by(self, req: Request, changed: set[str]) -> bool:
        own = self.priors.profiles.get(req.service)
        key = req.service if own is not None else ServicePriors.POOLED
        profile = own or self.priors.profiles.get(ServicePriors.POOLED)
        return key in changed and profile is not None and profile.samples <= 256

    def _on_refine(self, req: Request) -> None:
        self.beliefs.pop(req.rid, None)  # the belief starts again from the refined distribution
        self._spans.pop(req.rid, None)
        super()._on_refine(req)

    def _forget(self, rid: int) -> None:
        self.beliefs.pop(rid, None)
        self._spans.pop(rid, None)
        self.aged.discard(rid)
        self.missed.discard(rid)

    def _on_finish(self, req: Request, now: float) -> None:
        super()._on_finish(req, now)
        self._forget(req.rid)

    def _on_abort(self, req: Request, now: float) -> None:
        super()._on_abort(req, now)
        self._forget(req.rid)
