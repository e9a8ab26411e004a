"""The rate the served stack sustains, measured through its gateway rather than simulated.

Why: the calibrated simulator's saturation rate R (``bench fleet``) is fitted on a burst replayed inside the engine
processes, so it leaves out what the HTTP path costs: each engine's API server, the gateway, the sidecar and the
client, which on a small machine share the engines' cores. Measured on two cores, the simulator put R at 5.2 req/s
where the stack behind its gateway met the SLO for 7% of requests at half that rate. A load bench that offers
multiples of such an R measures a backlog, not the claim it is after. So the load benches find R on the path they
load: the same trace at a ladder of rates through the same gateway, from the simulator's R down by a fixed step,
until a probe meets the SLO for at least ``target`` of its requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from rich.console import Console

from serving.bench.fleet import replay_jobs, request_settings, wait_idle
from serving.bench.load.run import Fleet, meets_slo, trace_jobs

TARGET = 0.9     # the share of a probe's requests that must meet their SLO: the simulator's "90% point"
STEP = 0.7       # each probe offers this share of the one before
MAX_PROBES = 8   # 0.7^7 = 0.08: from a simulator 12x off, still found


def ladder(start: float, attainment_at: Callable[[float], float], target: float = TARGET, step: float = STEP,
           max_probes: int = MAX_PROBES) -> tuple[float | None, list[dict[str, float]]]:
    """The first rate of ``start``, ``start`` x step, ... whose attainment (``attainment_at(rate)``, the share of
    requests within their SLO) reaches ``target``: (that rate, every probe in order), or (None, probes) when none of
    ``max_probes`` did. The ladder's step is the answer's resolution: the true 90% point lies between the rate found
    and the one above it."""
    if not start > 0 or not 0 < step < 1 or max_probes < 1:
        raise ValueError(f"ladder needs start > 0, 0 < step < 1 and max_probes >= 1, got {start}, {step}, {max_probes}")
    probes: list[dict[str, float]] = []
    rate = start
    for _ in range(max_probes):
        att = attainment_at(rate)
        probes.append({"rate_rps": rate, "attainment": att})
        if att >= target:
            return rate, probes
        rate *= step
    return None, probes


def ladder_missed(found: dict[str, Any]) -> str:
    """The one-line reason a ladder found no rate, with every probe's attainment (what to try instead)."""
    tried = ", ".join(f"{p['rate_rps']:.3g} req/s {100 * p['attainment']:.0f}%" for p in found["probes"])
    return (f"no rate met the SLO for {100 * found['target']:.0f}% of a probe's requests ({tried}): the SLO is out of "
            "reach on this path at any rate tried; give --rate, or a pool where KV does not bind (--kv-blocks)")


def served_rate(fleet: Fleet, url: str, n: int, console: Console, headers: bool = True) -> dict[str, Any]:
    """The ladder run through the gateway at ``url`` with ``n`` requests a probe, waiting for the engines to be idle
    before each. ``headers``: send each request's simulated prediction in the header the gateway trusts (the
    overload bench's gateways), else none (the soak's gateway asks its sidecar). Returns ``rate_rps`` and the probes;
    RuntimeError (:func:`ladder_missed`'s line) when no probe met the target."""
    metrics_urls = [p.url + "/metrics" for p in fleet.procs]
    preds = [p.length for p in fleet.trace.preds] if headers else None

    def attainment(rate: float) -> float:
        wait_idle(metrics_urls)
        jobs = trace_jobs(fleet, rate, n)
        res, _ = asyncio.run(replay_jobs(jobs, request_settings(url, fleet.model, jobs, preds[:len(jobs)] if preds else None)))
        att = sum(1 for r in res if meets_slo(r, fleet.cal.slo)) / len(res)
        console.print(f"  probe {rate:.3g} req/s: {100 * att:.0f}% of {len(res)} requests within the SLO")
        return att

    console.print(f"[bold]measuring R through the gateway[/]: from the simulator's {fleet.rate:.3g} req/s down by x{STEP:g} "
                  f"until {100 * TARGET:.0f}% of {n} requests meet the SLO")
    rate, probes = ladder(fleet.rate, attainment)
    wait_idle(metrics_urls)
    found = {"rate_rps": rate, "probes": probes, "probe_requests": n, "target": TARGET, "step": STEP,
             "simulated_rate_rps": fleet.rate}
    if rate is None:
        raise RuntimeError(ladder_missed(found))
    return found
