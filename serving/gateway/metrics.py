"""Prometheus metrics of the gateway (``GET /metrics``), prefix ``lengthwise_gateway_``.

One registry per app (not the process-global default), as in the sidecar, so several gateways can live
in one process (tests, embedders).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

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
        self.predictor_latency = Histogram(p + "predictor_latency_seconds", "sidecar /v1/predict round trips (timeouts included)",
                                           buckets=PREDICT_BUCKETS, registry=r)
        self.client_hints_dropped = Counter(p + "client_hints_dropped", "client vllm_xargs keys replaced by the gateway's",
                                            registry=r)
        self.engine_retries = Counter(p + "engine_retries", "requests sent again to another engine, by engine and reason",
                                      ["engine", "reason"], registry=r)
        self.stream_errors = Counter(p + "stream_errors", "streams cut off after tokens were sent (ended with an error event)",
                                     ["engine"], registry=r)
        self.engine_outstanding = Gauge(p + "engine_outstanding", "requests in flight per engine", ["engine"], registry=r)
        self.engine_healthy = Gauge(p + "engine_healthy", "1 when the engine passes its health checks", ["engine"], registry=r)
        self.output_tokens = Counter(p + "output_tokens", "generated tokens reported by the engines", registry=r)
        self.plugin_scrape_errors = Counter(p + "plugin_scrape_errors", "engines whose scheduler metrics did not answer a scrape",
                                            ["engine"], registry=r)
        self.feedback = Counter(p + "feedback", "actual-length reports to the sidecar, by outcome", ["outcome"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
