"""The plug-in's counters as Prometheus metrics, served from inside the engine process.

vLLM's own ``/metrics`` lives in the API-server process, while the scheduler runs in the engine-core
process, so the plug-in serves its counters on a port of its own (``metrics_port`` in its settings;
:mod:`serving.engine.channel`).
The gateway scrapes that port for each engine and re-exports the series with an ``engine`` label;
Prometheus can also scrape it directly. Values are read from ``lengthwise_stats()`` at scrape time,
so nothing is maintained on the scheduler's hot path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "lengthwise_scheduler_"

# stats key -> (metric name, help, is a counter)
SERIES: dict[str, tuple[str, str, bool]] = {
    "requests": ("requests", "requests the plug-in received", True),
    "fallback_predictions": ("fallback_predictions", "requests without pred_len in vllm_xargs (ran on default_pred_len)", True),
    "invalid_inputs": ("invalid_inputs", "requests whose vllm_xargs were malformed", True),
    "rejected": ("rejected", "requests that can never fit the KV pool, failed at arrival", True),
    "finished": ("finished", "requests that left the engine finished", True),
    "aborted": ("aborted", "requests that left the engine aborted", True),
    "steps": ("steps", "engine steps scheduled", True),
    "policy_preemptions": ("policy_preemptions", "recompute preemptions the policy chose", True),
    "vllm_preemptions": ("vllm_preemptions", "preemptions vLLM made on its own (KV ran out mid-step)", True),
    "vllm_preempted_held": ("vllm_preempted_held", "of those, requests the plan held out of the step with their KV", True),
    "held_request_steps": ("held_request_steps", "request-steps a running request was held (paused or decoupled)", True),
    "plan_mismatch_steps": ("plan_mismatch_steps", "steps where vLLM scheduled other tokens than the plan", True),
    "alone_steps": ("alone_steps", ("steps cut to one request computing prompt logprobs (LoRA on: vLLM fails on them "
                                    "beside another request)"), True),
    "pauses": ("pauses", "under-predicted requests paused for re-prediction", True),
    "hosted": ("hosted", "requests hosted in another's reserved KV (KVC pipelining)", True),
    "refinements_received": ("refinements_received", "refined predictions queued for a running request", True),
    "refinements_unknown": ("refinements_unknown", "refined predictions for no running request (404)", True),
    "refinements_replaced": ("refinements_replaced", "refined predictions replaced by a newer one before a step", True),
    "refinements_applied": ("refinements_applied", "refined predictions the policy took", True),
    "live": ("live_requests", "requests the policy holds now", False),
    "ledger_blocks_used": ("ledger_blocks_used", "KV blocks reserved in the policy's ledger", False),
    "ledger_blocks_total": ("ledger_blocks_total", "KV blocks in the pool", False),
    "policy_sched_us_per_step": ("policy_us_per_step", "mean policy decision time per step (µs)", False),
    "adapter_us_per_step": ("adapter_us_per_step", "mean adapter time per step (µs)", False),
}


class StatsCollector(Collector):
    """Turns a ``lengthwise_stats()`` snapshot into metric families on every scrape."""

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        policy = str(s.get("policy", ""))
        for key, (name, doc, counter) in SERIES.items():
            if key not in s:
                continue
            fam = (CounterMetricFamily if counter else GaugeMetricFamily)(PREFIX + name, doc, labels=["policy"])
            fam.add_metric([policy], float(s[key]))
            yield fam

