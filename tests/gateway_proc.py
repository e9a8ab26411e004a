"""Real ``lengthwise serve`` processes and a tiny dummy-weight Llama for them (no mocks: real vLLM, real HTTP)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from serving.launch.process import free_port
from tests.conftest import HTTP, metric_values

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")


def dummy_llama(model_dir: Path, tokenizer_json: Path) -> Path:
    """The product's ``micro`` dummy-weight Llama (2 layers; weights from ``--load-format dummy``) with the GPT-2
    tokenizer and a chat template: head_dim 64 and block 32 are what vLLM's CPU attention accepts
    (tests/engine_probe.py)."""
    from serving.launch.models import dummy_model

    return Path(dummy_model("micro", 2048, model_dir, tokenizer_json))


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen
    log: Path
    model: str = ""
    engines: list[str] = field(default_factory=list)  # engine URLs, in the gateway's order (engine-0, ...)
    engine_logs: list[Path] = field(default_factory=list)

    def get(self, path: str, **kw) -> httpx.Response:
        return HTTP.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return HTTP.post(self.url + path, timeout=60, **kw)

    def metric(self, metric: str, /, **labels: str) -> float:
        """Sum of the samples of ``metric`` whose labels include ``labels`` (0 when there is none)."""
        return sum(metric_values(self.get("/metrics").text, metric, labels))

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited with {self.proc.returncode}:\n{self.tail(12000)}")  # engines' tails
            try:
                r = HTTP.get(self.url + "/health", timeout=2)
                if r.status_code == 200:
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise AssertionError(f"gateway not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_gateway(log_dir: Path, *args: str, env: dict | None = None, wait: float | None = 60.0,
                  port: int | None = None) -> Gateway:
    """``lengthwise serve ARGS`` on ``port`` (default: a free one); waits for /health unless ``wait`` is None."""
    port = port or free_port()
    log = log_dir / f"gateway-{port}-{time.monotonic_ns()}.log"  # a restart on the same port keeps both logs
    with open(log, "wb") as f:
        proc = subprocess.Popen([LENGTHWISE, "serve", "--port", str(port), *args], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
    gw = Gateway(f"http://127.0.0.1:{port}", proc, log)
    if wait is not None:
        gw.wait_ready(wait)
    return gw


PLUGIN_STATS = re.compile(r"lengthwise\[(?P<policy>[\w-]+)\]: live (?P<live>\d+),"
                          r".*fallback predictions (?P<fallback>\d+)/(?P<requests>\d+)")


def plugin_stats(engine_log: Path) -> dict | None:
    """The scheduler plug-in's latest stats line in an engine log: policy, live, fallback, requests."""
    last = None
    for line in engine_log.read_text(errors="replace").splitlines():
        m = PLUGIN_STATS.search(line)
        if m:
            last = m
    if last is None:
        return None
    return {"policy": last["policy"], **{k: int(last[k]) for k in ("live", "fallback", "requests")}}


def engine_extra_args(engine_logs: list[Path], request_id: str) -> dict | None:
    """The ``extra_args`` vLLM logged for ``request_id`` (``--enable-log-requests``), as a dict."""
    import ast

    for log in engine_logs:
        for line in log.read_text(errors="replace").splitlines():
            if "Received request " in line and request_id in line:
                m = re.search(r"extra_args=(\{.*?\}|None)\), lora_request", line)
                if m:
                    return ast.literal_eval(m[1])
    return None
