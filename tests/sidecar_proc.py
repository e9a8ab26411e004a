"""Start and stop a real ``predictor-sidecar`` process for the tests (no mocks: real process, real HTTP)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from serving.launch.process import free_port
from tests.conftest import HTTP, metric_values

SIDECAR = str(Path(sys.executable).parent / "predictor-sidecar")


@dataclass
class Sidecar:
    url: str
    proc: subprocess.Popen
    log: Path

    def get(self, path: str, **kw) -> httpx.Response:
        """A GET, once more on a fresh connection when a kept-alive one was reset under it (seen once in a clean-clone
        run, polling /metrics while the other lane loaded the machine); a sidecar that is down fails both."""
        try:
            return HTTP.get(self.url + path, timeout=30, **kw)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            with httpx.Client() as fresh:
                return fresh.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return HTTP.post(self.url + path, timeout=30, **kw)

    def metric(self, metric: str, /, **labels: str) -> float | None:
        """Value of the first sample on /metrics whose labels include those given (None when there is none)."""
        return next(metric_values(self.get("/metrics").text, metric, labels), None)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.log.read_text(errors="replace")


def start_sidecar(log_dir: Path, *args: str, env: dict | None = None, timeout: float = 120.0) -> Sidecar:
    """Start the sidecar on a free port and wait until /ready answers 200."""
    port = free_port()
    log = log_dir / f"sidecar-{port}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([SIDECAR, "--port", str(port), *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    sc = Sidecar(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sidecar exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if HTTP.get(sc.url + "/ready", timeout=2).status_code == 200:
                return sc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sc.stop()
    raise AssertionError(f"sidecar not ready after {timeout} s:\n{log.read_text(errors='replace')[-3000:]}")


def wait_for(cond, timeout: float = 30.0, every: float = 0.2, what: str = "condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")
