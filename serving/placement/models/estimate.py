"""What a mesh can serve, estimated without running it: MuxServe's throughput estimator (MuxServe §3.2), priced by
a step model instead of MuxServe's profiled cost tables.

MuxServe estimates a model's throughput on a mesh at a decode SM share as ``B / (t_prefill(B) + O x t_decode(B))``
(a batch of B requests prefilled, then decoded for the mean output O), with B the smallest batch that reaches the
model's rate within the KV cache; models of one mesh wait for each other's prefills, so a model's round holds every
co-located model's prefill. What it knows of the requests is one mean prompt and one mean output for every model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from serving.perf.hardware import get_model
from serving.perf.latency import RooflineLatency, StepShape

GB = 1e9
MAX_BATCH = 256  # the largest decode batch MuxServe profiles
# decode SM shares tried (MuxServe's estimate_mps): its profiled percentages up to 90; its placements never give a
# decode job under 30
MPS_LEVELS = tuple(p / 100 for p in range(30, 100, 10))
MEMORY_UTILISATION = 0.9  # vLLM's default share of a GPU's memory, what a mesh of ours or SeaLLM's may fill
ACTIVATION_GB = 6.0  # MuxServe's reserve per model on a mesh: activations and the two processes' start-up memory
PROCESS_GB = 1.6

LatencyOf = Callable[[str, int], RooflineLatency]


@dataclass(frozen=True)
class Demand:
    """A model's load as a placement knows it: its LLaMA size, request rate, and the mean prompt and output lengths
    it assumes for its requests (the workload's averages for MuxServe; the model's own predicted lengths for ours)."""

    name: str
    size: str
    rate: float
    prompt_len: float
    output_len: float

    @property
    def kv_bytes_per_token(self) -> float:
        return float(get_model(self.size).kv_bytes_per_token())

    @property
    def weights_gb(self) -> float:
        return get_model(self.size).weight_bytes() / GB


class StepCosts:
    """Step times of one model on one mesh at an SM share, by batch size: MuxServe's cost table, from a step model."""

    def __init__(self, latency: RooflineLatency, prompt_len: float, output_len: float) -> None:
        self.latency = latency
        self.prompt = max(1, round(prompt_len))
        self.context = max(1, round(prompt_len + output_len / 2))  # a decode's mean context over its answer
        self._prefill: dict[tuple[int, float], float] = {}
        self._decode: dict[tuple[int, float], float] = {}

    def prefill(self, batch: int, share: float) -> float:
        """Seconds to prefill ``batch`` mean prompts at ``share`` of the SMs."""
        t = self._prefill.get((batch, share))
        if t is None:
            p = self.prompt
            compute, memory = self.latency.parts(StepShape(p * batch, 0, p * batch, batch, batch * p * p / 2))
            t = self._prefill[batch, share] = max(compute / share, memory) + self.latency.overhead_s
        return t

    def decode(self, batch: int, share: float) -> float:
        """Seconds of one decode step of ``batch`` requests at their mean context, at ``share`` of the SMs."""
        t = self._decode.get((batch, share))
        if t is None:
            compute, memory = self.latency.parts(StepShape(0, batch, batch * self.context, batch))
            t = self._decode[batch, share] = max(compute / share, memory) + self.latency.overhead_s
        return t


class Estimator:
    """MuxServe's estimator over a step model per (LLaMA size, mesh size): a model's throughput at a decode share, the
    share it needs, and a mesh's throughput with several models on it."""

    def __init__(self, latency_of: LatencyOf) -> None:
        self.latency_of = latency_of
        self._costs: dict[tuple, StepCosts] = {}

    def costs(self, d: Demand, gpus: int) -> StepCosts:
        key = (d.size, gpus, d.prompt_len, d.output_len)
        if key not in self._costs:
            self._costs[key] = StepCosts(self.latency_of(d.size, gpus), d.prompt_len, d.output_len)
        return self._costs[key]

    def max_batch(self, d: Demand, cache_gb: float) -> int:
        per_seq = d.kv_bytes_per_token * (d.prompt_len + d.output_len) / GB
        return int(min(cache_gb // per_seq, MAX_BATCH))

    def throughput(self, d: Demand, gpus: int, share: float, cache_gb: float,
                   prefill_share: float = 1.0) -> tuple[bool, float, int]:
        """(whether the rate is met, the throughput, the batch): the smallest batch whose round reaches the rate, by
        bisection as MuxServe's estimate_throughput; a rate met within min(0.5, 10%) counts as met."""
        c = self.costs(d, gpus)
        lo, hi = 1, max(2, self.max_batch(d, cache_gb))
        tpt, bs = 0.0, lo
        while hi - lo > 1:
            bs = (lo + hi) // 2
            tpt = bs / (c.decode(bs, share) * d.output_len + c.prefill(bs, prefill_share))
            if tpt >= d.rate:
                hi = bs
            else:
                lo = bs
        if tpt + min(0.5, tpt * 0.1) > d.rate:
            return True, d.rate, bs
        return False, tpt, bs

    def share_for(self, d: Demand, gpus: int, cache_gb: float) -> tuple[bool, float, int, float]:
        """(met, decode share, batch, throughput): the smallest of :data:`MPS_LEVELS` that meets the rate, else the
        share of the highest throughput (MuxServe's estimate_mps)."""
        best = (False, MPS_LEVELS[-1], 1, 0.0)
        for share in MPS_LEVELS:
            ok, tpt, bs = self.throughput(d, gpus, share, cache_gb)
            if ok:
                return True, share, bs, tpt
            if tpt > best[3]:
                best = (False, share, bs, tpt)
        return best

    def mesh_cache_gb(self, gpus: int, demands: list[Demand], gpu_gb: float) -> float:
        return max(0.0, gpus * gpu_gb * 0.98 - sum(d.weights_gb for d in demands) - ACTIVATION_GB * len(demands))

    def mesh_throughput(self, gpus: int, demands: list[Demand], shares: list[float],
                        gpu_gb: float) -> tuple[float, list[int], list[float]]:
        """A mesh of several models (MuxServe's estimate_mesh_throughput): KV split by rate x KV bytes a token; each
        model's batch grown one at a time where its rate is furthest from met; every model's round holds all the
        mesh's prefills. (The rate-weighted mean throughput, the batches, each model's throughput), at its best."""
        cache = self.mesh_cache_gb(gpus, demands, gpu_gb)
        weight = sum(d.rate * d.kv_bytes_per_token for d in demands)
        local = [cache * d.rate * d.kv_bytes_per_token / weight for d in demands]
        batches = [self.throughput(d, gpus, s, c)[2] for d, s, c in zip(demands, shares, local)]
        caps = [self.max_batch(d, c) for d, c in zip(demands, local)]
        costs = [self.costs(d, gpus) for d in demands]
        total_rate = sum(d.rate for d in demands)
        best = (0.0, list(batches), [0.0] * len(demands))
        for _ in range(MAX_BATCH * len(demands)):
            prefills = sum(c.prefill(max(1, b), 1.0) for c, b in zip(costs, batches))
            tpts = [max(1, b) / (c.decode(max(1, b), s) * d.output_len + prefills)
                    for c, b, s, d in zip(costs, batches, shares, demands)]
            mesh = sum(t * d.rate for t, d in zip(tpts, demands)) / total_rate
            if mesh > best[0]:
                best = (mesh, list(batches), tpts)
            short = [(t / d.rate, i) for i, (t, d) in enumerate(zip(tpts, demands))
                     if t + min(0.5, t * 0.1) < d.rate and batches[i] < caps[i]]
            if not short:
                break
            batches[min(short)[1]] += 1
        return best
