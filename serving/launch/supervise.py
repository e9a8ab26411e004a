"""Engines that die while serving are started again by the process that started them, within a budget.

Why here, beside the launcher: ``lengthwise serve``, ``lengthwise demo`` and the benches start engines themselves and
until now only watched them during start-up (:func:`~serving.launch.engines.wait_started`); an engine whose process
exited later (its engine core crashed on a request, the kernel's OOM killer, a SIGKILL) stayed dead until someone
restarted the whole command, and every request then got 503. Ray Serve does this for its own replicas (their health
check fails and Ray replaces them); this is the same for the engines a command starts as processes.

One watcher thread per command polls each engine's process. When one has exited and the command is not stopping it:

1. ``on_exit(engine, returncode)`` is called at once (the gateway takes it out of placement and fails or retries what
   it held);
2. after a back-off (``backoff_s`` doubling with each restart still in the window, at most ``max_backoff_s``) it is
   started again through its ``respawn``: new ports, the same log continued under a line that says why;
3. once it answers ``/health``, ``on_back(old, new)`` is called (the gateway moves its engine to the new URL and
   probes it in), and the new process replaces the old one in the caller's list, so stopping that list stops it.

A budget bounds the loop a request that crashes the engine every time could drive: at most ``max_restarts`` starts in
any ``window_s``. Past it, or when a start fails (the process exits again during start-up, or is not healthy within
``start_timeout_s``), the engine is left down and ``on_give_up(engine, why)`` says why.

The benches that start engines (:func:`supervised`) read the list again before each arm, so an arm after a restart
runs on the engine that is up, and record the restarts each arm saw: an arm an engine died in is marked, not hidden.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import httpx

from serving.launch.engines import EngineProcess, stop_engines
from serving.launch.process import killpg

log = logging.getLogger("serving.gateway")


@dataclass(frozen=True)
class RestartBudget:
    """How often an engine is started again: at most ``max_restarts`` in any ``window_s``, each after a back-off."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    start_timeout_s: float = 300.0


@dataclass
class _Watched:
    index: int  # its place in the caller's list
    starts: deque[float] = field(default_factory=deque)  # time.monotonic() of each restart within the window
    given_up: str | None = None


class EngineSupervisor:
    """Watches ``procs`` (the caller's list, updated in place) and starts again those that exit; see the module docstring.

    Callbacks run on the watcher thread: a caller with an event loop hops onto it (``loop.call_soon_threadsafe``).
    :meth:`stop` before the caller stops the engines, or an engine it stops would be started again.
    """

    def __init__(self, procs: list[EngineProcess], budget: RestartBudget,
                 on_exit: Callable[[EngineProcess, int | None], None] | None = None,
                 on_back: Callable[[EngineProcess, EngineProcess], None] | None = None,
                 on_give_up: Callable[[EngineProcess, str], None] | None = None,
                 poll_s: float = 0.25) -> None:
        self.procs, self.budget, self.poll_s = procs, budget, poll_s
        self._on_exit, self._on_back, self._on_give_up = on_exit, on_back, on_give_up
        self._watched = [_Watched(i) for i in range(len(procs))]
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # the caller's list: replaced in place here, read by stop_engines there
        self._thread: threading.Thread | None = None
        self.restarts: dict[str, int] = {p.name: 0 for p in procs}  # per engine name, for /health and the benches
        self._stopped_why: dict[str, str] = {}  # engines stopped by :meth:`stop_dead`, and why
        self.exits: dict[str, list[int | None]] = {p.name: [] for p in procs}  # each exit's status while serving

    def start(self) -> EngineSupervisor:
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop watching (an engine starting again is stopped too); the caller then stops ``procs`` as before."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def stop_dead(self, url: str, why: str) -> None:
        """Stop the engine at ``url`` whose process lives on while it cannot serve (vLLM's API server answers
        ``/health`` with 503 once its engine core died, and takes its time to exit): the watcher then starts it again,
        saying ``why``."""
        with self._lock:
            p = next((p for p in self.procs if p.url == url), None)
        if p is not None and p.alive:
            self._stopped_why[p.name] = why
            log.warning("%s: stopping it (pid %d) to start it again: %s", p.name, p.proc.pid, why)
            killpg(p.proc.pid, signal.SIGKILL)

    def given_up(self) -> dict[str, str]:
        """The engines left down, and why."""
        return {self.procs[w.index].name: w.given_up for w in self._watched if w.given_up}

    def _run(self) -> None:
        while not self._stopping.wait(self.poll_s):
            for w in self._watched:
                p = self.procs[w.index]
                if w.given_up is None and not p.alive and not self._stopping.is_set():
                    try:
                        self._restart(w, p)
                    except Exception:  # the watcher must outlive any one failure
                        log.exception("restarting %s failed unexpectedly", p.name)
                        w.given_up = "the restart failed unexpectedly (see the gateway log)"

    def _restart(self, w: _Watched, p: EngineProcess) -> None:
        rc = p.proc.returncode
        self.exits[p.name].append(rc)
        why = self._stopped_why.pop(p.name, None) or f"exited with status {rc} while serving"
        log.error("%s (pid %d) %s; last lines of %s:\n%s", p.name, p.proc.pid, why, p.log_path, p.tail(15))
        if self._on_exit is not None:
            self._on_exit(p, rc)
        b, now = self.budget, time.monotonic()
        while w.starts and now - w.starts[0] > b.window_s:
            w.starts.popleft()
        if len(w.starts) >= b.max_restarts:
            self._give_up(w, p, f"exited {len(w.starts) + 1} times within {b.window_s:g} s (the restart budget is "
                                f"{b.max_restarts}); not started again")
            return
        if p.respawn is None:
            self._give_up(w, p, "it cannot be started again (no launcher)")
            return
        pause = min(b.backoff_s * 2 ** len(w.starts), b.max_backoff_s)
        log.warning("%s: starting it again in %.1f s (restart %d of at most %d in %g s)", p.name, pause,
                    len(w.starts) + 1, b.max_restarts, b.window_s)
        if self._stopping.wait(pause):
            return
        w.starts.append(time.monotonic())
        new = p.respawn(why)
        with self._lock:
            self.procs[w.index] = new  # from now on, stopping the caller's list stops the new process
        failed = self._await_healthy(new)
        if failed is not None:
            if self._stopping.is_set():
                return
            stop_engines([new])
            self._give_up(w, new, failed)
            return
        self.restarts[p.name] += 1
        log.warning("%s is back at %s (pid %d) after %d restart(s)", new.name, new.url, new.proc.pid,
                    self.restarts[p.name])
        if self._on_back is not None:
            self._on_back(p, new)

    def _await_healthy(self, p: EngineProcess) -> str | None:
        """None once ``p`` answers ``/health``; else why not (it exited, the timeout passed, the command stops)."""
        deadline = time.monotonic() + self.budget.start_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while not self._stopping.wait(0.5):
                if not p.alive:
                    return f"it exited with status {p.proc.returncode} while starting again; last lines:\n{p.tail(10)}"
                try:
                    if client.get(p.url + "/health").status_code == 200:
                        return None
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    return f"it was not healthy {self.budget.start_timeout_s:g} s after starting again"
        return "the command is stopping"

    def _give_up(self, w: _Watched, p: EngineProcess, why: str) -> None:
        w.given_up = why
        log.error("%s stays down: %s", p.name, why)
        if self._on_give_up is not None:
            self._on_give_up(p, why)


@contextlib.contextmanager
def supervised(procs: list[EngineProcess], budget: RestartBudget | None = None) -> Iterator[EngineSupervisor]:
    """Engines a bench started, watched and started again while the block runs; stopped watching on the way out (before
    the bench stops them)."""
    sup = EngineSupervisor(procs, budget or RestartBudget()).start()
    try:
        yield sup
    finally:
        sup.stop()
