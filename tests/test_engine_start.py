"""Waiting for engines the gateway started: one whose start-up hangs is started again (new port, same list slot), one
that exits is reported at once and not started again, and the wait says where a slow start has got to.

The engines here are real processes that play an engine's start-up (a process that never answers ``/health``, one
that exits, one that serves ``/health``), so the wait and the restart are exercised in seconds, without vLLM; the
gateway's real engines go through the same code in every test that starts a fleet."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from serving.launch.engines import EngineProcess, EngineStartError, stop_engines, wait_started
from serving.launch.process import free_port

pytestmark = pytest.mark.unit

HEALTHY = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
    print("serving", flush=True)  # listening from here on
    server.serve_forever()
""")
HANGS = "import time; print('loading the model', flush=True); time.sleep(600)"


def _engine(tmp: Path, code: str, *args: str, respawn=None, name: str = "engine-0") -> EngineProcess:
    port = free_port()
    log = tmp / f"{name}.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-c", code, str(port), *args], stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)  # as the gateway starts engines: stopped by process group
    return EngineProcess(0, f"http://127.0.0.1:{port}", proc, log, name=name, respawn=respawn)


@pytest.fixture
def started():
    procs: list[EngineProcess] = []
    yield procs
    stop_engines(procs, grace_s=2)


def test_an_engine_whose_start_hangs_is_started_again_in_its_place(tmp_path, started, caplog):
    respawned = []

    def again() -> EngineProcess:
        respawned.append(_engine(tmp_path, HEALTHY))
        return respawned[-1]

    hung = _engine(tmp_path, HANGS, respawn=again)
    healthy = _engine(tmp_path, HEALTHY, name="engine-1")
    started += [hung, healthy]
    with caplog.at_level(logging.INFO, logger="serving.gateway"):
        wait_started(started, timeout_s=3, retries=1)
    assert started[0] is respawned[0] and started[1] is healthy, "the list holds the engines that are up now"
    assert httpx.get(started[0].url + "/health").status_code == 200
    assert hung.proc.wait(timeout=5) is not None, "the hung start was stopped"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "engine-0" in warned[0] and "starting it again (1 of 1 more)" in warned[0]
    assert "loading the model" in warned[0], "the warning shows where the hung start had got to"


def test_a_start_that_still_hangs_after_the_retries_fails_with_the_log_tail(tmp_path, started):
    hung = _engine(tmp_path, HANGS, respawn=lambda: _engine(tmp_path, HANGS))
    started.append(hung)
    stalled = r"(?s)engine-0 at http://127\.0\.0\.1:\d+ not healthy after 2 s.*loading the model"
    with pytest.raises(EngineStartError, match=stalled):
        wait_started(started, timeout_s=2, retries=1)
    assert started[0] is not hung, "the second start replaced the first (and is what the caller stops)"
    assert hung.proc.poll() is not None


def test_an_engine_that_exits_during_start_up_is_not_started_again(tmp_path, started):
    respawns = []
    dies = _engine(tmp_path, "import sys; print('error: unrecognized arguments: --no-such-flag'); sys.exit(2)",
                   respawn=lambda: respawns.append(1))
    started.append(dies)
    with pytest.raises(EngineStartError, match=r"(?s)engine-0 exited with status 2 during start-up.*no-such-flag"):
        wait_started(started, timeout_s=30, retries=3)
    assert respawns == [], "its reason would stop the next start the same way"


def test_the_wait_says_where_each_engine_still_starting_has_got_to(tmp_path, started, caplog, monkeypatch):
    from serving.launch import engines

    started += [_engine(tmp_path, HANGS), _engine(tmp_path, HEALTHY, name="engine-1")]
    wait_for = [p.log_path for p in started]  # both have logged their first line: one is loading, one serving
    while not all(path.read_text() for path in wait_for):
        time.sleep(0.05)
    clock = iter(range(0, 10_000, 20))  # every poll is 20 s later: one progress line per poll
    monkeypatch.setattr(engines.time, "monotonic", lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="serving.gateway"), pytest.raises(EngineStartError):
        wait_started(started, timeout_s=50, retries=0)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for engines")]
    assert notes and "1/2 healthy" in notes[-1] and "engine-0 last logged: loading the model" in notes[-1]
    assert "engine-1 last logged" not in notes[-1], "an engine that is up is not listed"


def test_cpu_engines_run_their_model_in_the_engine_core_unless_told_otherwise(monkeypatch):
    """One device, one engine core process with the model in it (vLLM's layout on one GPU); an operator's executor or
    several devices keep vLLM's own choice, and a GPU build is left alone."""
    from serving.launch.engines import one_device_env

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    one = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert one_device_env(True, []) == one == one_device_env(True, ["--distributed-executor-backend", "uni"])
    assert one_device_env(True, ["--max-model-len", "2048", "--distributed-executor-backend=uni"]) == one
    assert one_device_env(False, []) == {}
    for args in (["--distributed-executor-backend", "mp"], ["--distributed-executor-backend=ray"],
                 ["--tensor-parallel-size", "2"], ["-tp=2"], ["--pipeline-parallel-size", "2"], ["-dp", "2"]):
        assert one_device_env(True, args) == {}, args
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # the operator's own choice, for every engine
    assert one_device_env(True, []) == {}
