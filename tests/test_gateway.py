"""``lengthwise serve`` end to end with real parts: two real vLLM-CPU engines (dummy-weight Llama, GPT-2 tokenizer)
running the lengthwise scheduler plug-in, started by the gateway itself; a real prediction sidecar serving a model
trained here on real ShareGPT prompts; the official ``openai`` client and ``vllm bench serve`` as clients.

The engines are the session's (tests/conftest.py: started once, the slow part); further gateways attach to them with
``--engine-url``. The test that kills an engine with SIGKILL under load runs last of the session (``last``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from serving.cli import main
from serving.gateway.settings import GatewaySettings
from serving.gateway.slo import deadline, default_slo
from serving.gateway.sse import StreamRelay
from serving.launch.process import free_port
from tests.cli_inproc import run_main
from tests.conftest import FLEET_MAX_NUM_SEQS as MAX_NUM_SEQS
from tests.conftest import HTTP, SHAREGPT
from tests.datafiles import need_data
from tests.gateway_proc import Gateway, engine_extra_args, plugin_stats, start_gateway
from tests.sidecar_proc import start_sidecar, wait_for
from tests.vllm_bench import bench_sharegpt

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(900)  # the first engine test also waits for the engines to start

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


# --- fixtures ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gateway-logs")


@pytest.fixture(scope="module")
def fleet(engine_fleet) -> Gateway:
    """The session's two engines (tests/conftest.py) and the ``lengthwise serve`` that started them: the gateway most
    tests here call; the others attach to the same engines with ``--engine-url``."""
    return engine_fleet


@pytest.fixture(scope="module")
def predictor_package(home, data, tmp_path_factory) -> Path:
    """A real length predictor, trained here on 300 ShareGPT first turns for one epoch (about 45 s on 2 cores).

    Not the session's ``trained`` model: that one costs 6-15 minutes here, more than this whole module may take.
    ``--no-register`` keeps it out of the shared registry, so other tests' versions and aliases are untouched.
    """
    from training.cli import main

    work = tmp_path_factory.mktemp("gateway-predictor")
    rc = main(["--data", str(need_data(SHAREGPT)), "--format", "sharegpt", "--first-turn-only",
               "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json")), "--max-samples", "300", "--epochs", "1",
               "--max-prompt-tokens", "32", "--batch-size", "32", "--lr", "3e-3", "--no-baselines", "--no-register",
               "--experiment", "gateway-tests", "--work-dir", str(work)])
    assert rc == 0
    return work / "package"


@pytest.fixture(scope="module")
def sidecar(predictor_package, logs):
    sc = start_sidecar(logs, "--model", str(predictor_package), "--reload-interval", "0")
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def gw_sidecar(fleet, sidecar, logs):
    """A second gateway on the same engines, predicting with the real sidecar (a generous timeout: shared CPU)."""
    gw = start_gateway(logs, *_attach(fleet), "--predictor-url", sidecar.url, "--predictor-timeout-ms", "3000")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def silent_sidecar():
    """A port that accepts connections and never answers: a hung sidecar."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture(scope="module")
def gw_hung(fleet, silent_sidecar, logs):
    gw = start_gateway(logs, *_attach(fleet), "--predictor-url", silent_sidecar, "--predictor-timeout-ms", "50")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def gw_aladdin(fleet, logs):
    """A gateway on the same engines placing by Aladdin's best fit; with --model it counts prompts with the tokenizer."""
    gw = start_gateway(logs, *_attach(fleet), "--placement", "aladdin", "--engine-max-num-seqs", str(MAX_NUM_SEQS),
                       "--model", fleet.model, "--load-interval", "1", "--health-timeout", "2")
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def gw_trusting(fleet, logs):
    """A gateway on the same engines that takes a client's x-lengthwise-pred-len."""
    gw = start_gateway(logs, *_attach(fleet), "--trust-client-predictions")
    yield gw
    gw.stop()


def _engine_state(gw: Gateway, name: str) -> dict:
    return next(e for e in gw.get("/health").json()["engines"] if e["name"] == name)


def _attach(fleet: Gateway) -> list[str]:
    return [arg for url in fleet.engines for arg in ("--engine-url", url)] + ["--health-interval", "0.5", "--engine-api-key",
                                                                             fleet.engine_key]


def _client(gw: Gateway, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)


# --- units: no engines needed ---------------------------------------------------------------------------------
def test_deadline_is_ecoserve_jct_slo_and_headers_replace_its_terms():
    s = GatewaySettings(engine_urls=["http://127.0.0.1:1"], slo_scale=3.0, t_p_s=0.1, t_g_s=0.01)
    slo = default_slo(s)
    assert deadline(100.0, 50, (None, None), slo) == pytest.approx(100.0 + slo.jct_limit(50)) == \
        pytest.approx(100 + 3 * (0.1 + 0.5))
    assert deadline(100.0, 50, (0.4, 0.02), slo) == pytest.approx(100.0 + 0.4 + 0.02 * 50)
    assert deadline(100.0, 50, (0.4, None), slo) == pytest.approx(100.0 + 0.4 + 3 * 0.01 * 50)  # a missing header keeps its term


def test_stream_relay_strips_only_the_usage_it_asked_for():
    usage = json.dumps({"choices": [], "usage": {"completion_tokens": 7}})
    tok = json.dumps({"choices": [{"index": 0, "text": "hi"}], "usage": None})
    for wants in (False, True):
        r = StreamRelay(wants)
        out = [r.relay(tok), r.relay(usage), r.relay("[DONE]")]
        assert r.completion_tokens == 7 and r.first_token_at is not None and r.done
        assert (out[1] is not None) == wants
        assert ('"usage"' in out[0].decode()) == wants
        assert out[2] == b"data: [DONE]\n\n"


# --- the command line: mistakes fail in seconds with one line, not after minutes of engine start-up -----------------
def _serve(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, **ENGINE_ENV})


CLI_ERRORS = {
    "nothing to serve": ([], "give --model to start engines, or --engine-url"),
    "unknown policy": (["--model", "MODEL", "--policy", "fifo-ish"], "unknown policy 'fifo-ish'"),
    "scheduler config not JSON": (["--model", "MODEL", "--scheduler-config", "{nope"], "not valid JSON"),
    "unknown scheduler setting": (["--model", "MODEL", "--scheduler-config", '{"oops": 1}'], "oops"),
    "engine URL without scheme": (["--engine-url", "localhost:8001"], "not an http(s) URL"),
    "model directory without config": (["--model", "/nonexistent/model"], "no config.json"),
    "unknown placement": (["--model", "MODEL", "--placement", "random"], "unknown placement"),
    "duplicate engine URL": (["--engine-url", "http://127.0.0.1:9", "--engine-url", "http://127.0.0.1:9/"], "given twice"),
    "unresolvable engine host": (["--engine-url", "http://no-such-host.invalid:8001"], "cannot resolve"),
    "unreachable engine": (["--engine-url", "http://127.0.0.1:9", "--engine-start-timeout", "1", "--port", "0"],
                           "no engine answered /health within 1 s"),
    "latency profile unreadable": (["--model", "MODEL", "--placement", "aladdin", "--latency-profile", "/nonexistent.csv"],
                                   "--latency-profile: /nonexistent.csv: cannot read"),
    "latency profile for jsq": (["--model", "MODEL", "--latency-profile", "p.csv"],
                                "aladdin, lengthwise-pack or lengthwise only"),
    "negative timeout": (["--model", "MODEL", "--predictor-timeout-ms", "-1"], "--predictor-timeout-ms"),
    "replica index past the replicas": (["--model", "MODEL", "--replicas", "2", "--replica-index", "2"],
                                        "--replica-index 2 is not one of --replicas 2"),
    "prefill engines for engines started here": (["--model", "MODEL", "--prefill-url", "http://127.0.0.1:9"],
                                                 ("--prefill-url needs the decode engines as --engine-url; "
                                                  "to start both kinds here, use --prefill-engines")),
    "prefill engines without a connector": (["--model", "MODEL", "--prefill-engines", "1"],
                                            "--prefill-engines needs a KV-transfer connector on every engine"),
    "prefill URL also a decode URL": (["--prefill-url", "http://127.0.0.1:9", "--engine-url", "http://127.0.0.1:9"],
                                      "an engine either prefills for the others or decodes"),
}


@pytest.mark.parametrize("case", list(CLI_ERRORS))
def test_cli_mistakes_exit_2_with_one_line(case, model_dir):
    args, words = CLI_ERRORS[case]
    r = run_main(main, ["serve", *[str(model_dir) if a == "MODEL" else a for a in args]], env={**os.environ, **ENGINE_ENV})
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("lengthwise serve: error:"), r.stderr
    assert words in lines[0] and "Traceback" not in r.stderr


def test_cli_busy_port_and_help():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        r = _serve("--engine-url", "http://127.0.0.1:9", "--port", str(s.getsockname()[1]), timeout=60)
    assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr, r.stderr
    h = _serve("--help", timeout=60)
    assert h.returncode == 0 and "examples:" in h.stdout and "--engine-url" in h.stdout and "x-slo-ttft-ms" in h.stdout


def test_engine_that_fails_to_start_is_reported_with_its_log(model_dir):
    r = _serve("--model", str(model_dir), "--engine-arg=--no-such-flag", "--engine-start-timeout", "150", timeout=240)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "engine-0 exited with status" in r.stderr and "--no-such-flag" in r.stderr  # vLLM's own complaint, from its log
    assert "Traceback" not in r.stderr.split("lengthwise serve: error:")[-1]


# --- the real sidecar (first: its training overlaps the engines' start-up) -------------------------------------
def test_real_sidecar_prediction_reaches_the_engine_and_feedback_returns(fleet, sidecar, gw_sidecar):
    prompt = "Write a detailed, step by step tutorial on training a neural network in PyTorch."
    want = sidecar.post("/v1/predict", json={"prompt": prompt}).json()["predictions"][0]
    client = _client(gw_sidecar)
    # max_tokens above the predicted length, so the prediction is not clamped; the stream is closed after its headers
    with client.completions.with_streaming_response.create(model=fleet.model, prompt=prompt, max_tokens=1900,
                                                           stream=True) as raw:
        dl = float(raw.headers["x-lengthwise-deadline"])
        rid, pred = raw.headers["x-lengthwise-request-id"], int(raw.headers["x-lengthwise-pred-len"])
        assert raw.headers["x-lengthwise-prediction"] == "sidecar"
    assert pred == round(want["expected_tokens"])
    xargs = wait_for(lambda: engine_extra_args(fleet.engine_logs, rid), timeout=30, what="the engine's request log")
    assert xargs["pred_len"] == pred and xargs["pred_hi"] == want["range"][1] and xargs["pred_bucket"] == want["bucket"]
    assert xargs["pred_edges"] == want["edges"] and xargs["pred_probs"] == pytest.approx(want["probs"], abs=1e-6)
    assert xargs["deadline"] == pytest.approx(dl, abs=1e-3)
    # feedback: the actual length of a completed request reaches the sidecar's online metrics (a request the client
    # did not shape: with ignore_eos, say, the gateway would withhold it; the dummy model's EOS is one id in 50,304)
    n0 = sidecar.metric("lengthwise_sidecar_feedback_total", source="served") or 0.0
    r = client.chat.completions.create(model=fleet.model, messages=[{"role": "user", "content": prompt}], max_tokens=6)
    assert r.usage.completion_tokens == 6
    wait_for(lambda: (sidecar.metric("lengthwise_sidecar_feedback_total", source="served") or 0.0) == n0 + 1, timeout=30,
             what="feedback at the sidecar")
    # the gateway counts a post as sent when the sidecar's answer is back, which can be after the sidecar counted it
    wait_for(lambda: gw_sidecar.metric("lengthwise_gateway_feedback_total", outcome="sent") == 1, timeout=30,
             what="the gateway to count its feedback post as sent")
    assert gw_sidecar.metric("lengthwise_gateway_predictions_total", source="sidecar") == 2
    assert gw_sidecar.metric("lengthwise_gateway_prediction_fallbacks_total") == 0
    assert gw_sidecar.metric("lengthwise_gateway_prediction_distributions_dropped_total") == 0
    assert gw_sidecar.metric("lengthwise_gateway_predictor_latency_seconds_count") == 2


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one engine per core needs two cores")
def test_each_cpu_engine_runs_whole_on_its_own_cores(fleet):
    """Every process of an engine (API server, engine core with the model, multiprocessing's helpers) is pinned to that
    engine's cores, and the two engines' cores are disjoint (with vLLM's own CPU layout its engine core busy-waits for a
    worker process's output: unpinned, it spun on the other engine's cores)."""
    import psutil

    engines = [p for p in psutil.Process(fleet.proc.pid).children() if "vllm.entrypoints" in " ".join(p.cmdline())]
    assert len(engines) == 2
    cores = [set(e.cpu_affinity()) for e in engines]
    assert cores[0] and cores[1] and not cores[0] & cores[1]
    assert cores[0] | cores[1] <= os.sched_getaffinity(0)
    for e, mine in zip(engines, cores):
        tree = e.children(recursive=True)
        assert len(tree) >= 2  # its engine core and multiprocessing's resource tracker
        assert all(set(p.cpu_affinity()) <= mine for p in tree), [(p.name(), p.cpu_affinity()) for p in tree]


def test_cpu_engines_run_on_the_systems_tcmalloc_where_it_is_installed(fleet):
    """Each engine's model runs in its engine core process, as on one GPU (no separate worker), and that process has
    the system's tcmalloc mapped (vLLM's CPU platform means its engines to run on it); on a system without one, the
    gateway's log says the engines run on glibc's malloc and how to install it."""
    import psutil

    from serving.launch.malloc import INSTALL_HINT, find_tcmalloc

    lib = find_tcmalloc()
    engines = [p for p in psutil.Process(fleet.proc.pid).children() if "vllm.entrypoints" in " ".join(p.cmdline())]
    trees = [e.children(recursive=True) for e in engines]
    workers = [p for tree in trees for p in tree if p.name() == "VLLM::EngineCore"]
    assert len(engines) == 2 and len(workers) == 2
    assert not any(p.name() == "VLLM::Worker" for tree in trees for p in tree)
    for w in workers:
        maps = Path(f"/proc/{w.pid}/maps").read_text()
        assert (lib is not None) == ("libtcmalloc" in maps), (lib, w.pid)
    if lib is None:
        assert INSTALL_HINT in fleet.log.read_text()


@pytest.mark.fault("the sidecar killed (SIGKILL) behind the gateway",
                   saw="answers of the length asked, on the fallback prediction (x-lengthwise-prediction: "
                       "fallback:unreachable); /health degraded, naming the predictor",
                   lost="nothing")
def test_sidecar_crash_falls_back_and_keeps_serving(fleet, sidecar, gw_sidecar):
    sidecar.proc.send_signal(signal.SIGKILL)
    sidecar.proc.wait(timeout=10)
    client = _client(gw_sidecar)
    for i, n in enumerate((5, 300)):
        raw = client.completions.with_raw_response.create(model=fleet.model, prompt=f"still there? {i}", max_tokens=n,
                                                          extra_body={"ignore_eos": True})
        assert raw.parse().usage.completion_tokens == n
        assert raw.headers["x-lengthwise-prediction"] == "fallback:unreachable"
        assert int(raw.headers["x-lengthwise-pred-len"]) == min(256, n)  # the fallback length, clamped to max_tokens
    assert gw_sidecar.metric("lengthwise_gateway_prediction_fallbacks_total", reason="unreachable") == 2
    h = gw_sidecar.get("/health")  # still serving (200), but not on the predictor: degraded, and why
    assert h.status_code == 200 and h.json()["status"] == "degraded" and "predictor" in h.json()["reasons"][0]


@pytest.mark.fault("the sidecar hung (accepts, never answers)",
                   saw="the answer, the prediction costing at most --predictor-timeout-ms (fallback:timeout)",
                   lost="nothing")
def test_hung_sidecar_costs_at_most_the_timeout(fleet, gw_hung):
    client = _client(gw_hung)
    t0 = time.perf_counter()
    raw = client.completions.with_raw_response.create(model=fleet.model, prompt="hello", max_tokens=3)
    assert raw.parse().usage.completion_tokens >= 1 and time.perf_counter() - t0 < 30
    assert raw.headers["x-lengthwise-prediction"] == "fallback:timeout"
    assert gw_hung.metric("lengthwise_gateway_prediction_fallbacks_total", reason="timeout") == 1
    # the recorded round trip of the failed prediction is the timeout (50 ms), not the sidecar's silence
    assert gw_hung.metric("lengthwise_gateway_predictor_latency_seconds_bucket", le="0.25") == 1


# --- the OpenAI API through the gateway ------------------------------------------------------------------------
def test_models_health_and_metrics(fleet):
    client = _client(fleet)
    assert [m.id for m in client.models.list()] == [fleet.model]
    h = fleet.get("/health").json()
    assert h["status"] == "ok" and h["healthy_engines"] == 2 and len(h["engines"]) == 2
    text = fleet.get("/metrics").text
    for family in ("lengthwise_gateway_requests_total", "lengthwise_gateway_request_latency_seconds",
                   "lengthwise_gateway_engine_outstanding", "lengthwise_gateway_engine_healthy"):
        assert family in text
    # the scheduler plug-ins' own counters, scraped from each engine process and labelled by engine
    from prometheus_client.parser import text_string_to_metric_families

    def plugin(name: str) -> dict[str, float]:
        fams = {f.name: f for f in text_string_to_metric_families(fleet.get("/metrics").text)}
        return {s.labels["engine"]: s.value for s in fams[name].samples} if name in fams else {}

    # Each engine gets 1 s to answer a scrape and is left out of that one if it does not (counted in
    # plugin_scrape_errors). On this 2-core machine an engine is sometimes starved that long, so the test asks
    # until one scrape carries both engines, as a Prometheus server would see them on its next scrape.
    both = {"engine-0", "engine-1"}
    before = wait_for(lambda: (f := plugin("lengthwise_scheduler_finished")) and set(f) == both and f, timeout=30,
                      what="a scrape with both engines' plug-in counters")
    wait_for(lambda: set(plugin("lengthwise_scheduler_ledger_blocks_total")) == both, timeout=30,
             what="a scrape with both engines' ledger counters")
    client.completions.create(model=fleet.model, prompt="one more", max_tokens=2)
    deadline = time.monotonic() + 30
    while sum(plugin("lengthwise_scheduler_finished").values()) < sum(before.values()) + 1:
        assert time.monotonic() < deadline, "the plug-in's finished counter did not move"
        time.sleep(0.2)


@pytest.mark.parametrize("kind,stream,usage,n", [("completions", False, False, 7), ("completions", True, False, 11),
                                                 ("completions", True, True, 13), ("chat", False, False, 9),
                                                 ("chat", True, False, 12), ("chat", True, True, 17)])
def test_exact_lengths(fleet, kind, stream, usage, n):
    client = _client(fleet)
    kw = {"model": fleet.model, "max_tokens": n, "extra_body": {"ignore_eos": True}}
    if stream:
        kw.update(stream=True, stream_options={"include_usage": True} if usage else None)
    create = client.completions.create if kind == "completions" else client.chat.completions.create
    if kind == "completions":
        out = create(prompt="Count to ten:", **kw)
    else:
        out = create(messages=[{"role": "user", "content": "Count to ten."}], **kw)
    if not stream:
        assert out.usage.completion_tokens == n and out.choices[0].finish_reason == "length"
        return
    chunks = list(out)
    if usage:  # the usage chunk the client asked for, with the exact count
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
        chunks = chunks[:-1]
    # without it: the gateway asked the engine for usage on its own behalf; the client sees none of it
    assert all(c.choices and c.usage is None for c in chunks)
    text_chunks = [c for c in chunks if (c.choices[0].text if kind == "completions" else c.choices[0].delta.content)]
    assert chunks[-1].choices[0].finish_reason == "length" and 1 <= len(text_chunks) <= n
    wait_for(lambda: fleet.metric("lengthwise_gateway_ttft_seconds_count") >= 1, timeout=30, what="a TTFT observation")


def test_hints_reach_the_engine_and_client_hints_cannot_jump_the_queue(fleet):
    client = _client(fleet)
    t0 = time.time()
    raw = client.completions.with_raw_response.create(
        model=fleet.model, prompt="Summarise the plot of Hamlet.", max_tokens=12,
        extra_headers={"x-slo-ttft-ms": "400", "x-slo-tpot-ms": "20"},
        extra_body={"ignore_eos": True, "vllm_xargs": {"pred_len": 1, "deadline": 0, "note": "kept"}})
    t1 = time.time()
    assert raw.parse().usage.completion_tokens == 12
    rid, pred, dl = (raw.headers["x-lengthwise-request-id"], int(raw.headers["x-lengthwise-pred-len"]),
                     float(raw.headers["x-lengthwise-deadline"]))
    assert raw.parse().id.endswith(rid)  # the engine's request id is ours
    assert pred == 12  # no sidecar: the fallback (256) clamped to max_tokens
    assert t0 + 0.4 + 0.02 * 12 - 1e-3 <= dl <= t1 + 0.4 + 0.02 * 12 + 1e-3
    xargs = wait_for(lambda: engine_extra_args(fleet.engine_logs, rid), timeout=30, what="the engine's request log")
    assert xargs == {"note": "kept", "pred_len": 12, "deadline": pytest.approx(dl, abs=1e-3)}
    assert fleet.metric("lengthwise_gateway_client_hints_dropped_total") == 2
    # inside the engine, the plug-in read every gateway request's prediction; a request sent to the engine directly,
    # without the gateway, is the only one it had to run on its default
    before = [plugin_stats(p) for p in fleet.engine_logs]
    time.sleep(0.3)  # the plug-in logs its counters at most every log_every_s (0.2 s)
    r = HTTP.post(fleet.engines[0] + "/v1/completions", json={"model": fleet.model, "prompt": "direct", "max_tokens": 4},
                  headers={"Authorization": f"Bearer {fleet.engine_key}"}, timeout=60)
    assert r.status_code == 200
    base = before[0]["fallback"] if before[0] else 0  # other modules' direct requests (a calibration's) came first
    after = wait_for(lambda: (s := plugin_stats(fleet.engine_logs[0])) and s["fallback"] > base and s, timeout=30,
                     what="the plug-in's stats line")
    assert after["policy"] == "lengthwise" and after["fallback"] == base + 1  # only the direct request, since before
    assert after["requests"] >= 2 and (before[0] is None or after["requests"] > before[0]["requests"])


def test_a_client_that_leaves_a_non_streamed_request_stops_its_generation(fleet):
    """A non-streamed answer is sent only when whole: a client that gives up before must not leave its engine
    generating for nobody. The gateway cancels its engine call, and vLLM aborts the request (its own log says so)."""
    gone0 = fleet.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="499")
    body = json.dumps({"model": fleet.model, "prompt": "an answer nobody waits for", "max_tokens": 1900,
                       "ignore_eos": True}).encode()
    host, port = fleet.url.removeprefix("http://").split(":")
    received0 = _received(fleet)
    # the engine cores are frozen while the client leaves, so the answer cannot be complete before it does, however
    # fast the engines run; their API servers take the request meanwhile (and /health answers: it does not ask the core)
    with _cores_frozen(fleet), socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            wait_for(lambda: sum(e["outstanding"] for e in fleet.get("/health").json()["engines"]) >= 1, timeout=30,
                     what="the request to reach an engine")
            # placed is not yet sent: the client must leave only once an engine's API server holds the request (its
            # request log says so), or there is nothing for the engine to abort (CI saw that race on a stalled machine)
            wait_for(lambda: _received(fleet) > received0, timeout=30, what="an engine's API server to log the request")
        except AssertionError as exc:
            conn.settimeout(1)
            try:
                answer = conn.recv(2000)
            except OSError as why:
                answer = repr(why)
            raise AssertionError(f"{exc}: the gateway answered {answer!r}; "
                                 f"views {fleet.get('/health').json()['engines']}") from None
    line = wait_for(lambda: next((ln for ln in fleet.log.read_text().splitlines() if "the client went away" in ln), None),
                    timeout=30, what="the gateway to notice the client leaving")
    rid = re.search(r"request (lw-\w+)", line)[1]
    wait_for(lambda: any("Aborted request" in ln and rid in ln
                         for p in fleet.engine_logs for ln in p.read_text(errors="replace").splitlines()),
             timeout=30, what=f"the engine to abort {rid}")
    assert fleet.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="499") == gone0 + 1
    wait_for(lambda: sum(e["outstanding"] for e in fleet.get("/health").json()["engines"]) == 0, timeout=30,
             what="the request to leave the gateway's view")


MALFORMED = {
    "invalid JSON": ("completions", b'{"model": "M", "prompt": "a"', 400, None, "invalid_json"),
    "not an object": ("completions", b'["a"]', 400, None, "invalid_json"),
    "empty body": ("completions", b"", 400, None, "invalid_json"),
    "missing model": ("completions", {"prompt": "a"}, 400, "model", "missing_required_parameter"),
    "model not a string": ("completions", {"model": 5, "prompt": "a"}, 400, "model", "invalid_type"),
    "unknown model": ("completions", {"model": "gpt-17", "prompt": "a"}, 404, "model", "model_not_found"),
    "missing prompt": ("completions", {"model": "M"}, 400, "prompt", "missing_required_parameter"),
    "prompt wrong type": ("completions", {"model": "M", "prompt": 5}, 400, "prompt", "invalid_type"),
    "negative max_tokens": ("completions", {"model": "M", "prompt": "a", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    "max_tokens not an int": ("completions", {"model": "M", "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens",
                              "invalid_type"),
    "max_tokens float": ("completions", {"model": "M", "prompt": "a", "max_tokens": 1.5}, 400, "max_tokens", "invalid_type"),
    "stream not a bool": ("completions", {"model": "M", "prompt": "a", "stream": "yes"}, 400, "stream", "invalid_type"),
    "n zero": ("completions", {"model": "M", "prompt": "a", "n": 0}, 400, "n", "invalid_value"),
    "vllm_xargs not an object": ("completions", {"model": "M", "prompt": "a", "vllm_xargs": [1]}, 400, "vllm_xargs",
                                 "invalid_type"),
    "missing messages": ("chat", {"model": "M"}, 400, "messages", "missing_required_parameter"),
    "messages not a list": ("chat", {"model": "M", "messages": "hi"}, 400, "messages", "invalid_type"),
    "message without role": ("chat", {"model": "M", "messages": [{"content": "hi"}]}, 400, "messages[0].role", "invalid_type"),
    "content wrong type": ("chat", {"model": "M", "messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content",
                           "invalid_type"),
    "bad SLO header": ("chat", {"model": "M", "messages": [{"role": "user", "content": "hi"}]}, 400, "x-slo-ttft-ms",
                       "invalid_header"),
    # checked by the engine, passed through: still a 4xx with an OpenAI-style body
    "temperature not a number": ("completions", {"model": "M", "prompt": "a", "temperature": "hot"}, 400, None, None),
    "max_tokens beyond the context": ("completions", {"model": "M", "prompt": "a", "max_tokens": 5000}, 400, None, None),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_requests_get_openai_style_4xx(fleet, case):
    kind, body, status, param, code = MALFORMED[case]
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    if isinstance(body, dict):
        body = json.dumps({k: (fleet.model if v == "M" and k == "model" else v) for k, v in body.items()}).encode()
    headers = {"content-type": "application/json", **({"x-slo-ttft-ms": "-5"} if case == "bad SLO header" else {})}
    r = fleet.post(path, content=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]
    assert "Traceback" not in r.text
    if code is not None:
        assert err["param"] == param and err["code"] == code and err["type"] == "invalid_request_error"


def test_unknown_routes_and_methods_and_the_openai_client_error(fleet):
    assert fleet.get("/v1/nothing-here").status_code == 404 and fleet.get("/v1/nothing-here").json()["error"]["message"]
    r = fleet.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(fleet).chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert fleet.metric("lengthwise_gateway_requests_total", status="500") == 0


def test_vllm_bench_serve_against_the_gateway(fleet, data, tmp_path):
    """vLLM's own load generator, pointed at the gateway, with real ShareGPT conversations."""
    before = fleet.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="200")
    res = bench_sharegpt(fleet.url, fleet.model, data, tmp_path)
    assert res["completed"] == 6 and res.get("failed", 0) == 0, res
    assert res["total_output_tokens"] == 6 * 24
    assert fleet.metric("lengthwise_gateway_requests_total", endpoint="/v1/completions", status="200") >= before + 6


# --- placement by Aladdin's best fit, on the engines' own metrics ---------------------------------------------------
def test_aladdin_placement_on_the_engines_metrics(fleet, gw_aladdin):
    h = gw_aladdin.get("/health").json()
    limits = h["placement_state"]["limits"]
    # KV capacity from each engine's vllm:cache_config_info: 8192 blocks of 32 tokens in VLLM_CPU_KVCACHE_SPACE=1 GiB
    assert h["placement"] == "aladdin" and [e["kv_tokens"] for e in h["engines"]] == [262_144, 262_144]
    assert limits["kv_tokens"] == 262_144 and limits["max_num_seqs"] == MAX_NUM_SEQS and limits["latency"] is None
    assert all(e["load_report_age_s"] is not None and e["load_report_age_s"] < 3 for e in h["engines"])
    loop = asyncio.new_event_loop()
    results = loop.run_until_complete(asyncio.wait_for(_burst(gw_aladdin.url, fleet.model, 6, 60), 120))
    loop.close()
    assert [r[0] for r in results] == [200] * 6 and all(r[1]["usage"]["completion_tokens"] == 60 for r in results)
    # best fit: the fuller engine until its batch (--max-num-seqs 4) is full, then the next; each full one was rejected
    assert sorted(r[3] for r in results) == ["engine-0"] * MAX_NUM_SEQS + ["engine-1"] * (6 - MAX_NUM_SEQS)
    events = {(p, e): gw_aladdin.metric("lengthwise_gateway_placement_events_total", placement=p, event=e)
              for p, e in [("aladdin", "placed"), ("aladdin", "rejected_atgt"), ("jsq", "placed")]}
    assert events == {("aladdin", "placed"): 6, ("aladdin", "rejected_atgt"): 6 - MAX_NUM_SEQS, ("jsq", "placed"): 0}
    assert gw_aladdin.metric("lengthwise_gateway_placement_fallbacks_total") == 0


def test_a_trusted_client_prediction_replaces_the_sidecars(fleet, gw_trusting):
    body = {"model": fleet.model, "prompt": "count to three", "max_tokens": 12, "ignore_eos": True}
    r = gw_trusting.post("/v1/completions", json=body, headers={"x-lengthwise-pred-len": "7"})
    assert r.status_code == 200 and r.headers["x-lengthwise-prediction"] == "client" and r.headers["x-lengthwise-pred-len"] == "7"
    r = gw_trusting.post("/v1/completions", json=body, headers={"x-lengthwise-pred-len": "4000"})
    assert r.status_code == 200 and r.headers["x-lengthwise-pred-len"] == "12"  # clamped to max_tokens
    bad = gw_trusting.post("/v1/completions", json=body, headers={"x-lengthwise-pred-len": "soon"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-lengthwise-pred-len"
    assert "number of output tokens" in bad.json()["error"]["message"]
    assert gw_trusting.post("/v1/completions", json=body).headers["x-lengthwise-prediction"] == "fallback:disabled"
    # a gateway that does not trust its clients ignores the header
    r = fleet.post("/v1/completions", json=body, headers={"x-lengthwise-pred-len": "7"})
    assert r.status_code == 200 and r.headers["x-lengthwise-prediction"] != "client"
    assert gw_trusting.metric("lengthwise_gateway_predictions_total", source="client") == 2


# --- faults: a hung engine is skipped until it recovers; an engine dies under load; the gateway stops its engines ----
async def _burst(url: str, model: str, n: int, tokens: int) -> list:
    """n concurrent completions of exactly ``tokens`` tokens: (status, body, seconds, engine) each."""
    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": model, "prompt": f"request {i}", "max_tokens": tokens, "ignore_eos": True}
        t = time.perf_counter()
        r = await c.post(url + "/v1/completions", json=body)
        return r.status_code, r.json(), time.perf_counter() - t, r.headers.get("x-lengthwise-engine")

    async with httpx.AsyncClient(timeout=180) as c:
        return await asyncio.gather(*(one(c, i) for i in range(n)))


def _burst_behind(url: str, model: str, n: int, tokens: int) -> concurrent.futures.Future:
    """``_burst`` on its own thread and event loop, running while the test goes on (a loop stopped and restarted
    around it made anyio deliver one timeout's cancellation for seconds, and the requests went out that late)."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    future = pool.submit(asyncio.run, _burst(url, model, n, tokens))
    pool.shutdown(wait=False)
    return future


def _received(fleet: Gateway) -> int:
    """How many requests the engines' API servers have logged as received (``--enable-log-requests``)."""
    return sum(ln.count("Received request ") for p in fleet.engine_logs for ln in p.read_text(errors="replace").splitlines())


def _stop_engine_cores(groups: list[int], cores: dict[int, psutil.Process]) -> None:
    """SIGSTOP the processes under each engine's API server (``groups``: their pids), its engine core and worker, until
    all are seen stopped; ``cores`` collects them (also when this fails), for a SIGCONT. Each tree is listed again
    until every process in it is stopped and its ``VLLM::EngineCore`` is among them (CI once saw an engine core run
    on through a freeze)."""

    def stopped(p: psutil.Process) -> bool:
        try:
            return p.status() == psutil.STATUS_STOPPED
        except psutil.NoSuchProcess:
            return True  # gone: nothing left to run

    def frozen() -> bool:
        for pid in groups:
            tree = psutil.Process(pid).children(recursive=True)
            if not any(p.name() == "VLLM::EngineCore" for p in tree):
                return False
            for p in tree:
                cores.setdefault(p.pid, p)
                if not stopped(p):
                    p.send_signal(signal.SIGSTOP)
        return all(stopped(p) for p in cores.values())

    wait_for(frozen, timeout=30, every=0.1, what="every engine core to stop")


@contextlib.contextmanager
def _cores_frozen(fleet: Gateway):
    """Every engine's core processes (not its API server) stopped for the block, continued after."""
    cores: dict[int, psutil.Process] = {}
    try:
        _stop_engine_cores([_engine_group(fleet, e["url"]) for e in fleet.get("/health").json()["engines"]], cores)
        yield
    finally:
        for p in cores.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGCONT)


def _quiet(fleet: Gateway, *gateways: Gateway) -> bool:
    """No request in any engine, and none in the views of these gateways."""
    from serving.gateway.engine_load import parse_report

    if any(parse_report(HTTP.get(u + "/metrics", timeout=10).text).requests for u in fleet.engines):
        return False
    return all(e["outstanding"] == 0 and e["other_requests"] == 0
               for gw in (fleet, *gateways) for e in gw.get("/health").json()["engines"])


def _diagnose(fleet: Gateway, gw: Gateway, victim: str) -> str:
    """What a gateway's placement saw, and what the engines say, for an assertion message."""
    from serving.gateway.engine_load import parse_report

    engines = {u: parse_report(HTTP.get(u + "/metrics", timeout=10).text) for u in fleet.engines}
    h, f = gw.get("/health").json(), fleet.get("/health").json()
    views = [(e["name"], e["healthy"], e["outstanding"], e["other_requests"], e["load_report_age_s"]) for e in h["engines"]]
    counters = ("lengthwise_gateway_placement_fallbacks_total", "lengthwise_gateway_engine_load_scrape_errors_total")
    return (f"victim {victim}; engines (running, waiting): {[(r.running, r.waiting) for r in engines.values()]}; "
            f"fleet views {[(e['name'], e['outstanding'], e['other_requests']) for e in f['engines']]}; "
            f"gateway views {views}; "
            f"placement stats {h['placement_state']['stats']}; "
            f"{[ln for ln in gw.get('/metrics').text.splitlines() if ln.startswith(counters)]}")


def _engine_group(fleet: Gateway, url: str) -> int:
    port = url.rsplit(":", 1)[1]
    (proc,) = [p for p in psutil.Process(fleet.proc.pid).children() if port in p.cmdline()]
    return proc.pid  # started with its own session: its pid is its process group


@pytest.mark.fault("an engine frozen (SIGSTOP) under a burst",
                   saw="every answer in full from the other engine within 60 s; the engine back in placement once resumed",
                   lost="nothing")
def test_hung_engine_is_taken_out_and_comes_back(fleet, gw_aladdin):
    """SIGSTOP: the engine's sockets stay open but nothing answers; its requests must not wait for it."""
    hung = fleet.engines[1]
    pgid = _engine_group(fleet, hung)
    retries0 = fleet.metric("lengthwise_gateway_engine_retries_total", reason="engine_down")
    os.killpg(pgid, signal.SIGSTOP)
    try:
        t0 = time.perf_counter()
        loop = asyncio.new_event_loop()
        results = loop.run_until_complete(asyncio.wait_for(_burst(fleet.url, fleet.model, 6, 20), 120))
        loop.close()
        assert [r[0] for r in results] == [200] * 6 and all(r[1]["usage"]["completion_tokens"] == 20 for r in results)
        assert time.perf_counter() - t0 < 60
        assert fleet.metric("lengthwise_gateway_engine_retries_total", reason="engine_down") >= retries0 + 1
        h = fleet.get("/health").json()
        assert [e["healthy"] for e in h["engines"]] == [True, False] and h["status"] == "ok"
        # the aladdin gateway takes it out too: its view is emptied (no jobs, no report, nobody else's load)
        hung_view = wait_for(lambda: (e := _engine_state(gw_aladdin, "engine-1")) and not e["healthy"] and e, timeout=30,
                             what="the aladdin gateway to take the hung engine out")
        assert (hung_view["outstanding"], hung_view["other_requests"], hung_view["load_report_age_s"]) == (0, 0, None)
        assert gw_aladdin.metric("lengthwise_gateway_engine_load_scrape_errors_total", engine="engine-1") >= 1
    finally:
        os.killpg(pgid, signal.SIGCONT)
    wait_for(lambda: fleet.get("/health").json()["healthy_engines"] == 2, timeout=30, what="the engine to be healthy again")
    loop = asyncio.new_event_loop()
    results = loop.run_until_complete(asyncio.wait_for(_burst(fleet.url, fleet.model, 4, 5), 120))
    assert [r[0] for r in results] == [200] * 4 and {r[3] for r in results} == {"engine-0", "engine-1"}  # back in use
    # and back in the aladdin gateway's placement, with a fresh load report: the second engine takes what the first cannot
    wait_for(lambda: _engine_state(gw_aladdin, "engine-1")["load_report_age_s"] is not None, timeout=30,
             what="the aladdin gateway to read the engine's load again")
    # and until its reports no longer show the fleet's burst above (else best fit counts it against engine-0's batch)
    wait_for(lambda: all(e["other_requests"] == 0 and e["outstanding"] == 0 for e in gw_aladdin.get("/health").json()["engines"]),
             timeout=30, what="the aladdin gateway's views to be empty")
    results = loop.run_until_complete(asyncio.wait_for(_burst(gw_aladdin.url, fleet.model, 6, 40), 120))
    loop.close()
    assert [r[0] for r in results] == [200] * 6
    assert sorted(r[3] for r in results) == ["engine-0"] * MAX_NUM_SEQS + ["engine-1"] * (6 - MAX_NUM_SEQS)


# slow (50 s: a 1,900-token stream paced at 16 ms an event); the default tier's counterpart: the hung engine above, on
# the same health probes
@pytest.mark.slow
def test_busy_engine_with_a_slow_health_keeps_its_streams(fleet, logs):
    """An engine whose /health is slower than --health-timeout while its answers stream is busy, not hung: it stays
    in placement and its streams run to the end. Once nothing flows, the same slow probes take it out."""
    from tests.slow_health_proxy import SlowHealthProxy

    # busy means bytes within 2 x (interval + timeout) = 8 s. This machine, with two engines, three gateways and the
    # tests on 2 cores, stalls every process now and then for seconds (an unrelated process measured 3.5 and 7.7 s
    # for 40 ms of work); a 2 s and then a 4 s window were not enough. The proxy passes the stream on at one event
    # per 16 ms: about 30 s for 1900 tokens, whatever the engine's speed. (At 8 ms, 15 s, a clean CI run once saw
    # a single slow probe begin in the 15 s wait: a stall that long outlasts the probes' 1 + 3 s cycle.)
    with SlowHealthProxy(fleet.engines[0], delay_s=6.0, pace_s=0.016) as proxy:
        gw = start_gateway(logs, "--engine-url", proxy.url, "--health-interval", "1", "--health-timeout", "3",
                           f"--engine-api-key={fleet.engine_key}")
        try:
            stream = _client(gw).completions.create(model=fleet.model, prompt="a busy engine", max_tokens=1900,
                                                    stream=True, extra_body={"ignore_eos": True},
                                                    stream_options={"include_usage": True})
            chunks = [next(stream)]
            proxy.slow.set()  # from now on /health answers after 6 s, while the answer streams
            # the gateway keeps reading the engine while this client waits: its probes time out, and count as busy
            try:
                wait_for(lambda: gw.metric("lengthwise_gateway_engine_busy_probes_total", engine="engine-0") >= 1,
                         timeout=30, what="a slow probe of the busy engine")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; {proxy.slow_answers} slow /health answers begun; gateway: "
                                     f"{gw.get('/health').json()}; its log:\n{gw.tail()}") from None
            chunks += list(stream)
            assert chunks[-1].usage.completion_tokens == 1900
            assert gw.metric("lengthwise_gateway_stream_errors_total") == 0
            assert gw.metric("lengthwise_gateway_engine_healthy", engine="engine-0") == 1
            # idle now: the slow probes count again, and take it out
            wait_for(lambda: gw.get("/health").json()["healthy_engines"] == 0, timeout=40,
                     what="the idle engine with a slow /health to be taken out")
            proxy.slow.clear()
            wait_for(lambda: gw.get("/health").json()["healthy_engines"] == 1, timeout=30, what="the engine to rejoin")
        finally:
            gw.stop()


def test_prompt_tokens_are_counted_with_the_models_tokenizer(fleet, gw_aladdin):
    """--model is a local directory: the gateway loads its tokenizer (in the background; this test runs a while after
    the gateway started, so it rarely waits) and counts the prompt tokens the engine counts."""
    wait_for(lambda: gw_aladdin.get("/health").json()["prompt_tokens"] == "tokenizer", timeout=120, what="the tokenizer")
    client = _client(gw_aladdin)
    raw = client.completions.with_raw_response.create(model=fleet.model, prompt="How many tokens is this prompt?", max_tokens=2)
    chat = client.chat.completions.with_raw_response.create(model=fleet.model, max_tokens=2,
                                                            messages=[{"role": "user", "content": "And this one, as chat?"}])
    for r in (raw, chat):
        assert r.headers["x-lengthwise-prompt-tokens"] == f"{r.parse().usage.prompt_tokens}:tokenizer"
    assert gw_aladdin.metric("lengthwise_gateway_prompt_token_counts_total", method="tokenizer") >= 2


@pytest.mark.fault("the gateway restarted (SIGTERM, then started again on its port)",
                   saw="its stream in flight to the end, then connection refused, then answers from the new process",
                   lost="nothing that ends within --shutdown-grace")
def test_a_restarted_gateway_finishes_what_it_holds_then_serves_again(fleet, logs):
    port = free_port()
    args = (*_attach(fleet), "--shutdown-grace", "120")
    gw = start_gateway(logs, *args, port=port)
    stream = _client(gw).completions.create(model=fleet.model, prompt="in flight at the restart", max_tokens=300,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    pieces = [next(iter(stream))]  # the request is on an engine now
    gw.proc.send_signal(signal.SIGTERM)
    pieces += list(stream)
    assert pieces[-1].usage.completion_tokens == 300  # the stream ran to its end
    assert gw.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(gw.url + "/health", timeout=5)
    again = start_gateway(logs, *args, port=port)
    try:
        assert _client(again).completions.create(model=fleet.model, prompt="back", max_tokens=5).usage.completion_tokens == 5
    finally:
        again.stop()


@pytest.mark.last  # the session's fleet loses an engine
@pytest.mark.fault("an engine killed (SIGKILL) under load, behind two gateways",
                   saw="every request that had not started streaming: its whole answer, retried on the other "
                       "engine; a stream already sending: an error event and [DONE]",
                   lost="the rest of the streams that were on the dead engine (the client holds their first part)")
# --- an engine dies under load; the gateway that started the engines stops them (last of the session) -----------------
def test_engine_killed_under_load_loses_no_request(fleet, gw_hung, gw_aladdin):
    """SIGKILL of an engine that two gateways use: the fleet's (JSQ) and one placing by Aladdin's best fit.

    The victim is the engine that holds the aladdin gateway's stream. Its engine core is frozen (SIGSTOP) before the
    bursts, so what is on it stays there until the kill however fast the engines run: the API server still answers
    /health (it does not ask the core), and the streams stay open, unfinished. How many of each gateway's requests
    are on the victim is read from that gateway's own view: neither gateway needs to have seen the other's requests
    (that view comes from vLLM's /metrics, which can lag seconds behind a stream on this CPU)."""
    client, a_client = _client(fleet), _client(gw_aladdin)
    model = fleet.model
    # from idle engines and empty views: what earlier tests left running must not count in anyone's load
    wait_for(lambda: _quiet(fleet, gw_aladdin), timeout=60, what="idle engines and empty gateway views")
    urls = {e["name"]: e["url"] for e in fleet.get("/health").json()["engines"]}
    groups = {name: _engine_group(fleet, url) for name, url in urls.items()}
    retries0 = {name: (fleet.metric("lengthwise_gateway_engine_retries_total", engine=name),
                       gw_aladdin.metric("lengthwise_gateway_engine_retries_total", engine=name)) for name in groups}
    # two streams already producing tokens: the fleet's goes where JSQ puts it; the aladdin gateway's picks the victim
    t0, marks = time.perf_counter(), {}  # when each step returned: a stream that completes below says where time went
    raw = client.completions.with_raw_response.create(model=model, prompt="a long answer", max_tokens=2000, stream=True,
                                                      extra_body={"ignore_eos": True})
    marks["fleet headers"] = time.perf_counter() - t0
    stream = raw.parse()
    first = [next(stream) for _ in range(3)]
    marks["fleet 3 events"] = time.perf_counter() - t0
    assert all(c.choices for c in first)
    a_raw = a_client.completions.with_raw_response.create(model=model, prompt="another long answer", max_tokens=2000,
                                                          stream=True, extra_body={"ignore_eos": True})
    marks["aladdin headers"] = time.perf_counter() - t0
    victim_name = a_raw.headers["x-lengthwise-engine"]
    a_stream = a_raw.parse()
    assert next(iter(a_stream)).choices
    marks["aladdin first event"] = time.perf_counter() - t0
    victim_pid = groups[victim_name]
    _stop_engine_cores([victim_pid], {})  # until the kill: nothing on it finishes before
    marks["victim frozen"] = time.perf_counter() - t0
    stream_on_victim = raw.headers["x-lengthwise-engine"] == victim_name
    survivor_name = next(e["name"] for e in fleet.get("/health").json()["engines"] if e["name"] != victim_name)
    # a burst through each gateway that fills both engines and queues inside them: best fit packs the aladdin
    # gateway's onto the engine that holds its stream, up to the batch limit; JSQ spreads the fleet's. What each
    # gateway is seen to hold on the victim is the least that must be retried elsewhere (more may follow; and a stall
    # of this machine can make the health checks take the frozen engine out before the kill: a fault path too)
    a_n, n, tokens = 6, 4 * MAX_NUM_SEQS, 400
    a_burst = _burst_behind(gw_aladdin.url, model, a_n, tokens)
    burst = _burst_behind(fleet.url, model, n, tokens)
    a_on_victim = wait_for(lambda: (k := _engine_state(gw_aladdin, victim_name)["outstanding"]) >= 2 and k, timeout=30,
                           what=f"the aladdin gateway to place part of its burst beside its stream on {victim_name}")
    on_victim = wait_for(lambda: (k := _engine_state(fleet, victim_name)["outstanding"] - stream_on_victim) >= MAX_NUM_SEQS
                         and k, timeout=30, what=f"the fleet gateway to place part of its burst on {victim_name}")
    time.sleep(0.5)  # the rest of each burst reaches its gateways
    t_kill = time.perf_counter()
    os.killpg(victim_pid, signal.SIGKILL)  # the API server, its (frozen) engine core and worker: the whole engine
    results, a_results = burst.result(timeout=240), a_burst.result(timeout=240)

    def cut(s) -> tuple[bool, int]:
        """Read a stream to its end: (True, events read) if it ended with the gateway's error event (it ran on the victim
        when it died: tokens already sent cannot be replayed), (False, events read) if it completed."""
        events = 0
        try:
            for _ in s:
                events += 1
        except openai.APIError as exc:
            assert "failed after part of the answer" in str(exc)
            return True, events
        return False, events

    a_cut, a_events = cut(a_stream)
    # a stream that completes here had its 2000 tokens before the freeze, or the engine ran on through it: the count
    # and the gateway's log tell which
    when = ", ".join(f"{k} {v:.1f} s" for k, v in marks.items())
    assert a_cut, (f"the aladdin gateway's stream on {victim_name} completed ({a_events} events after the first) instead "
                   f"of being cut by the kill (steps returned at: {when}); its log ends:\n{gw_aladdin.tail()}")
    f_cut, _ = cut(stream)
    assert f_cut == stream_on_victim  # the fleet's stream ends with the error event iff it ran on the victim
    # every request of both bursts got its whole answer, in bounded time: those on the dead engine (all but the
    # streams) were retried on the other one
    assert [r[0] for r in results] == [200] * n, [r for r in results if r[0] != 200]
    assert all(r[1]["usage"]["completion_tokens"] == tokens for r in results)
    f_retried = fleet.metric("lengthwise_gateway_engine_retries_total", engine=victim_name) - retries0[victim_name][0]
    assert f_retried >= on_victim
    assert [r[0] for r in a_results] == [200] * a_n, [r for r in a_results if r[0] != 200]
    assert all(r[1]["usage"]["completion_tokens"] == tokens for r in a_results)
    assert all(r[3] == survivor_name for r in a_results)
    a_retried = gw_aladdin.metric("lengthwise_gateway_engine_retries_total", engine=victim_name) - retries0[victim_name][1]
    assert a_retried >= a_on_victim - 1  # all but its stream
    assert time.perf_counter() - t_kill < 240
    assert fleet.metric("lengthwise_gateway_stream_errors_total") == int(f_cut)
    assert gw_aladdin.metric("lengthwise_gateway_stream_errors_total") == 1
    assert client.completions.create(model=model, prompt="after", max_tokens=5).usage.completion_tokens == 5
    # the aladdin gateway's view of the dead engine is empty; nothing it placed is left anywhere
    a_h = gw_aladdin.get("/health").json()
    assert a_h["healthy_engines"] == 1
    assert [(e["healthy"], e["outstanding"], e["other_requests"]) for e in a_h["engines"]
            if e["name"] == victim_name] == [(False, 0, 0)]
    assert sum(e["outstanding"] for e in a_h["engines"]) == 0
    KILLED.update(name=victim_name, pid=victim_pid, url=urls[victim_name], at=t_kill)


KILLED: dict = {}  # the engine the test above killed: its name, process group and URL


@pytest.mark.last
@pytest.mark.fault("an engine killed (SIGKILL) while serving: the gateway that started it",
                   saw="503 for nothing; while it starts again (on new ports, its log continued) the other engine serves, "
                       "then both do", lost="nothing more than the kill cost")
def test_an_engine_killed_while_serving_comes_back(fleet, gw_hung):
    """The engine killed above was started by the fleet's gateway: it is started again, on a new port, within its
    restart budget, its log continued; /health and the metrics say so, and it serves again. Then stopping the gateway
    stops every engine process it started, the new one too, and a gateway attached to the old addresses says 503."""
    assert KILLED, "runs after test_engine_killed_under_load_loses_no_request"
    name = KILLED["name"]
    h = wait_for(lambda: (h := fleet.get("/health").json())["healthy_engines"] == 2 and h, timeout=240,
                 what=f"{name} to be started again and healthy")
    print(f"{name} back {time.perf_counter() - KILLED['at']:.0f} s after the kill")
    back = next(e for e in h["engines"] if e["name"] == name)
    assert back["restarts"] == 1 and back["url"] != KILLED["url"] and h["engine_restarts"] == 1
    assert h["status"] == "ok", h["reasons"]
    assert fleet.metric("lengthwise_gateway_engine_exits_total", engine=name) == 1
    assert fleet.metric("lengthwise_gateway_engine_restarts_total", engine=name) == 1
    log = next(p for p in fleet.engine_logs if p.name == f"{name}.log").read_text(errors="replace")
    assert "--- started again: exited with status -9 while serving ---" in log
    served = {}
    for i in range(6):  # JSQ over two idle engines: both take requests
        r = fleet.post("/v1/completions", json={"model": fleet.model, "prompt": f"back {i}", "max_tokens": 4})
        assert r.status_code == 200, r.text
        served[r.headers["x-lengthwise-engine"]] = served.get(r.headers["x-lengthwise-engine"], 0) + 1
    assert served.get(name), f"{name} serves again: {served}"

    # stopping the gateway stops the engines it started; a gateway attached to dead engines answers 503, fast
    model = fleet.model
    survivor = [p for p in psutil.Process(fleet.proc.pid).children(recursive=True)]
    assert len(survivor) >= 4  # the API server and its engine core (and worker) of each engine
    assert fleet.stop(timeout=90) == 0
    _, alive = psutil.wait_procs(survivor, timeout=30)
    assert not alive, f"engine processes left behind: {[p.pid for p in alive]}"
    wait_for(lambda: gw_hung.get("/health").json()["healthy_engines"] == 0, timeout=30, what="the engines to be seen down")
    t0 = time.perf_counter()
    r = gw_hung.post("/v1/completions", json={"model": model, "prompt": "anyone?", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_unavailable" and time.perf_counter() - t0 < 5
    assert gw_hung.get("/health").json()["status"] == "degraded"



def test_a_non_streamed_answer_read_as_a_stream_for_refinements_is_the_one_the_engine_gives_whole(fleet, logs):
    """With ``--refine-at`` a non-streamed request is read from its engine as a stream, to be refined on its way
    (serving/gateway/assemble.py); at temperature 0 its client gets what the engine answers the request whole. Its
    refinement has no port to go to here (attached engines without --engine-metrics-url): counted, nothing else."""
    gw = start_gateway(logs, *_attach(fleet), "--predictor-url", f"http://127.0.0.1:{free_port()}",
                       "--predictor-timeout-ms", "50", "--refine-at", "4")
    try:
        for path, fields in (("/v1/completions", {"prompt": "Once upon a time"}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say something."}]})):
            body = {"model": fleet.model, "max_tokens": 24, "temperature": 0.0, **fields}
            r = gw.post(path, json=body)
            assert r.status_code == 200, r.text
            engine = fleet.engines[int(r.headers["x-lengthwise-engine"].rsplit("-", 1)[1])]
            whole = HTTP.post(engine + path, json=body, timeout=60,
                              headers={"Authorization": f"Bearer {fleet.engine_key}"}).json()
            got = r.json()
            # the same answer, field for field, but for the request's own id and time
            assert {**got, "id": None, "created": None, "choices": None} == {**whole, "id": None, "created": None,
                                                                               "choices": None}, (got, whole)
            mine, theirs = got["choices"][0], whole["choices"][0]
            if "message" in theirs:
                differ = {k for k in {*mine["message"], *theirs["message"]} if mine["message"].get(k) != theirs["message"].get(k)}
                assert not differ, {k: (mine["message"].get(k), theirs["message"].get(k)) for k in differ}
            assert {**mine, "message": None} == {**theirs, "message": None}
        assert gw.metric("lengthwise_gateway_refinements_total", outcome="no_port") == 2  # read as streams, both
        n = gw.post("/v1/completions", json={"model": fleet.model, "prompt": "x", "max_tokens": 4, "n": 2})
        assert n.status_code == 200 and len(n.json()["choices"]) == 2  # two sequences: sent as the client sent it
        assert gw.metric("lengthwise_gateway_refinements_total", outcome="no_port") == 2
    finally:
        gw.stop()
