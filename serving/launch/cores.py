"""Core sets for CPU engines that share a machine: parsed from vLLM's bind syntax, and applied to a whole process.

Why the whole process: on CPU, vLLM runs the model in a worker process whose compute threads
``VLLM_CPU_OMP_THREADS_BIND`` binds, while its engine core process waits for each step's output by spinning
(``sched_yield``) on shared memory. Left free, one engine's spinning engine core lands on the core another engine's
worker computes on. Pinned whole (API server or replay process, engine core, worker: children inherit the
affinity), an engine's spin yields to its own worker (docs/results/reliability.md).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO


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


@dataclass
class CoreClaim:
    """Cores a process holds: one locked file per core, the lock held while the file is open."""

    cores: set[int]
    files: list[IO[str]]

    def release(self) -> None:
        for f in self.files:
            f.close()


def claim_cores(per: int, lock_dir: Path | None = None) -> CoreClaim | None:
    """A free slice of ``per`` of this process's cores, held until released or the process ends; None when no slice is
    wholly free or there are fewer than ``per`` cores.

    For engines that start on their own, such as Ray Serve replicas, where no launcher hands out disjoint cores: each
    claims the first slice all of whose cores' lock files (one per core, under ``lock_dir``: default a per-user
    directory in the temporary directory) it can lock, so claims of different sizes never overlap either. The kernel
    drops a dead process's locks, so a replica Ray restarts finds its predecessor's cores free.
    """
    cores = usable_cores()
    lock_dir = lock_dir or Path(tempfile.gettempdir()) / f"lengthwise-cores-{os.getuid()}"
    lock_dir.mkdir(parents=True, exist_ok=True)
    for i in range(len(cores) // per if per > 0 else 0):
        claim = CoreClaim(set(cores[i * per:(i + 1) * per]), [])
        for c in sorted(claim.cores):
            f = (lock_dir / f"core-{c}.lock").open("w")
            claim.files.append(f)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                claim.release()
                break
        else:
            return claim
    return None


def pin_process(cores: set[int]) -> None:
    """Pin every thread of this process to ``cores`` (Linux sets affinity per thread); threads and processes it
    starts later inherit it."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
from predictor.common import usable_cores
