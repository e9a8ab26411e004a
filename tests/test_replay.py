"""``lengthwise replay`` against a real ``lengthwise serve`` gateway over a real vLLM-CPU engine of the session
(dummy-weight Llama, GPT-2 tokenizer, the lengthwise scheduler plug-in), with real ShareGPT prompts; and the demo's
process handling.

Every replay runs as the real command in a subprocess. Requests ask for ``ignore_eos``, so each answer has exactly its
max_tokens and the counts can be checked exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from serving.launch.process import free_port
from tests.datafiles import need_data
from tests.gateway_proc import Gateway, start_gateway

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[1]
LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")
REPORT_FIELDS = {"requests", "duration_s", "throughput", "ttft_s", "jct_s", "tpot_s", "output_tokens", "slo", "prediction",
                 "errors"}


@pytest.fixture(scope="module")
def gateway(engine_fleet, tmp_path_factory) -> Gateway:
    """``lengthwise serve`` over the first of the session's engines (tests/conftest.py), counting prompts with the
    model's tokenizer; no sidecar, so every prediction is the fallback."""
    gw = start_gateway(tmp_path_factory.mktemp("replay-logs"), "--engine-url", engine_fleet.engines[0], "--model",
                       engine_fleet.model, env={"LENGTHWISE_ENGINE_API_KEY": engine_fleet.engine_key, "LENGTHWISE_API_KEY": ""})
    gw.model, gw.engines, gw.engine_key = engine_fleet.model, engine_fleet.engines[:1], engine_fleet.engine_key
    yield gw
    gw.stop()


def replay(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([LENGTHWISE, "replay", *args], capture_output=True, text=True, timeout=timeout, check=False,
                          cwd=ROOT, env={**os.environ, "COLUMNS": "200", **(env or {})})


def _sharegpt(path: Path, prompts: list[str]) -> Path:
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "Sure. " * (5 + i)}]}
             for i, p in enumerate(prompts)]
    path.write_text(json.dumps(convs))
    return path


# --- bad input and the demo's process handling: no engine needed (these run while it starts) ------------------
BAD = {
    "unreachable url": (["--url", "http://127.0.0.1:PORT"], "cannot reach"),
    "not a url": (["--url", "localhost:8000"], "not an http(s) URL"),
    "zero rate": (["--url", "GW", "--rate", "0"], "--rate must be a positive number"),
    "negative rate": (["--url", "GW", "--rate", "-2"], "--rate must be a positive number"),
    "nan rate": (["--url", "GW", "--rate", "nan"], "--rate must be a positive number"),
    "missing workload": (["--url", "GW", "--workload", "/nonexistent/sharegpt.json"], "no such file"),
    "zero requests": (["--url", "GW", "--max-requests", "0"], "--max-requests must be a positive integer"),
    "json dir missing": (["--url", "GW", "--json", "/nonexistent/dir/r.json"], "does not exist"),
    "zero slo": (["--url", "GW", "--slo-ttft-ms", "0"], "--slo-ttft-ms must be a positive number"),
    "zero max tokens": (["--url", "GW", "--max-tokens", "0"], "--max-tokens must be a positive integer"),
    "cap and max tokens": (["--url", "GW", "--max-tokens", "64", "--max-tokens-cap", "32"], "not allowed with"),
}


def _one_line_error(r: subprocess.CompletedProcess, words: str) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("lengthwise replay: error:"), r.stderr[-2000:]
    assert words in lines[0] and "Traceback" not in r.stderr


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line(gateway, case):
    """Checked before anything is sent."""
    args, words = BAD[case]
    _one_line_error(replay(*[a.replace("GW", gateway.url).replace("PORT", str(free_port())) for a in args], timeout=120),
                    words)


def test_max_tokens_is_what_a_client_sends_not_the_traces_length(data, tmp_path):
    """--max-tokens: every request asks for the same cap, whatever the trace's (another model's) answer length, so
    the served model decides where its answer ends; --max-tokens-cap keeps the trace's lengths."""
    from serving.bench.replay import plan_jobs

    wl = _sharegpt(tmp_path / "s.json", [f"question {i}?" for i in range(6)])
    tok = need_data("tokenizers/gpt2/tokenizer.json")
    fixed = plan_jobs(wl, max_requests=6, max_tokens_cap=None, rate=None, seed=0, tokenizer=tok, max_model_len=None,
                      max_tokens=64)
    capped = plan_jobs(wl, max_requests=6, max_tokens_cap=8, rate=None, seed=0, tokenizer=tok, max_model_len=None)
    assert [j.max_tokens for j in fixed.jobs] == [64] * 6
    assert [j.max_tokens for j in capped.jobs] == [min(j.trace_output_tokens, 8) for j in capped.jobs]
    assert len({j.trace_output_tokens for j in fixed.jobs}) > 1  # the trace's lengths differ; the asks do not


def test_help_has_examples():
    r = replay("--help", timeout=60)
    assert r.returncode == 0 and "examples:" in r.stdout and "--max-tokens-cap" in r.stdout


# the demo: cheap checks only (the real demo starts SmolLM2 and takes minutes)
def _group_alive(pgid: int) -> bool:
    """Whether any live (not zombie) process is in process group ``pgid``."""
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


def test_demo_children_are_stopped_on_error_with_their_own_children(tmp_path):
    from serving.demo import Children

    with pytest.raises(RuntimeError, match="boom"), Children() as kids:
        # a child that ignores SIGTERM and has a child of its own: both must go (SIGKILL of the group after the grace)
        stubborn = kids.start("stubborn", ["sh", "-c", "trap '' TERM; sleep 300 & wait"], tmp_path / "a.log", grace_s=1)
        polite = kids.start("polite", [sys.executable, "-c", "import time; time.sleep(300)"], tmp_path / "b.log")
        time.sleep(0.5)
        assert _group_alive(stubborn.proc.pid) and polite.proc.poll() is None
        raise RuntimeError("boom")
    assert stubborn.proc.poll() is not None and polite.proc.poll() is not None
    assert not _group_alive(stubborn.proc.pid) and not _group_alive(polite.proc.pid)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_demo_children_are_stopped_on_ctrl_c_and_sigterm(tmp_path, sig):
    script = textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        from serving.demo import Children
        # SIGINT as a terminal's Ctrl-C delivers it, even where this test runs with it ignored (a background job)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with Children() as kids:
                c = kids.start("sleeper", ["sh", "-c", "sleep 300 & sleep 300"], Path({str(tmp_path / 'c.log')!r}))
                print(c.proc.pid, flush=True)
                # waits in short sleeps, as the demo's own waits do: one long sleep() can miss a signal that lands
                # between the interpreter's last signal check and the sleep call, and would then wait it out
                for _ in range(3000):
                    time.sleep(0.1)
        except KeyboardInterrupt:
            print("stopped", flush=True)
            sys.exit(130)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    child = int(p.stdout.readline())
    assert _group_alive(child)
    p.send_signal(sig)
    # the exit, then the line: neither waits for the pipes to close (a process forked meanwhile may hold them)
    assert p.wait(timeout=60) == 130
    assert p.stdout.readline().strip() == "stopped"
    assert not _group_alive(child)


def test_demo_bad_input_exits_2_with_one_line(tmp_path):
    cases = [(["--gguf", "/nonexistent/model.gguf"], "no such file"),
             (["--requests", "0"], "--requests must be at least 1"),
             (["--engine-cores", "99"], "--engine-cores must be between 1 and"),
             (["--predictor", str(tmp_path / "no-such-package")], "neither models:/")]  # (a models:/ URI: the same path)
    for args, words in cases:
        r = subprocess.run([LENGTHWISE, "demo", "--work-dir", str(tmp_path), *args], capture_output=True, text=True,
                           timeout=120, check=False, cwd=ROOT)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("lengthwise demo: error:"), (args, r.stderr[-2000:])
        assert words in lines[0], lines[0]
    h = subprocess.run([LENGTHWISE, "demo", "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert h.returncode == 0 and "examples:" in h.stdout


# --- against the gateway ---------------------------------------------------------------------------------------------
def test_replay_through_the_gateway_every_request_completes(gateway, tmp_path):
    out = tmp_path / "replay.json"
    chat0 = gateway.metric("lengthwise_gateway_requests_total", endpoint="/v1/chat/completions", status="200")
    t0 = time.time()
    r = replay("--url", gateway.url, "--max-requests", "10", "--rate", "4", "--max-tokens-cap", "32", "--ignore-eos",
               "--slo-ttft-ms", "120000", "--slo-tpot-ms", "1000", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    s, reqs = rep["summary"], rep["requests"]
    assert set(s) >= REPORT_FIELDS
    assert s["requests"] == {"sent": 10, "completed": 10, "failed": 0} and len(reqs) == 10
    # the server counted the same 10 chat completions
    assert gateway.metric("lengthwise_gateway_requests_total", endpoint="/v1/chat/completions", status="200") == chat0 + 10
    # max_tokens = min(the real ShareGPT answer length, the cap); ignore_eos: each answer has exactly that many tokens
    assert all(q["max_tokens"] == min(q["trace_output_tokens"], 32) for q in reqs)
    assert [q["output_tokens"] for q in reqs] == [q["max_tokens"] for q in reqs]
    assert s["output_tokens"]["total"] == sum(q["max_tokens"] for q in reqs) == s["output_tokens"]["asked_max_tokens"]
    assert len({q["max_tokens"] for q in reqs}) > 1  # real, different lengths from the trace
    # sent at their Poisson arrival times (not all at once), each streamed: TTFT before the end
    assert all(q["sent"] >= q["arrival"] - 0.01 and q["sent"] - q["arrival"] < 5 for q in reqs)
    assert max(q["arrival"] for q in reqs) > 0.5
    assert all(0 < q["ttft"] <= q["jct"] for q in reqs) and s["ttft_s"]["n"] == s["jct_s"]["n"] == 10
    assert 0 < s["ttft_s"]["p50"] <= s["ttft_s"]["p99"] and 0 < s["jct_s"]["p50"] <= s["jct_s"]["p99"] and s["tpot_s"]["p50"] > 0
    assert s["duration_s"] >= max(q["arrival"] for q in reqs) and s["throughput"]["requests_per_s"] > 0
    # what the gateway decided, from its headers: no sidecar here, so the fallback (256) clamped to max_tokens
    assert s["prediction"]["sources"] == {"fallback:disabled": 10}
    assert all(q["pred_len"] == q["max_tokens"] for q in reqs)
    assert s["prediction"]["mae_tokens"] == 0 and s["prediction"]["under_predicted_share"] == 0
    # deadlines: arrival + 120 s + 1 s per predicted token, in Unix seconds; all met
    assert all(t0 + 120 + q["pred_len"] < q["deadline"] < time.time() + 120 + q["pred_len"] for q in reqs)
    assert s["slo"]["with_deadline"] == 10 and s["slo"]["met"] == 10 and s["slo"]["attainment"] == 1.0
    assert rep["config"]["tokenizer"] == gateway.model  # the served model's own tokenizer (a local directory)
    # the table on stdout
    assert "requests sent / completed / failed" in r.stdout and "10 / 10 / 0" in r.stdout
    assert "100% (10 of 10)" in r.stdout and "fallback:disabled 10" in r.stdout


def test_missed_deadlines_and_failed_requests_are_counted(gateway, data, tmp_path):
    """A 1 ms SLO is missed by every request; a prompt longer than the context fails at the engine and is counted."""
    long_prompt = " ".join(["word"] * 2500)  # over 2048 tokens: vLLM refuses it
    wl = _sharegpt(tmp_path / "wl.json", ["Say hello.", long_prompt, "Name three colours."])
    out = tmp_path / "r.json"
    gpt2 = str(need_data("tokenizers/gpt2/tokenizer.json"))  # the model's own tokenizer, without importing transformers
    r = replay("--url", gateway.url, "--workload", str(wl), "--ignore-eos", "--max-model-len", "100000", "--tokenizer", gpt2,
               "--slo-ttft-ms", "1", "--slo-tpot-ms", "0.01", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    assert s["requests"] == {"sent": 3, "completed": 2, "failed": 1}
    (msg,) = s["errors"]
    assert msg.startswith("HTTP 400") and s["errors"][msg] == 1
    assert s["slo"]["met"] == 0 and s["slo"]["attainment"] == 0.0
    assert "failed x1" in r.stdout
    # with the context the endpoint reports (2048 in /v1/models), the long prompt is not sent at all
    r = replay("--url", gateway.url, "--workload", str(wl), "--ignore-eos", "--tokenizer", gpt2, "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["summary"]["requests"] == {"sent": 2, "completed": 2, "failed": 0} and rep["config"]["skipped_context"] == 1


def test_plain_completions_straight_to_the_engine_without_gateway_headers(gateway, data, tmp_path):
    """Straight to an engine that wants a key: without one, one line that says so; with the engine's key (from
    OPENAI_API_KEY, as the OpenAI SDK reads it), plain completions."""
    args = ["--url", gateway.engines[0], "--no-chat", "--no-stream", "--max-requests", "4", "--max-tokens-cap", "8",
            "--ignore-eos", "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json"))]
    _one_line_error(replay(*args, timeout=120, env={"OPENAI_API_KEY": ""}), "wants a key; give it with --api-key")
    out = tmp_path / "engine.json"
    r = replay(*args, "--json", str(out), env={"OPENAI_API_KEY": gateway.engine_key})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    s = rep["summary"]
    assert s["requests"] == {"sent": 4, "completed": 4, "failed": 0}
    assert [q["output_tokens"] for q in rep["requests"]] == [q["max_tokens"] for q in rep["requests"]]
    assert s["ttft_s"]["n"] == 0 and s["jct_s"]["n"] == 4  # not streamed: no TTFT
    assert s["slo"]["with_deadline"] == 0 and s["slo"]["attainment"] is None and s["prediction"]["n"] == 0
    assert "no x-lengthwise-deadline header" in r.stdout and "not streamed" in r.stdout


def test_workload_without_prompt_text_exits_2(gateway, data):
    _one_line_error(replay("--url", gateway.url, "--workload", str(need_data("traces/AzureLLMInferenceTrace_code_2023.csv")),
                           timeout=120), "no prompt text")


def test_ctrl_c_mid_replay_exits_130_in_one_line(gateway, tmp_path):
    """SIGINT (Ctrl-C in a terminal) while requests are in flight: one line, no traceback, exit 130, no report. The fast
    counterpart of the load benches' Ctrl-C test (slow tier), on the same command-line path."""
    cli = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
           "from serving.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "r.json"
    log = tmp_path / "replay.log"
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-c", cli, "replay", "--url", gateway.url, "--max-requests", "40",
                                 "--rate", "4", "--ignore-eos", "--max-tokens-cap", "400", "--json", str(out)],
                                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    try:
        deadline = time.monotonic() + 120
        while gateway.get("/health").json()["inflight"] < 1:  # requests in flight
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "Traceback" not in text and text.rstrip().splitlines()[-1] == "lengthwise replay: interrupted", text[-3000:]
    assert not out.exists()
