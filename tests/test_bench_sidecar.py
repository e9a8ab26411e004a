"""``lengthwise bench sidecar``: the fallback rate the gateway would see, the variant flags it passes to the sidecar,
and the constants it spells out so ``lengthwise --help`` stays light."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving.bench.predictor.sidecar import GATEWAY_PREDICTOR_TIMEOUT_MS, PRECISIONS, fallback_rate
from tests.datafiles import need_data
from tests.tiny_package import tiny_packages

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")


def test_the_constants_follow_the_gateway_and_the_runtime():
    from predictor.runtime import PRECISIONS as RUNTIME_PRECISIONS
    from serving.gateway.settings import GatewaySettings

    assert GATEWAY_PREDICTOR_TIMEOUT_MS == GatewaySettings.model_fields["predictor_timeout_ms"].default
    assert PRECISIONS == RUNTIME_PRECISIONS


def test_fallback_rate_counts_late_and_failed_predictions():
    ms = np.array([1.0, 10.0, 49.9, 50.0, 50.1, 200.0])
    assert fallback_rate(ms, 0, 50.0) == pytest.approx(2 / 6)  # at the timeout is still in time
    assert fallback_rate(ms, 2, 50.0) == pytest.approx(4 / 8)
    assert fallback_rate(np.array([]), 3, 50.0) == 1.0
    assert fallback_rate(np.array([]), 0, 50.0) is None


def test_a_fused_sidecar_with_a_smaller_budget_reports_its_fallback_rate(data, tmp_path):
    """A real run against a started sidecar serving a tiny package's fused-int8 graph at a cut input budget: with a
    timeout no prediction can meet, sent with each request as the gateway sends it, the sidecar drops every one (504)
    and every one is a fallback; the flags reach the sidecar."""
    pkg = tiny_packages(tmp_path, need_data("tokenizers/gpt2/tokenizer.json"), {"pkg": None})["pkg"]
    out = tmp_path / "bench.json"
    env = {**os.environ, "LENGTHWISE_HOME": str(tmp_path / "home")}
    r = subprocess.run([LENGTHWISE, "bench", "sidecar", "--model", str(pkg), "--levels", "1,4", "--duration", "1",
                        "--warmup", "0.2", "--prompts", "50", "--precision", "fused-int8", "--max-prompt-tokens", "16",
                        "--threads", "1", "--fallback-ms", "0.001", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, check=False, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["fallback_timeout_ms"] == 0.001
    assert report["sidecar_args"][report["sidecar_args"].index("--precision") + 1] == "fused-int8"
    assert report["sidecar_args"][report["sidecar_args"].index("--max-prompt-tokens") + 1] == "16"
    for level in report["levels"].values():
        assert level["requests"] == 0 and level["errors"] > 0 and level["fallback_rate"] == 1.0
    assert (pkg / "model.fused.int8.onnx").is_file()  # the sidecar made the variant it was asked for
    assert "fallback" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--fallback-ms", "0"], "--fallback-ms must be positive"),
    (["--precision", "fp16"], "invalid choice"),
])
def test_bad_flags_are_one_line(args, message):
    r = subprocess.run([LENGTHWISE, "bench", "sidecar", *args], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
