"""Arrival processes for a rate sweep: when each of a workload's requests arrives, at a given mean rate.

A spec names the process (``--arrivals``):

* ``poisson`` — exponential gaps, a Poisson process (the default);
* ``gamma:CV`` — a Gamma renewal process whose gaps have coefficient of variation CV: bursts (CV > 1, e.g. 2 to 4) or
  an evener stream (CV < 1) at the same mean rate; ``gamma:1`` is ``poisson``, draw for draw;
* ``trace-times:PATH_OR_NAME`` — a real trace's inter-arrival gaps, in the trace's order, applied to the workload's own
  requests and scaled so that the replay's mean rate is the rate asked for. Names: ``azure-code`` (the Azure 2023 code
  trace) and ``mooncake-conversation``; any other value is a trace file (Azure CSV or Mooncake JSONL), absolute or
  under ``$LENGTHWISE_DATA``. A trace with fewer arrivals than the workload has requests is repeated, gap after gap.

The first request arrives at 0. ``poisson`` and ``gamma`` draw from ``numpy.random.default_rng(seed)``, so another
seed gives other arrivals; ``trace-times`` is the trace's own pattern whatever the seed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from predictor.common import data_dir
from serving.sim.engine import poisson_arrivals
from serving.sim.workload import WorkloadError, detect_format, load_workload

POISSON, GAMMA, TRACE_TIMES = "poisson", "gamma", "trace-times"
TRACES = {
    "azure-code": "traces/AzureLLMInferenceTrace_code_2023.csv",
    "mooncake-conversation": "traces/mooncake_conversation_trace.jsonl",
}
"""Short names of the traces in ``$LENGTHWISE_DATA`` whose timestamps ``trace-times:NAME`` replays."""
EXAMPLES = "poisson, gamma:3 or trace-times:azure-code"


class ArrivalSpecError(ValueError):
    """An arrival spec that cannot be used; one line saying what is accepted."""


@dataclass(frozen=True)
class Arrivals:
    """A parsed arrival spec: ``kind`` poisson, gamma (with ``cv``) or trace-times (with the ``trace`` file)."""

    spec: str
    kind: str
    cv: float = 1.0
    trace: Path | None = None

    def times(self, n: int, rate: float, seed: int = 0) -> np.ndarray:
        """``n`` arrival times (seconds, the first at 0) at a mean of ``rate`` requests per second."""
        if not rate > 0 or math.isinf(rate):
            raise ValueError(f"rate must be a positive number of requests per second, got {rate}")
        if self.kind != TRACE_TIMES:
            return poisson_arrivals(n, rate, seed, self.cv)
        if n < 1:
            return np.zeros(0)
        assert self.trace is not None
        gaps = np.resize(trace_gaps(self.trace), n - 1)  # wraps around: the trace's gaps again from its first
        mean = gaps.mean() if len(gaps) else 0.0
        if len(gaps) and not mean > 0:
            raise ArrivalSpecError(f"{self.spec}: the first {n} arrivals of {self.trace} all share one timestamp; "
                                   "no rate can be scaled from them")
        scaled = gaps / (mean * rate) if len(gaps) else gaps
        return np.concatenate([[0.0], np.cumsum(scaled)])


def parse_arrivals(spec: str) -> Arrivals:
    """``spec`` checked (a trace-times trace is read here, once, so a bad one fails before any run)."""
    text = (spec or "").strip()
    kind, sep, arg = text.partition(":")
    kind = kind.strip().lower()
    if kind == POISSON and not sep:
        return Arrivals(text, POISSON)
    if kind == GAMMA:
        try:
            cv = float(arg)
        except ValueError:
            cv = float("nan")
        if not cv > 0 or math.isinf(cv):
            raise ArrivalSpecError(f"arrivals {spec!r}: gamma:CV needs a positive coefficient of variation of the gaps, "
                                   "e.g. gamma:3 (bursty) or gamma:0.5 (even)")
        return Arrivals(text, GAMMA, cv=cv)
    if kind == TRACE_TIMES:
        path = _trace_path(arg.strip(), spec)
        trace_gaps(path)
        return Arrivals(text, TRACE_TIMES, trace=path)
    raise ArrivalSpecError(f"unknown arrivals {spec!r}; give {POISSON}, {GAMMA}:CV or {TRACE_TIMES}:PATH_OR_NAME "
                           f"(names: {', '.join(TRACES)}), e.g. {EXAMPLES}")


def arrival_times(spec: str, n: int, rate: float, seed: int = 0) -> np.ndarray:
    """``n`` arrival times at ``rate`` req/s as ``spec`` says (see the module docstring)."""
    return parse_arrivals(spec).times(n, rate, seed)


def _trace_path(arg: str, spec: str) -> Path:
    if not arg:
        raise ArrivalSpecError(f"arrivals {spec!r}: trace-times needs a trace, e.g. trace-times:azure-code "
                               f"(names: {', '.join(TRACES)}) or trace-times:PATH")
    if arg in TRACES:
        path = data_dir() / TRACES[arg]
        if not path.is_file():
            raise ArrivalSpecError(f"arrivals {spec!r}: {path} is missing; set $LENGTHWISE_DATA to the data directory")
        return path
    for path in (Path(arg).expanduser(), data_dir() / arg):
        if path.is_file():
            return path.resolve()
    raise ArrivalSpecError(f"arrivals {spec!r}: no trace file {arg!r} (here or under {data_dir()}); give a path or a "
                           f"name: {', '.join(TRACES)}")


@functools.lru_cache(maxsize=8)
def trace_gaps(path: Path) -> np.ndarray:
    """The trace's inter-arrival gaps in seconds, in order (requests sharing a timestamp spread over the tick, as the
    simulator replays a trace: :func:`serving.sim.workload.spread_ties`)."""
    try:
        kind = detect_format(path)
        if kind not in ("azure", "mooncake"):
            raise WorkloadError(f"a {kind} file has no timestamps; give an Azure CSV or a Mooncake JSONL")
        w = load_workload(path, arrival="trace")
    except WorkloadError as exc:
        raise ArrivalSpecError(f"arrivals trace-times:{path}: {exc}") from None
    if len(w) < 2 or not w.duration > 0:
        raise ArrivalSpecError(f"arrivals trace-times:{path}: needs at least two distinct timestamps, found {len(w)} "
                               "requests")
    gaps = np.diff([r.arrival for r in w.requests])
    gaps.flags.writeable = False
    return gaps
