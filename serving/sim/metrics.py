"""Per-request records and the run summary, with EcoServe's metric definitions.

Three kinds of SLO, each reported beside the others (:func:`slo_kinds`, one definition for the simulator and the engine
benches, whose runs become these records too):

* JCT SLO attainment (EcoServe's): the share of requests finished within ``scale × (t_p + t_g × RL)`` of arrival
  (:func:`meets_jct`);
* TTFT+TPOT attainment (DistServe's, as ``vllm bench serve --goodput`` counts): the share with TTFT <= its target and
  TPOT (the mean gap between output tokens after the first) <= its target (:func:`meets_ttft_tpot`);
* normalized latency (SeaLLM's, after ORCA and vLLM): the mean over finished requests of end-to-end latency divided by
  output length (:func:`normalized_latency`).
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
    ttft_tpot_goodput_rps: float = float("nan")  # goodput on DistServe's per-token SLO (goodput_rps is on the JCT SLO)
    slo: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def meets_jct(r: RequestRecord) -> bool:
    """EcoServe's JCT SLO: finished within its limit of arrival (the limit from :meth:`serving.perf.slo.SLO.jct_limit`)."""
    return r.finished is not None and r.finished - r.arrival <= r.jct_limit


def meets_ttft_tpot(r: RequestRecord, slo) -> bool:
    """DistServe's per-token SLO: first token within ``slo.ttft_s`` of arrival and, past the first token, a mean time per
    output token within ``slo.tpot_s`` (a one-token answer has no TPOT to miss)."""
    if r.finished is None or r.first_token is None or r.first_token - r.arrival > slo.ttft_s:
        return False
    return r.tokens <= 1 or (r.finished - r.first_token) / (r.tokens - 1) <= slo.tpot_s


def normalized_latency(records: list[RequestRecord]) -> float:
    """SeaLLM's normalized latency: the mean of end-to-end latency over output length, over finished requests."""
    done = [r for r in records if r.finished is not None]
    return float(np.mean([(r.finished - r.arrival) / r.output_tokens for r in done])) if done else float("nan")


def slo_kinds(records: list[RequestRecord], slo) -> dict[str, float]:
    """The three SLO kinds side by side, over ``records`` (an unfinished request misses both attainments)."""
    n = len(records)
    return {"slo_attainment": sum(map(meets_jct, records)) / n if n else 0.0,
            "ttft_tpot_attainment": sum(meets_ttft_tpot(r, slo) for r in records) / n if n else 0.0,
            "normalized_latency_s": normalized_latency(records)}


def kinds_and_goodputs(records: list[RequestRecord], slo, span: float) -> dict[str, float]:
    """:func:`slo_kinds` and each attainment's goodput: requests within that SLO per second of ``span``."""
    kinds = slo_kinds(records, slo)
    return {**kinds, "goodput_rps": sum(map(meets_jct, records)) / span,
            "ttft_tpot_goodput_rps": kinds["ttft_tpot_attainment"] * len(records) / span}


def summarize(*, policy: str, records: list[RequestRecord], slo, makespan: float, steps: int, kv_utilization: float,
              kv_allocated: float, forward_size: float, batch_size: float, preemptions: int, pauses: int, hosted: int,
              sched_us_per_step: float, wall_s: float, busy_s: float) -> RunMetrics:
    done = [r for r in records if r.finished is not None]
    jct = np.array([r.finished - r.arrival for r in done])
    out = np.array([r.output_tokens for r in done], dtype=float)
    ttft = np.array([r.first_token - r.arrival for r in done])
    tbt = np.array([(r.finished - r.first_token) / (r.tokens - 1) for r in done if r.tokens > 1])
    span = max(makespan - min((r.arrival for r in records), default=0.0), 1e-9)
    kinds = kinds_and_goodputs(records, slo, span)
    n = len(records)
    return RunMetrics(
        policy=policy, requests_total=n, requests_completed=len(done),
        slo_attainment=kinds["slo_attainment"], ttft_tpot_attainment=kinds["ttft_tpot_attainment"],
        throughput_rps=len(done) / span, goodput_rps=kinds["goodput_rps"], tokens_per_s=float(out.sum()) / span,
        normalized_latency_s=kinds["normalized_latency_s"],
        jct_mean_s=float(jct.mean()) if done else float("nan"), jct_p50_s=_pct(jct, 50), jct_p90_s=_pct(jct, 90),
        jct_p99_s=_pct(jct, 99), ttft_p50_s=_pct(ttft, 50), ttft_p99_s=_pct(ttft, 99), tbt_p50_s=_pct(tbt, 50),
        tbt_p99_s=_pct(tbt, 99), kv_utilization=kv_utilization, kv_allocated=kv_allocated, forward_size=forward_size,
        batch_size=batch_size, preemptions=preemptions, pauses=pauses, hosted=hosted,
        sched_us_per_step=sched_us_per_step, steps=steps, makespan_s=makespan, wall_s=wall_s,
        sim_requests_per_s=n / wall_s if wall_s > 0 else float("inf"),
        ttft_tpot_goodput_rps=kinds["ttft_tpot_goodput_rps"],
        slo={"scale": slo.scale, "t_p_s": slo.t_p, "t_g_s": slo.t_g, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        extra={"busy_s": busy_s, **({"per_service": per_service(records, slo)} if any(r.service for r in records) else {})},
    )


def per_service(records: list[RequestRecord], slo=None) -> dict[str, dict]:
    """Each service's requests, the SLO kinds (JCT SLO attainment, normalised latency and, given ``slo``, TTFT+TPOT
    attainment: :func:`slo_kinds`) and JCT p99 (SeaLLM reports them per service): a policy that serves one service well
    by starving another shows here, not in the totals."""
    out = {}
    for name in sorted({r.service for r in records}):
        mine = [r for r in records if r.service == name]
        done = [r for r in mine if r.finished is not None]
        jct = np.array([r.finished - r.arrival for r in done])
        kinds = slo_kinds(mine, slo) if slo is not None else {"slo_attainment": sum(map(meets_jct, mine)) / len(mine),
                                                                "normalized_latency_s": normalized_latency(mine)}
        out[name] = {"requests": len(mine), "completed": len(done), **kinds, "jct_p99_s": _pct(jct, 99),
                     "mean_output_tokens": float(np.mean([r.output_tokens for r in mine]))}
    return out
