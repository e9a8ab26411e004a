"""Prometheus metrics of the gateway (``GET /metrics``), prefix ``lengthwise_gateway_``.

One registry per app (not the process-global default), as in the sidecar, so several gateways can live
in one process (tests, embedders).
"""

from __future__ import annotations

from collections import Counter as CounterType
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PREDICT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 1.0)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "lengthwise_gateway_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "end-to-end latency (to the last byte) by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "time to the first generated token of streamed requests", ["endpoint"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.predictions = Counter(p + "predictions", "requests by prediction source (sidecar, fallback)", ["source"], registry=r)
        self.prediction_fallbacks = Counter(p + "prediction_fallbacks", "requests that ran on the fallback length, by reason",
                                            ["reason"], registry=r)
        self.prediction_fast_tier = Counter(p + "prediction_fast_tier", "sidecar predictions its fast tier answered "
                                            "(the sidecar's encoder would have answered after the prediction timeout)",
                                            registry=r)
        self.distributions_dropped = Counter(p + "prediction_distributions_dropped", "sidecar predictions sent to the engine "
                                             "without their bucket distribution, by reason (absent, invalid)", ["reason"],
                                             registry=r)
        self.predictor_latency = Histogram(p + "predictor_latency_seconds", "sidecar /v1/predict round trips (timeouts included)",
                                           buckets=PREDICT_BUCKETS, registry=r)
        self.refinements = Counter(p + "refinements", "refined predictions of running requests by outcome: delivered, "
                                   "late (the sidecar answered after refine_timeout_ms), busy (refine_max_inflight in "
                                   "flight, or this request's last one), refused (the sidecar's 4xx: a version trained "
                                   "on prompts alone), sidecar_error, gone (the request had ended in its engine), "
                                   "engine_error, no_port (no plug-in port known for the engine)", ["outcome"], registry=r)
        self.refinement_delay = Histogram(p + "refinement_delay_seconds", "from an answer reaching a refinement point to "
                                          "its engine queuing the refined prediction", buckets=PREDICT_BUCKETS, registry=r)
        self.client_hints_dropped = Counter(p + "client_hints_dropped", "client vllm_xargs keys replaced by the gateway's",
                                            registry=r)
        self.engine_retries = Counter(p + "engine_retries", "requests sent again to another engine, by engine and reason",
                                      ["engine", "reason"], registry=r)
        self.stream_errors = Counter(p + "stream_errors", "streams cut off after tokens were sent (ended with an error event)",
                                     ["engine"], registry=r)
        self.engine_outstanding = Gauge(p + "engine_outstanding", "requests in flight per engine", ["engine"], registry=r)
        self.engine_bound = Gauge(p + "engine_bound", "requests in flight an engine may hold, as learnt from the SLO its "
                                  "answers meet (--engine-bound slo)", ["engine"], registry=r)
        self.engine_busy_probes = Counter(p + "engine_busy_probes", "health probes slower than --health-timeout on an "
                                          "engine whose calls were receiving bytes (busy, not hung: not taken out)",
                                          ["engine"], registry=r)
        self.engine_exits = Counter(p + "engine_exits", "engines started here whose process exited while serving",
                                    ["engine"], registry=r)
        self.engine_restarts = Counter(p + "engine_restarts", "engines started here that were started again after "
                                       "exiting while serving, and came up", ["engine"], registry=r)
        self.crash_charges = Counter(p + "engine_crash_charges", "requests whose engine died under them (each a "
                                     "suspect of that death: serving/gateway/quarantine.py)", ["engine"], registry=r)
        self.engine_healthy = Gauge(p + "engine_healthy", "1 when the engine passes its health checks", ["engine"], registry=r)
        self.output_tokens = Counter(p + "output_tokens", "generated tokens reported by the engines", registry=r)
        self.plugin_scrape_errors = Counter(p + "plugin_scrape_errors", "engines whose scheduler metrics did not answer a scrape",
                                            ["engine"], registry=r)
        self.feedback = Counter(p + "feedback", "actual-length reports to the sidecar, by outcome", ["outcome"], registry=r)
        self.placement_fallbacks = Counter(p + "placement_fallbacks", "placement decisions made by JSQ instead of the "
                                           "configured placement, by reason (no_capacity, no_report, stale)",
                                           ["reason"], registry=r)
        self.prompt_token_counts = Counter(p + "prompt_token_counts", "requests whose prompt tokens were counted, by method "
                                           "(tokenizer, estimate, token_ids)", ["method"], registry=r)
        self.load_scrape_errors = Counter(p + "engine_load_scrape_errors", "failed reads of an engine's vLLM /metrics "
                                          "(its load report)", ["engine"], registry=r)
        self.prefill_hops = Counter(p + "prefill_hops", "disaggregated prefills (--prefill-url) by outcome: ok, "
                                    "ok_no_transfer_params (a connector that finds KV by prompt), client_error, failed",
                                    ["outcome"], registry=r)
        self.prefill_latency = Histogram(p + "prefill_latency_seconds", "successful prefill hops, send to answer",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.predictor_target_mismatch = Gauge(p + "predictor_target_mismatch", "1 while the sidecar's predictor was "
                                               "made for another model than the one served (see /health predictor_target)",
                                               registry=r)
        self.model_predictor_target_mismatch = Gauge(p + "model_predictor_target_mismatch", "1 while a catalogue "
                                                     "model's predictor is not for it (see /health models[...].predictor)",
                                                     ["model"], registry=r)
        self.other_model_predictions = Counter(p + "predictions_for_other_model", "requests scheduled by a predictor made "
                                               "for another model (--allow-predictor-for-other-model)", registry=r)
        self.rejected = Counter(p + "rejected", "requests refused before any work, by reason: overload (past "
                                "--max-outstanding), key_share (a client key past --max-outstanding-per-key), "
                                "too_many_sequences (more sequences than the bound itself), slow_body (408: the body "
                                "not whole within --client-body-timeout), slow_headers, headers_too_large (a "
                                "connection closed: its request's head not whole within --client-header-timeout, or "
                                "past 64 KiB), engine_full (every engine past --max-outstanding-per-engine), "
                                "unauthorized (no or a wrong API key), too_many_n (n above --max-n), "
                                "context_length (a prompt longer than the engines' context), quarantined (a request "
                                "whose engine died while it ran on probation, or one of its kind), engine_defect (what "
                                "the engines' vLLM is known to fail on)",
                                ["reason"], registry=r)
        self.inflight = Gauge(p + "inflight_requests", "places held by requests admitted and not yet answered in full: "
                              "one per sequence on an engine (n per prompt)", registry=r)
        self.client_stalled = Counter(p + "client_stalled", "streams cut because their client took none of the answer "
                                      "for --client-stall-timeout (its engine request cancelled, its places freed)",
                                      registry=r)
        self.slo_clamped = Counter(p + "slo_header_clamped", "x-slo-* header values moved into [--slo-min-ms, "
                                   "--slo-max-ms], by header and bound (min, max)", ["header", "bound"], registry=r)
        self.slo_ignored = Counter(p + "slo_header_ignored", "requests whose x-slo-* headers were ignored: their key is "
                                   "not one of --slo-key-file's", registry=r)
        self.feedback_withheld = Counter(p + "feedback_withheld", "answers whose length was not reported to the sidecar "
                                         "because the client shaped it, by the first field that did (stop, "
                                         "min_tokens, sampling, ...)", ["reason"], registry=r)
        self.predictor_up = Gauge(p + "predictor_up", "1 while the sidecar answers (its /ready and the predictions); "
                                  "0 without --predictor-url or while it does not", registry=r)
        # per served model (a name /v1/models lists: a refused request for an unknown one is never labelled)
        self.model_requests = Counter(p + "model_requests", "answered requests by model and status code", ["model", "status"],
                                      registry=r)
        self.model_latency = Histogram(p + "model_request_latency_seconds", "end-to-end latency by model", ["model"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.model_output_tokens = Counter(p + "model_output_tokens", "generated tokens by model", ["model"], registry=r)
        self.model_deadlines = Counter(p + "model_deadlines", "answered requests by model and whether the answer was "
                                       "complete by its deadline (met, missed): each model's SLO attainment, and summed "
                                       "over models the whole endpoint's", ["model", "outcome"], registry=r)
        self.engine_others = Gauge(p + "engine_other_requests", "requests on the engine that this gateway did not send "
                                   "(its last load report)", ["engine"], registry=r)

    def watch_placement(self, stats: Callable[[], dict[str, CounterType[str]]]) -> None:
        """Export the placement core's counters (placed, would_open, rejected_*, ...) as
        ``lengthwise_gateway_placement_events_total{placement, event}``, read at each scrape."""
        self.registry.register(_PlacementStats(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PlacementStats(Collector):
    def __init__(self, stats: Callable[[], dict[str, CounterType[str]]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        fam = CounterMetricFamily("lengthwise_gateway_placement_events", "placement decisions and what the placement "
                                  "saw (placed, would_open, rejected_<constraint>, no_room, no_instance), by placement "
                                  "(the configured one, and jsq when it stood in)", labels=["placement", "event"])
        for name, counts in self.stats().items():
            for event, n in sorted(counts.items()):
                fam.add_metric([name, event], n)
        yield fam
