"""Per-request records and the run summary, with EcoServe's metric definitions.

Normalized latency is the mean over requests of end-to-end latency divided by output length (ORCA,
vLLM, EcoServe). JCT SLO attainment counts requests finished within ``scale × (t_p + t_g × RL)`` of
arrival; TTFT/TPOT attainment counts requests meeting both per-token targets.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    rid: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    jct_limit: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    tokens: int = 0
    preemptions: int = 0
    service: str = ""

    def finish(self, now: float) -> None:
        """Last token out: every output token was emitted by now (the simulator ends a request at its true RL)."""
        self.finished = now
        self.last_token = now
        self.tokens = self.output_tokens


@dataclass
class RunMetrics:
    """One run's summary; the JSON contract of ``lengthwise simulate`` is ``to_dict()``."""

    policy: str
    requests_total: int
    requests_completed: int
    slo_attainment: float
    ttft_tpot_attainment: float
    throughput_rps: float
    goodput_rps: float
    tokens_per_s: float
    normalized_latency_s: float
    jct_mean_s: float
    jct_p50_s: float
    jct_p90_s: float
    jct_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tbt_p50_s: float
    tbt_p99_s: float
    kv_utilization: float
    kv_allocated: float
    forward_size: float
    batch_size: float
    preemptions: int
    pauses: int
    hosted: int
    sched_us_per_step: float
    steps: int
    makespan_s: float
    wall_s: float
    sim_requests_per_s: float
    slo: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def summarize(*, policy: str, records: list[RequestRecord], slo, makespan: float, steps: int, kv_utilization: float,
              kv_allocated: float, forward_size: float, batch_size: float, preemptions: int, pauses: int, hosted: int,
              sched_us_per_step: float, wall_s: float, busy_s: float) -> RunMetrics:
    done = [r for r in records if r.finished is not None]
    jct = np.array([r.finished - r.arrival for r in done])
    out = np.array([r.output_tokens for r in done], dtype=float)
    ttft = np.array([r.first_token - r.arrival for r in done])
    tbt = np.array([(r.finished - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1])
    met = sum(1 for r, j in zip(done, jct) if j <= r.jct_limit)
    per_token_ok = sum(1 for r, t in zip(done, ttft) if t <= slo.ttft_s and
                       (r.tokens <= 1 or (r.finished - r.first_token) / (r.tokens - 1) <= slo.tpot_s))
    span = max(makespan - min((r.arrival for r in records), default=0.0), 1e-9)
    n = len(records)
    return RunMetrics(
        policy=policy, requests_total=n, requests_completed=len(done),
        slo_attainment=met / n if n else 0.0, ttft_tpot_attainment=per_token_ok / n if n else 0.0,
        throughput_rps=len(done) / span, goodput_rps=met / span, tokens_per_s=float(out.sum()) / span,
        normalized_latency_s=float(np.mean(jct / out)) if done else float("nan"),
        jct_mean_s=float(jct.mean()) if done else float("nan"), jct_p50_s=_pct(jct, 50), jct_p90_s=_pct(jct, 90),
        jct_p99_s=_pct(jct, 99), ttft_p50_s=_pct(ttft, 50), ttft_p99_s=_pct(ttft, 99), tbt_p50_s=_pct(tbt, 50),
        tbt_p99_s=_pct(tbt, 99), kv_utilization=kv_utilization, kv_allocated=kv_allocated, forward_size=forward_size,
        batch_size=batch_size, preemptions=preemptions, pauses=pauses, hosted=hosted,
        sched_us_per_step=sched_us_per_step, steps=steps, makespan_s=makespan, wall_s=wall_s,
        sim_requests_per_s=n / wall_s if wall_s > 0 else float("inf"),
        slo={"scale": slo.scale, "t_p_s": slo.t_p, "t_g_s": slo.t_g, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        extra={"busy_s": busy_s, **({"per_service": per_service(records)} if any(r.service for r in records) else {})},
    )


def per_service(records: list[RequestRecord]) -> dict[str, dict]:
    """Each service's requests, JCT SLO attainment, normalised latency and JCT p99 (SeaLLM reports them per service):
    a policy that serves one service well by starving another shows here, not in the totals."""
    out = {}
    for name in sorted({r.service for r in records}):
        mine = [r for r in records if r.service == name]
        done = [r for r in mine if r.finished is not None]
        jct = np.array([r.finished - r.arrival for r in done])
        out[name] = {"requests": len(mine), "completed": len(done),
                     "slo_attainment": sum(1 for r, j in zip(done, jct) if j <= r.jct_limit) / len(mine),
                     "normalized_latency_s": float(np.mean(jct / np.array([r.output_tokens for r in done]))) if done
                     else float("nan"), "jct_p99_s": _pct(jct, 99),
                     "mean_output_tokens": float(np.mean([r.output_tokens for r in mine]))}
    return out
