"""Step profiling inside a vLLM engine: what each step computed and how long it took.

The simulator's fitted latency model (``fitted:PATH.csv``, :class:`serving.perf.latency.FittedLatency`)
is calibrated from exactly these rows, and the engine benchmark counts preemptions with it for stock
vLLM, whose scheduler does not count them itself. Recording only observes: no decision changes.

Load ``serving.engine.profile.ProfiledScheduler`` (stock vLLM V1 scheduling, recorded) or
``serving.engine.profile.ProfiledLengthwiseScheduler`` (the plug-in, recorded) as ``scheduler_cls``.
Rows are kept in memory (``step_rows()``); ``$LENGTHWISE_PROFILE_CSV`` also writes them out at exit.

A row's ``step_s`` runs from ``schedule()`` (or, when the step was scheduled while the one before it still ran,
from the end of that one) to the end of ``update_from_output()``: the scheduler, the forward pass and sampling.
``start_s`` lets a caller add the engine loop's own gap between steps. Under async scheduling (vLLM's default on
CUDA) the engine schedules step k+1 before step k's output is back, so the recorder keeps scheduled steps in order
and charges each only for the time after its predecessor finished: the steps' times still add up to the busy time.
"""

from __future__ import annotations

import atexit
import csv
import os
import time
from collections import Counter, deque
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

from serving.engine.scheduler import LengthwiseScheduler
from serving.perf.latency import StepShape

ENV_CSV = "LENGTHWISE_PROFILE_CSV"
COLUMNS = ("start_s", "step_s", "prefill_tokens", "decode_tokens", "kv_read_tokens", "num_seqs", "prefill_seqs",
           "sched_s")


class StepRecorder:
    """Mixin for a vLLM scheduler class: one row per executed step, and a preemption count, in all and per request."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.profile_rows: list[dict[str, float]] = []
        self.profile_preemptions = 0
        self.profile_preempted: Counter[str] = Counter()  # request id -> times preempted
        self._pending: deque[dict[str, float] | None] = deque()  # scheduled steps whose output is not back yet
        self._last_done = 0.0
        path = os.environ.get(ENV_CSV)
        if path:
            atexit.register(self.write_profile, path)

    def schedule(self, *args: Any, **kwargs: Any) -> SchedulerOutput:
        t0 = time.perf_counter()
        out = super().schedule(*args, **kwargs)
        t1 = time.perf_counter()
        chunks, decodes = [], []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:
                continue
            before = req.num_computed_tokens - n  # schedule() has already advanced it by n
            if n == 1 and before >= req.num_prompt_tokens:
                decodes.append(before)
            else:
                chunks.append((before, n))
        shape = StepShape.of(chunks, decodes)  # the simulator's own definition of what a step computes
        self._pending.append({"start_s": t0, "prefill_tokens": shape.prefill_tokens, "decode_tokens": shape.decode_tokens,
                              "kv_read_tokens": shape.kv_read_tokens, "num_seqs": shape.num_seqs,
                              "prefill_seqs": len(chunks), "sched_s": t1 - t0} if shape.num_seqs else None)
        return out

    def update_from_output(self, *args: Any, **kwargs: Any):
        res = super().update_from_output(*args, **kwargs)
        done = time.perf_counter()
        row = self._pending.popleft() if self._pending else None
        if row is not None:
            row["start_s"] = max(row["start_s"], self._last_done)  # scheduled while the step before ran (async)
            row["step_s"] = done - row["start_s"]
            self.profile_rows.append(row)
        self._last_done = done
        return res

    def _preempt_request(self, *args: Any, **kwargs: Any) -> None:
        self.profile_preemptions += 1
        request = args[0] if args else kwargs.get("request")
        if request is not None:
            self.profile_preempted[request.request_id] += 1
        return super()._preempt_request(*args, **kwargs)

    def step_rows(self) -> list[dict[str, float]]:
        return list(self.profile_rows)

    def write_profile(self, path: str) -> None:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(self.profile_rows)


class ProfiledScheduler(StepRecorder, Scheduler):
    """Stock vLLM V1 scheduling, step by step recorded."""


class ProfiledAsyncScheduler(StepRecorder, AsyncScheduler):
    """Stock vLLM V1 scheduling under async scheduling (vLLM's own choice on CUDA), step by step recorded."""


class ProfiledLengthwiseScheduler(StepRecorder, LengthwiseScheduler):
    """The lengthwise plug-in, step by step recorded."""


__all__ = ["COLUMNS", "ProfiledAsyncScheduler", "ProfiledLengthwiseScheduler", "ProfiledScheduler", "StepRecorder"]
