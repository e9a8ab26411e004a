"""Which of one base model's engines serve which of its services (the base and its LoRA adapters), from their
predicted lengths: the plan ``lengthwise serve --models`` lays on the engines through each entry's ``on_engines``.

The GPU placement (:mod:`serving.placement.models.lengthwise`) shares meshes among models of different weights; here
every engine holds the same weights, so what a plan decides is which services meet in one batch. Keeping a service
apart matters on vLLM: an engine started without ``--enable-lora`` runs its base's tokens without the LoRA path, and
one adapter's long answers hold the KV and the batch of every service beside it. Spreading a service over more engines
than it needs buys pooling. So each service's load is what it will ask of an engine, priced by the engine's step model
from its predicted lengths (not its true ones, which nobody has at planning time); a service stays on one engine
unless it would hold more than its fair share by :data:`SPLIT_ABOVE`, and the pieces go least-loaded first (LPT).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from serving.perf.latency import LatencyModel, StepShape

SPLIT_ABOVE = 1.25
"""A service is split over several engines only when its load exceeds the fair share of one (the fleet's load over
its engines) by this factor: below it, the imbalance a whole service leaves costs less than mixing it into every
batch."""


@dataclass(frozen=True)
class ServiceLoad:
    """One service's expected traffic: its request rate, mean prompt and mean *predicted* answer in tokens."""

    name: str
    rate: float
    prompt_tokens: float
    predicted_tokens: float


@dataclass(frozen=True)
class EnginePlan:
    """For each engine, the services placed on it, and the share of its time they are predicted to take."""

    serves: tuple[tuple[str, ...], ...]
    loads: tuple[float, ...]
    batch: float  # the per-engine running batch the loads were priced at

    def on_engines(self, name: str) -> list[int]:
        """The engines serving ``name`` (a catalogue entry's ``on_engines``)."""
        return [i for i, names in enumerate(self.serves) if name in names]


def _step(latency: LatencyModel, prefill: float, batch: float, context: float) -> float:
    b = max(0, round(batch))
    return latency.step_time(StepShape(round(prefill), b, round(b * context), b + (prefill > 0)))


def running_batch(services: list[ServiceLoad], engines: int, latency: LatencyModel, max_num_seqs: int) -> float:
    """The requests an engine decodes at once when the load is spread evenly: Little's law (batch = arrivals x time in
    the engine, that time = predicted tokens x the step time at that batch), solved by fixed-point iteration."""
    rate = sum(s.rate for s in services) / engines
    if rate <= 0:
        return 0.0
    out = sum(s.rate * s.predicted_tokens for s in services) / sum(s.rate for s in services)
    ctx = sum(s.rate * (s.prompt_tokens + s.predicted_tokens / 2) for s in services) / sum(s.rate for s in services)
    batch = 1.0
    for _ in range(50):
        batch = min(float(max_num_seqs), max(1.0, rate * out * _step(latency, 0, batch, ctx)))
    return batch


def service_work(s: ServiceLoad, latency: LatencyModel, batch: float) -> float:
    """Seconds of an engine's time per second that ``s`` asks for: each request's prompt at its marginal cost in a
    step of ``batch`` decodes, and each predicted token at its share of such a step."""
    ctx = s.prompt_tokens + s.predicted_tokens / 2
    prefill = _step(latency, s.prompt_tokens, batch, ctx) - _step(latency, 0, batch, ctx)
    per_token = _step(latency, 0, batch, ctx) / max(1.0, batch)
    return s.rate * (max(0.0, prefill) + s.predicted_tokens * per_token)


def place_services(services: list[ServiceLoad], engines: int, latency: LatencyModel, max_num_seqs: int) -> EnginePlan:
    """The services of one base laid on ``engines`` engines by predicted load (see the module's docstring). Every
    engine gets at least one service while there are services to split; a service is never split over more engines
    than there are."""
    if engines < 1:
        raise ValueError("place_services needs at least one engine")
    if not services:
        raise ValueError("place_services needs at least one service")
    batch = running_batch(services, engines, latency, max_num_seqs)
    work = {s.name: service_work(s, latency, batch) for s in services}
    fair = sum(work.values()) / engines
    pieces: list[tuple[float, str, int]] = []  # (work of one piece, service, pieces of that service)
    for s in sorted(services, key=lambda s: -work[s.name]):
        k = min(engines, max(1, math.ceil(work[s.name] / (fair * SPLIT_ABOVE)))) if fair > 0 else 1
        pieces += [(work[s.name] / k, s.name, k)] * k
    spare = engines - len(pieces)
    while spare > 0:  # more engines than pieces: split the heaviest service further, so no engine stands idle
        w, name, k = max((p for p in pieces if p[2] < engines), default=(0.0, "", engines))
        if not name:
            break
        pieces = [p for p in pieces if p[1] != name] + [(w * k / (k + 1), name, k + 1)] * (k + 1)
        spare = engines - len(pieces)
    load = [0.0] * engines
    serves: list[list[str]] = [[] for _ in range(engines)]
    for w, name, _ in sorted(pieces, key=lambda p: (-p[0], p[1])):
        i = min((i for i in range(engines) if name not in serves[i]), key=lambda i: (load[i], i))
        load[i] += w
        serves[i].append(name)
    return EnginePlan(tuple(tuple(names) for names in serves), tuple(load), batch)


def everywhere(services: list[ServiceLoad], engines: int) -> EnginePlan:
    """Every service on every engine: a catalogue without ``on_engines``, the placement that plans nothing."""
    return EnginePlan(tuple(tuple(s.name for s in services) for _ in range(engines)), tuple([math.nan] * engines),
                      math.nan)
