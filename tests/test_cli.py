"""Bad input to train-predictor: exit status 2 and one clear line, never a traceback."""

import os
import signal
import subprocess
import sys
import time

import pytest

from serving.launch.process import free_port
from tests.cli_inproc import run_main
from tests.conftest import SHAREGPT
from tests.datafiles import need_data
from tests.sidecar_proc import wait_for
from training.cli import main


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "training.cli", *args], capture_output=True, text=True, timeout=300, env=env,
                          check=False)


@pytest.fixture(scope="module")
def files(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.json").write_text("[]")
    (d / "table.csv").write_text("a,b\n1,2\n")
    return d


@pytest.mark.parametrize("case", ["missing", "wrong-format", "empty", "tokenizer", "one-bucket", "bad-edges", "base-model"])
def test_bad_input_exits_2_with_one_line(case, files, data, home):
    sg = str(need_data(SHAREGPT))
    tok = str(need_data("tokenizers/gpt2/tokenizer.json"))
    args = {
        "missing": ["--data", str(files / "nope.json"), "--tokenizer", tok],
        "wrong-format": ["--data", str(files / "table.csv"), "--format", "sharegpt", "--tokenizer", tok],
        "empty": ["--data", str(files / "empty.json"), "--tokenizer", tok],
        "tokenizer": ["--data", sg, "--tokenizer", str(files / "no-tokenizer.json"), "--max-samples", "50"],
        "one-bucket": ["--data", sg, "--tokenizer", tok, "--bucket-width", "4096", "--max-samples", "50"],
        "bad-edges": ["--data", sg, "--tokenizer", tok, "--edges", "10,abc", "--max-samples", "50"],
        "base-model": ["--data", sg, "--tokenizer", tok, "--base-model", str(files), "--max-samples", "200"],
    }[case]
    r = run_main(main, args)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("train-predictor: error:"), r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.fault("MLflow down when train-predictor starts",
                   saw="exit 2 and one line naming the server and how to fix it, before any data is read or model trained",
                   lost="nothing (no run was started)")
def test_an_unreachable_tracking_server_is_one_line_before_any_training(data, home):
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    r = run_cli("--data", str(need_data(SHAREGPT)), "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json")),
                "--max-samples", "200", env={**os.environ, "MLFLOW_TRACKING_URI": dead})
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("train-predictor: error:") and dead in lines[0] and "MLFLOW_TRACKING_URI" in lines[0]
    assert time.monotonic() - t0 < 120  # the imports' time, not MLflow's retries


# slow (75 s: its own tracking server and a training run); the default tier's counterpart: the unreachable server above
@pytest.mark.slow
@pytest.mark.fault("MLflow killed in the middle of a train-predictor run",
                   saw="exit 2 and, as its last line, one naming the server that stopped answering; no traceback",
                   lost="the run (not registered; the alias and earlier versions untouched)")
def test_a_tracking_server_killed_mid_run_is_one_line(data, home, mlflow_server, mlflow_server_proc, tmp_path):
    from mlflow import MlflowClient

    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}  # MLflow's own retries (7, with backoff) would take minutes here
    job = subprocess.Popen([sys.executable, "-m", "training.cli", "--data", str(need_data(SHAREGPT)), "--tokenizer",
                            str(need_data("tokenizers/gpt2/tokenizer.json")), "--max-samples", "300", "--epochs", "2",
                            "--max-prompt-tokens", "64", "--no-baselines", "--route-slices", "off", "--work-dir",
                            str(tmp_path / "work")], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = MlflowClient(mlflow_server)
        wait_for(lambda: job.poll() is not None or client.search_runs(
            [e.experiment_id for e in client.search_experiments()]), timeout=240, what="the run to start")
        assert job.poll() is None, job.communicate()[1]
        os.killpg(mlflow_server_proc.pid, signal.SIGKILL)  # training and logging are under way
        _, err = job.communicate(timeout=240)
    finally:
        job.kill()
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert job.returncode == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("train-predictor: error: the tracking server") and mlflow_server in lines[-1], err
    assert "the run is not registered" in lines[-1]


@pytest.mark.unit
def test_help_teaches():
    r = run_cli("--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "--bucket-width" in r.stdout
