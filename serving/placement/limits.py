"""An instance's capacity as Aladdin's constraints see it (Aladdin §3, Eq. 1–4, MIP constraints b–e).

* **KV at every future step** (e): each job holds ``context + s`` tokens at its s-th future step until
  its predicted remaining length runs out, then nothing. The projected total is piecewise linear and
  rises between finishes, so its peak is at the step just before some job finishes: checking those
  breakpoints is exact and costs a sort.
* **ATGT** (b): decode speed falls with batch size b and total context; ``context_limit(b)`` is Eq. 4's
  l_d(b), the largest total context whose decode step stays within the ATGT target, read off the
  latency model (any of the simulator's, including one fitted to a real engine).
* **TTFT** (c): the prefill of everything not started, plus the new prompt, within θ × the TTFT
  target, priced as vLLM V1 runs it: chunks beside the running decodes (``prefill_s``).
* **Slack** (d): that prefill stalls the running decodes, so it may only spend the slack they banked
  (ATGT target × tokens generated − time spent decoding).

γ (how much of a job's output counts toward its context in (b)) defaults to Aladdin's 0.5; θ, the margin
for prediction error, is not published: 0.9 here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from serving.perf.latency import LatencyModel, StepShape
from serving.placement.state import Instance, Job


@dataclass
class Limits:
    kv_tokens: int                     # KV capacity of an instance, in tokens (blocks × block_size); an
                                       # Instance's own kv_tokens replaces it for that instance
    block_size: int = 16
    max_num_seqs: int = 256
    chunk_tokens: int = 2048           # prefill is priced in chunks of max_num_batched_tokens
    latency: LatencyModel | None = None  # without one, only the KV and batch-size limits apply
    ttft_s: float | None = None        # T_pre
    atgt_s: float | None = None        # T_dec
    gamma: float = 0.5
    theta: float = 0.9
    kv_margin: float = 1.0             # fraction of KV the projection may fill
    _ld: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.kv_tokens <= 0 or self.block_size <= 0 or self.max_num_seqs <= 0 or self.chunk_tokens <= 0:
            raise ValueError("kv_tokens, block_size, max_num_seqs and chunk_tokens must be positive")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma is a fraction in [0, 1], got {self.gamma}")
        if not 0.0 < self.theta <= 1.0 or not 0.0 < self.kv_margin <= 1.0:
            raise ValueError("theta and kv_margin are fractions in (0, 1]")

    @property
    def kv_blocks(self) -> float:
        return self.kv_tokens / self.block_size

    def kv_tokens_of(self, inst: Instance) -> int:
        """The KV capacity of ``inst``: its own when known (a fleet of mixed engines), else the fleet's."""
        return inst.kv_tokens or self.kv_tokens

    def kv_room_blocks(self, inst: Instance) -> float:
        """The KV blocks a projection on ``inst`` may fill (its capacity times ``kv_margin``)."""
        return self.kv_margin * self.kv_tokens_of(inst) / self.block_size

    # -- projections -----------------------------------------------------------------------------
    def kv_peak_blocks(self, jobs: Iterable[Job], extra: Job | None = None) -> float:
        """Peak KV blocks over every future step if each job runs exactly its planned length from now."""
        pairs = [(j.remaining, j.context) for j in jobs]
        if extra is not None:
            pairs.append((extra.remaining, extra.context))
        pairs.sort(key=lambda p: p[0])
        n = len(pairs)
        if not n:
            return 0.0
        suffix = [0.0] * (n + 1)
        for k in range(n - 1, -1, -1):
            suffix[k] = suffix[k + 1] + pairs[k][1]
        bs = self.block_size
        peak = 0.0
        prev = None
        for k, (rem, _) in enumerate(pairs):
            if rem == prev:
                continue
            prev = rem
            alive = n - k                 # jobs with remaining >= rem are still running at step rem - 1
            s = math.ceil(rem) - 1
            peak = max(peak, (suffix[k] + alive * s) / bs + alive)  # ceil(x / bs) <= x / bs + 1
        return peak

    def weighted_context(self, jobs: Iterable[Job]) -> float:
        """Σ (l_in + γ · l_out) over jobs, with l_out the planned output (constraint b, capacity_norm)."""
        g = self.gamma
        return sum(j.prompt_len + g * j.planned_len for j in jobs)

    def decode_step_s(self, batch: int, context: float) -> float:
        assert self.latency is not None
        return self.latency.step_time(StepShape(0, batch, max(0, int(context)), batch))

    def context_limit(self, batch: int) -> float:
        """Eq. 4's l_d(b): the most total context a decode batch of ``batch`` may hold within the ATGT target."""
        if batch > self.max_num_seqs:
            return -math.inf
        if self.latency is None or self.atgt_s is None:
            return math.inf
        if batch in self._ld:
            return self._ld[batch]
        t = self.atgt_s
        if self.decode_step_s(batch, 0) > t:
            val = -math.inf
        else:
            hi = float(self.kv_tokens) * 4
            if self.decode_step_s(batch, hi) <= t:
                val = math.inf  # context does not bind before KV does
            else:
                lo = 0.0
                for _ in range(40):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if self.decode_step_s(batch, mid) <= t else (lo, mid)
                val = lo
        self._ld[batch] = val
        return val

    def prefill_s(self, tokens: int, decodes: int = 0, decode_context: int = 0) -> float:
        """Time to prefill ``tokens`` prompt tokens, chunk by chunk, beside ``decodes`` running requests.

        Aladdin prices a prefill alone (Eq. 2), as its engine preempted decodes for it; vLLM V1 with
        chunked prefill runs the running decodes in every step and gives the prefill what is left of the
        token budget, so each chunk here is ``chunk_tokens − decodes`` long and its step also pays for
        the decodes and their KV reads.
        """
        if self.latency is None or tokens <= 0:
            return 0.0
        room = max(1, self.chunk_tokens - decodes) if decodes < self.chunk_tokens else 1
        total, done = 0.0, 0
        while done < tokens:
            n = min(room, tokens - done)
            total += self.latency.step_time(StepShape(n, decodes, decode_context + done + n, decodes + 1, n * (done + n / 2)))
            done += n
        return total

    # -- Aladdin's constraints -------------------------------------------------------------------
    def violation(self, inst: Instance, job: Job, now: float) -> str | None:
        """The first constraint that placing ``job`` on ``inst`` breaks (kv, atgt, ttft, slack), or None."""
        jobs = inst.jobs.values()
        if self.kv_peak_blocks(jobs, job) > self.kv_room_blocks(inst):
            return "kv"
        b = len(inst.jobs) + 1
        if self.weighted_context(jobs) + job.prompt_len + self.gamma * job.planned_len > self.theta * self.context_limit(b):
            return "atgt"
        if self.latency is None:
            return None
        waiting = job.prompt_len
        decodes = ctx = 0
        for j in jobs:
            if j.first_token_at is not None:
                decodes += 1
                ctx += j.context
            else:  # not started, or still in its (chunked) prefill
                waiting += j.prompt_len
        t_pre = self.prefill_s(waiting, min(decodes, self.max_num_seqs - 1), ctx)
        if self.ttft_s is not None and t_pre > self.theta * self.ttft_s:
            return "ttft"
        if self.atgt_s is not None:
            slack = min((self.atgt_s * j.generated - (now - j.first_token_at) for j in jobs
                         if j.first_token_at is not None and j.generated > 0), default=math.inf)
            if t_pre > self.theta * slack:
                return "slack"
        return None

    def capacity_norm(self, inst: Instance, extra: Job | None = None) -> float:
        """Aladdin's load: L2 norm of batch size and weighted context, each relative to its own limit."""
        b = len(inst.jobs) + (extra is not None)
        ctx = self.weighted_context(inst.jobs.values())
        if extra is not None:
            ctx += extra.prompt_len + self.gamma * extra.planned_len
        return math.hypot(b / self.max_num_seqs, ctx / self.kv_tokens_of(inst))
