"""Core sets for CPU engines that share a machine: parsed from vLLM's bind syntax, and applied to a whole process.

Why the whole process: on CPU, vLLM runs the model in a worker process whose compute threads
``VLLM_CPU_OMP_THREADS_BIND`` binds, while its engine core process waits for each step's output by spinning
(``sched_yield``) on shared memory. Left free, one engine's spinning engine core lands on the core another engine's
worker computes on. Pinned whole (API server or replay process, engine core, worker: children inherit the
affinity), an engine's spin yields to its own worker (docs/results/reliability.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable


def parse_cores(bind: str) -> set[int]:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value as a core set: ``"0,1"``, ``"2-5"``, ``"0-1,4"``."""
    cores: set[int] = set()
    for part in bind.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def pin_to(cores: set[int] | None, then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A ``preexec_fn``: run ``then`` (if any), then pin the child to ``cores`` (if any) before it execs."""
    def setup() -> None:
        if then is not None:
            then()
        if cores:
            os.sched_setaffinity(0, cores)
    return setup
