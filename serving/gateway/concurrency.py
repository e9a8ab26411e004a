"""Each engine's bound on requests in flight, learnt from the SLO its answers meet (``--engine-bound slo``).

Why: a fixed bound per engine (``--max-outstanding-per-engine``) keeps queues and memory finite but not latency. Measured
on two CPU engines past their saturation rate, a bound at the engines' batch size still let the accepted requests miss
their per-token target most of the time: with every place filled, each decode step serves more requests, beside the
gateway and the clients on the same cores, and a token takes longer than the target. The concurrency an engine can hold
within the SLO depends on the model, the prompts, the hardware and what else runs there, so it is measured, not set.

How: the gateway already sees, for each answer, when it was sent to its engine, when its first token came (streams) and
when it ended, so it knows whether the engine served it within the SLO (first token within the TTFT target, later tokens
within the ATGT target on average; a non-streamed answer within TTFT + ATGT x its later tokens), and how many of its
requests the engine held on average while it did (the time average of the engine's requests in flight over the
answer's life). Additive increase, multiplicative decrease, as TCP's congestion window and the adaptive concurrency
limits of service meshes (Envoy, Netflix's concurrency-limits) do, counting only the answers that lived near the bound
(the engine held at least ``NEAR`` of it, on average), where the bound is what decides how loaded the engine is:

- a miss there cuts the bound to ``BETA`` x the concurrency it lived under, when the recent miss rate there is past
  ``miss_target`` and the answer was sent after the last cut (those sent before it were admitted under the old bound
  and would count the same congestion twice);
- an answer that met the SLO there raises the bound by 1/bound (about one place per bound's worth of answers), while
  the miss rate is within the target;
- a stream is judged early, at its ``checkpoint``-th later token (``CHECKPOINT`` by default), when it already misses
  there (its first token was late, or its later tokens so far are slower than the target on average), rather than
  seconds later at its end: by then every answer admitted meanwhile has lived at the same congestion, so the bound
  would overshoot by all of them (the delay signal of TCP Vegas and of the delay-based limits, read from each stream's
  own pace). A stream on track at the checkpoint is judged at its end, as a non-streamed answer is;
- an answer that lived well below the bound says nothing about it: a miss there (a long prompt, a neighbour's burst of
  CPU) is noise that no bound cures, and cutting on it would refuse requests at a light load; a bound the engine does
  not reach is not raised either, since nothing shows that the engine could hold more (TCP's congestion-window
  validation).

The bound starts at the engines' batch (``start``, their ``--max-num-seqs``: past it a request waits inside the engine
for a place, and at a bound far above what the engine holds no answer would ever count), may rise to the fixed
per-engine bound (the ceiling) while answers at it meet the SLO, and never falls below ``floor``. What it keeps is a
miss rate near ``miss_target`` among the answers at the bound: 10% by default, the share of misses that an SLO
attainment of 90% allows.
"""

from __future__ import annotations

from dataclasses import dataclass

BETA = 0.8  # the cut on a miss: the bound falls to this share of the concurrency the missed answer lived under
NEAR = 0.75  # an answer lived near the bound when the engine held at least this share of it, on average
ALPHA = 0.05  # the miss rate's smoothing: about the last twenty answers near the bound
CHECKPOINT = 32  # a stream's later tokens when it is judged early if it already misses (the default of
# --engine-bound-checkpoint): long enough that one prefill beside it (a few tens of ms on a CPU step) does not make its
# pace, short enough to be a fraction of a typical answer


@dataclass(frozen=True, slots=True)
class Served:
    """One answer as the gateway saw it (``time.perf_counter()`` seconds); ``first_token`` None for a non-streamed one."""

    sent: float
    first_token: float | None
    end: float  # its end, or now for a stream judged early
    tokens: int  # its tokens, or so far for a stream judged early
    lived: float  # the engine's requests in flight, averaged over the answer's life (itself included)


def met_slo(s: Served, ttft_s: float, atgt_s: float) -> bool:
    """Whether the engine served ``s`` within the targets (TTFT from the send to the engine, not from the client's
    arrival: the time before it, prediction included, is not the engine's and no engine bound changes it)."""
    later = max(0, s.tokens - 1)
    if s.first_token is None:
        return s.end - s.sent <= ttft_s + atgt_s * later
    if s.first_token - s.sent > ttft_s:
        return False
    return later == 0 or (s.end - s.first_token) / later <= atgt_s


class EngineLimit:
    """One engine's learnt bound. :attr:`bound` is what placement compares the engine's requests in flight against."""

    def __init__(self, ceiling: int, ttft_s: float, atgt_s: float, floor: int = 1, start: int | None = None,
                 miss_target: float = 0.1, checkpoint: int = CHECKPOINT) -> None:
        if not 1 <= floor <= ceiling:
            raise ValueError(f"the floor {floor} must be between 1 and the ceiling {ceiling}")
        self.ceiling, self.floor, self.ttft_s, self.atgt_s, self.miss_target = ceiling, floor, ttft_s, atgt_s, miss_target
        self.checkpoint = checkpoint  # a stream's later tokens when it is judged if it already misses; 0: at its end
        self.limit = float(min(ceiling, max(floor, start or ceiling)))
        self.miss_rate = 0.0
        self.cuts = self.raises = self.observed = self.missed = 0
        self._cut_at = float("-inf")  # when the last cut happened: answers sent before it do not cut again

    @property
    def bound(self) -> int:
        return max(self.floor, int(self.limit))

    def observe(self, s: Served) -> bool:
        """Learn from one answer; returns whether it met the SLO."""
        met = met_slo(s, self.ttft_s, self.atgt_s)
        self.observed += 1
        self.missed += not met
        if s.lived < NEAR * self.limit:
            return met
        self.miss_rate += ALPHA * ((not met) - self.miss_rate)
        if met:
            if self.miss_rate <= self.miss_target and self.limit < self.ceiling:
                self.limit = min(float(self.ceiling), self.limit + 1.0 / self.limit)
                self.raises += 1
        elif self.miss_rate > self.miss_target and s.sent >= self._cut_at:
            self.limit = max(float(self.floor), BETA * min(self.limit, s.lived))
            self.cuts += 1
            self._cut_at = s.end
        return met

    def early(self, s: Served) -> bool:
        """A stream still running, at its checkpoint: learnt from now, as a miss, if it already misses; returns whether
        it was (then its end must not be shown again), False for one on track, judged at its end."""
        if met_slo(s, self.ttft_s, self.atgt_s):
            return False
        self.observe(s)
        return True

    def state(self) -> dict[str, float | int]:
        return {"bound": self.bound, "limit": round(self.limit, 3), "ceiling": self.ceiling,
                "miss_rate_near_bound": round(self.miss_rate, 4), "answers": self.observed, "missed": self.missed,
                "cuts": self.cuts, "raises": self.raises}


class InFlightClock:
    """An engine's requests in flight integrated over time, so any answer's average concurrency is two readings."""

    __slots__ = ("_area", "_n", "_t")

    def __init__(self, now: float) -> None:
        self._area, self._n, self._t = 0.0, 0, now

    def set(self, n: int, now: float) -> None:
        """The count changed to ``n`` at ``now``."""
        self._area += self._n * (now - self._t)
        self._n, self._t = n, now

    def area(self, now: float) -> float:
        return self._area + self._n * (now - self._t)

    def average(self, since: tuple[float, float], now: float) -> float:
        """The average count from ``since`` (a (time, area) reading) to ``now``."""
        t0, a0 = since
        return (self.area(now) - a0) / (now - t0) if now > t0 else float(self._n)
