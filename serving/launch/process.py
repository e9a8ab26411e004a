"""Child processes the commands start: a free port, a start that dies with its parent, a poll until it answers, a stop.

Why one module: the gateway's engine launcher, ``lengthwise demo``, ``bench loop``, the load benches and the sidecar
bench each start servers and must neither leave one behind (a parent that dies takes its children with it: Linux's
parent-death signal; each child in a session of its own, so its whole group can be signalled) nor wait on one that
died (the poll stops at the child's exit and says what its log said last).
"""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import psutil


class StartError(RuntimeError):
    """A child did not start (it exited, or did not answer in time), or what it was asked to start cannot be: the
    message says which, and where its log is."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: stop the children and exit."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it; a race with another process is possible, and rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux's PR_SET_PDEATHSIG), so nothing outlives it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def killpg(pid: int, sig: int) -> None:
    """Signal ``pid``'s process group (a child started in its own session leads one); gone already is fine."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_group_gone(pgid: int, timeout_s: float = 5.0) -> bool:
    """Wait until no live process is left in process group ``pgid`` (zombies aside): a SIGKILL is delivered when the
    kernel next runs the process, so a group signalled a moment ago may still list its members. False on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = False
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive = True
                    break
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def tail(log: Path | None, lines: int = 25) -> str:
    """The last ``lines`` lines of a child's log."""
    if log is None:
        return "(no log)"
    try:
        return "\n".join(log.read_text(errors="replace").rstrip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def wait_http(url: str, timeout_s: float, what: str, proc: subprocess.Popen | None = None, name: str = "the server",
              log: Path | None = None, every_s: float = 0.5) -> httpx.Response:
    """Poll ``url`` until it answers 200 and return that answer; :class:`StartError` with the log's tail when ``proc``
    exits first or ``timeout_s`` passes. ``what`` says what was awaited ("ready", "healthy", ...)."""
    t0 = time.monotonic()
    with httpx.Client(timeout=3.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise StartError(f"{name} exited with status {proc.returncode} before it was {what}"
                                 + (f"; last lines of {log}:\n{tail(log)}" if log else ""))
            try:
                r = client.get(url)
                if r.status_code == 200:
                    return r
            except httpx.HTTPError:
                pass
            if time.monotonic() - t0 > timeout_s:
                raise StartError(f"{name} at {url} was not {what} after {timeout_s:g} s"
                                 + (f"; last lines of {log}:\n{tail(log)}" if log else ""))
            time.sleep(every_s)


def cpu_cores(spec: str) -> str:
    """``all`` or the first N of the cores this process may use, as a list for ``VLLM_CPU_OMP_THREADS_BIND``."""
    cores = usable_cores()
    if spec == "all":
        return ",".join(map(str, cores))
    try:
        n = int(spec)
    except ValueError:
        raise StartError(f"--engine-cores must be 'all' or a number of cores, got {spec!r}") from None
    if not 1 <= n <= len(cores):
        raise StartError(f"--engine-cores must be between 1 and {len(cores)} here, got {n}")
    return ",".join(map(str, cores[:n]))


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path
    grace_s: float

    def tail(self, lines: int = 25) -> str:
        return tail(self.log, lines)


def wait_child(child: Child, url: str, timeout_s: float, what: str) -> httpx.Response:
    """:func:`wait_http` for one of :class:`Children`."""
    return wait_http(url, timeout_s, what, child.proc, child.name, child.log)


class Children:
    """A command's child processes. Each gets its own session (its process group id is its pid), so Ctrl-C in the
    terminal reaches only the command, which then stops them in reverse start order: SIGTERM to the group, SIGKILL
    after ``grace_s``. Use as a context manager: the exit stops them whatever happened, and SIGTERM becomes
    :class:`Interrupted` inside it."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self._old_term = None

    def __enter__(self) -> Self:
        def _term(signum, frame):
            raise Interrupted()

        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _term)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.stop_all()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)

    def start(self, name: str, cmd: list[str], log: Path, env: dict | None = None, grace_s: float = 20.0) -> Child:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as f:
            f.write(f"$ {shlex.join(cmd)}\n".encode())
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **(env or {})}, start_new_session=True,
                                    preexec_fn=die_with_parent if sys.platform == "linux" else None)  # noqa: PLW1509 - only prctl, no lock
        child = Child(name, proc, log, grace_s)
        self.children.append(child)
        return child

    def stop(self, child: Child) -> int | None:
        if child.proc.poll() is None:
            killpg(child.proc.pid, signal.SIGTERM)
            try:
                child.proc.wait(timeout=child.grace_s)
            except subprocess.TimeoutExpired:
                pass
        killpg(child.proc.pid, signal.SIGKILL)  # what is left of its group (it may have exited, its group not)
        try:
            child.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        wait_group_gone(child.proc.pid)  # its own children too, before the caller goes on
        if child in self.children:
            self.children.remove(child)
        return child.proc.returncode

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)
from predictor.common import usable_cores
