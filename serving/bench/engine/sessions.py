"""Engines one after another, each kept for every job it can run: the bench's layout on one GPU.

On two CPU cores the bench runs a stock engine and a plug-in engine side by side, each on its own core, so that the
machine's noise hits both alike. A GPU cannot be split that way (two 8B engines profiling memory at once disturb
each other), and an 8B engine takes longer to start than a replay takes to run. So here one engine process
(``python -m serving.bench.engine.replay --serve``) is started per engine key (the engine's arguments, the scheduler
and the plug-in's settings) and replays, one after another, every job with that key; only one engine replays at any
moment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from serving.bench.engine.replay import DONE_MARK, engine_key


class SessionError(RuntimeError):
    """An engine process died or answered out of turn; the message carries the tail of its log."""


class EngineSession:
    """One ``replay --serve`` process: started on the first job, fed jobs of its key one at a time."""

    def __init__(self, key: str, work: Path, name: str, console: Console, env: dict[str, str] | None = None) -> None:
        self.key, self.work, self.name, self.console = key, work, name, console
        self.log_path = work / f"{name}.log"
        self._log: IO[str] = self.log_path.open("w")
        self._done: list[str] = []
        self._cv = threading.Condition()
        self._born = time.monotonic()
        self.startup_s: float | None = None  # the first job's time less its replay: the engine's start, measured
        self.proc = subprocess.Popen([sys.executable, "-m", "serving.bench.engine.replay", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                     cwd=Path(__file__).resolve().parents[3])
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(DONE_MARK):
                with self._cv:
                    self._done.append(line.split(maxsplit=1)[1].strip())
                    self._cv.notify_all()
                continue
            self._log.write(line)
            self._log.flush()
            if line.startswith("  ["):
                self.console.print(line.rstrip(), highlight=False)
        with self._cv:
            self._cv.notify_all()

    def run(self, job: dict[str, Any], tag: str) -> dict[str, Any]:
        """Replay one job on this session's engine and return its output."""
        if engine_key(job) != self.key:
            raise SessionError(f"job {tag} needs another engine than session {self.name}")
        jp, op = self.work / f"{tag}.job.json", self.work / f"{tag}.out.json"
        jp.write_text(json.dumps(job))
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{jp} {op}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise SessionError(self._died(tag)) from None
        with self._cv:
            self._cv.wait_for(lambda: str(op) in self._done or self.proc.poll() is not None)
        if str(op) not in self._done:
            raise SessionError(self._died(tag))
        out = json.loads(op.read_text())
        if self.startup_s is None:
            self.startup_s = max(0.0, time.monotonic() - self._born - float(out.get("wall_s", 0.0)))
        return out

    def _died(self, tag: str) -> str:
        self.proc.wait()
        self._pump.join(timeout=5)
        self._log.flush()
        tail = "".join(self.log_path.read_text().splitlines(True)[-15:])
        return f"engine {self.name} stopped during job {tag} (exit {self.proc.returncode}); log {self.log_path}:\n{tail}"

    def close(self) -> None:
        """Let the engine process end (it exits at the end of its input) and free the GPU for the next engine."""
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._pump.join(timeout=5)
        self._log.close()


class Sessions:
    """At most one engine alive at a time: asking for a job of another key closes the current engine first."""

    def __init__(self, work: Path, console: Console, env: dict[str, str] | None = None) -> None:
        self.work, self.console, self.env = work, console, env
        self.current: EngineSession | None = None
        self.started = 0
        self.startups: list[float] = []  # each engine's measured start (what a plan charges a new engine)

    def run(self, job: dict[str, Any], tag: str) -> dict[str, Any]:
        key = engine_key(job)
        new = self.current is None or self.current.key != key
        if new:
            self.close()
            self.started += 1
            name = f"engine{self.started}-{job['scheduler']}"
            self.console.print(f"starting engine {name} ({job['scheduler']})")
            self.current = EngineSession(key, self.work, name, self.console, self.env)
        out = self.current.run(job, tag)
        if new:  # its first job: the start is measured
            self.startups.append(self.current.startup_s)
        return out

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
