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

    def again(why: str) -> EngineProcess:
        assert why == "not healthy 3 s after its start"
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
    hung = _engine(tmp_path, HANGS, respawn=lambda why: _engine(tmp_path, HANGS))
    started.append(hung)
    stalled = r"(?s)engine-0 at http://127\.0\.0\.1:\d+ not healthy after 2 s.*loading the model"
    with pytest.raises(EngineStartError, match=stalled):
        wait_started(started, timeout_s=2, retries=1)
    assert started[0] is not hung, "the second start replaced the first (and is what the caller stops)"
    assert hung.proc.poll() is not None


def test_an_engine_that_exits_during_start_up_is_not_started_again(tmp_path, started):
    respawns = []
    dies = _engine(tmp_path, "import sys; print('error: unrecognized arguments: --no-such-flag'); sys.exit(2)",
                   respawn=lambda why: respawns.append(1))
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


# --- engines that die while serving (serving.launch.supervise) ------------------------------------------------------
def _serving(tmp: Path, starts: list[EngineProcess], code: str = HEALTHY):
    """A respawn that starts ``code`` on a new port, its log continued, and records each start in ``starts``."""
    def again(why: str) -> EngineProcess:
        with open(tmp / "engine-0.log", "ab") as f:
            f.write(f"--- started again: {why} ---\n".encode())
        starts.append(_engine(tmp, code, respawn=again))
        return starts[-1]
    return again


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health").status_code == 200
    except httpx.HTTPError:
        return False


def _wait(cond, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_an_engine_killed_while_serving_is_started_again_on_new_ports_with_its_log_continued(tmp_path, started):
    from serving.launch.supervise import EngineSupervisor, RestartBudget

    starts: list[EngineProcess] = []
    first = _engine(tmp_path, HEALTHY, respawn=_serving(tmp_path, starts))
    started.append(first)
    seen: list[tuple] = []
    sup = EngineSupervisor(started, RestartBudget(max_restarts=3, backoff_s=0.1),
                           on_exit=lambda p, rc: seen.append(("exit", p.name, rc)),
                           on_back=lambda old, new: seen.append(("back", old.url, new.url))).start()
    try:
        _wait(lambda: _up(first.url))
        first.proc.kill()
        _wait(lambda: len(seen) == 2)
    finally:
        sup.stop()
    new = starts[0]
    assert seen == [("exit", "engine-0", -9), ("back", first.url, new.url)] and new.url != first.url
    assert started == [new], "the caller's list holds the running engine: stopping it stops the new process"
    assert _up(new.url)
    assert "--- started again: exited with status -9 while serving ---" in first.log_path.read_text()
    assert sup.restarts == {"engine-0": 1} and sup.exits == {"engine-0": [-9]} and sup.given_up() == {}


def test_an_engine_that_keeps_dying_is_left_down_past_its_restart_budget_with_a_back_off(tmp_path, started):
    from serving.launch.supervise import EngineSupervisor, RestartBudget

    # serves /health for a second, then exits with status 3: every start comes up, then dies again
    exit_later = "import os, threading; threading.Timer(1.0, lambda: os._exit(3)).start()\n"
    dies = HEALTHY.replace("server.serve_forever()", exit_later + "server.serve_forever()")
    starts: list[EngineProcess] = []
    exits: list[float] = []
    backs: list[float] = []

    def again(why: str) -> EngineProcess:
        starts.append(_engine(tmp_path, dies, respawn=again))
        return starts[-1]

    started.append(_engine(tmp_path, dies, respawn=again))
    gave_up: list[str] = []
    sup = EngineSupervisor(started, RestartBudget(max_restarts=2, window_s=60, backoff_s=0.3),
                           on_exit=lambda p, rc: exits.append(time.monotonic()),
                           on_back=lambda old, new: backs.append(time.monotonic()),
                           on_give_up=lambda p, why: gave_up.append(why)).start()
    try:
        _wait(lambda: gave_up, timeout=30)
    finally:
        sup.stop()
    assert len(starts) == 2 and len(backs) == 2 and len(exits) == 3, "two restarts, then the budget (2 in 60 s) is spent"
    assert backs[0] - exits[0] >= 0.3 and backs[1] - exits[1] >= 0.6, "the back-off doubles"
    assert "exited 3 times within 60 s (the restart budget is 2); not started again" in gave_up[0]
    assert sup.given_up() == {"engine-0": gave_up[0]} and sup.exits["engine-0"] == [3, 3, 3]
    assert sup.restarts == {"engine-0": 2}


def test_stopping_the_supervisor_first_lets_the_command_stop_its_engines_for_good(tmp_path, started):
    from serving.launch.supervise import EngineSupervisor, RestartBudget

    starts: list[EngineProcess] = []
    first = _engine(tmp_path, HEALTHY, respawn=_serving(tmp_path, starts))
    started.append(first)
    sup = EngineSupervisor(started, RestartBudget(backoff_s=0.1)).start()
    sup.stop()
    stop_engines(started, grace_s=2)
    time.sleep(0.6)
    assert starts == [] and not first.alive
