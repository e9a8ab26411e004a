"""The engine bench's one-GPU path, exercised here: sequential engines kept per scheduler, one stock replay per rate, the
tau-matched noise, the prediction mode, the knee search on a slow engine, the step recorder under async scheduling,
and the GPU run script's dry run. The ``cpu-smoke`` run is the same code the ``h200-llama8b`` preset runs on a GPU."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from rich.console import Console

from serving.bench.engine import bench
from serving.bench.engine.cli import with_preset
from serving.bench.engine.presets import GPU_PREDICTIONS, PRESETS, TRAINED_TAU, write_length_workload
from serving.bench.engine.replay import STOCK, STOCK_ASYNC, engine_key, scheduler_cls
from serving.cli import main
from serving.engine.profile import StepRecorder
from serving.perf.latency import FittedLatency

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 200 s; the default tier's counterparts: test_engine_bench_steps.py's plan tests (stand-ins)
@pytest.mark.timeout(900)
def test_the_gpu_script_runs_its_plan_end_to_end_on_the_cpu_smoke_preset(tmp_path):
    """The GPU script as a lent machine runs it, on this CPU (the cpu-smoke preset, no pack to install): the plan's
    flags reach the bench, every engine starts once, every seed and stock again are replayed, and the outputs are
    collected."""
    out = tmp_path / "out"
    env = {**os.environ, "LENGTHWISE_GPU_BENCH_S": "600", "PYTHON": sys.executable}
    r = subprocess.run(["bash", "serving/bench/gpu/run.sh", str(out), "--cpu-smoke", "--max-requests", "8", "--rates",
                        "4", "--calibration-requests", "8", "--kv-blocks", "24", "--max-model-len", "512"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=880, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    d = json.loads((out / "bench_engine.json").read_text())
    assert d["config"]["sequential"] and d["config"]["seeds"] == [1, 2] and d["config"]["budget_s"] == 580
    assert {(row["arm"], row["seed"]) for row in d["table"]} == {
        (a, s) for a in ("stock", "lengthwise", "sarathi", "lengthwise+oracle", "stock-again") for s in (1, 2)}
    for p in d["points_all_seeds"]:
        stock = p["arms"]["lengthwise"]["stock"]
        for label, pair in p["arms"].items():
            assert pair["shared_stock"] and pair["stock"]["jct_mean_s"] == stock["jct_mean_s"]
            m = pair["run"]
            assert m["requests_total"] == m["requests_completed"] == 8, label
            assert m["extra"]["wrong_or_lost"] == 0 and m["extra"]["plugin"]["fallback_predictions"] == 0
        assert p["stock_again"]["requests_completed"] == 8
    assert d["arms"]["lengthwise"]["predictor"].startswith("noise:")  # noise-tau: resolved to a noise level
    assert d["arms"]["lengthwise+oracle"]["quality"]["kendall_tau"] == pytest.approx(1.0)
    assert not d["plan"]["left_out"] and not d["plan"]["skipped"]
    work = Path(d["work_dir"])
    # five engines, one after another: stock (calibration and replays), the two arms, stock again, then the oracle's
    assert sorted(p.name for p in work.glob("engine*.log")) == ["engine1-stock.log", "engine2-lengthwise.log",
                                                               "engine3-sarathi.log", "engine4-stock.log",
                                                               "engine5-lengthwise.log"]
    cap = d["config"]["max_tokens"]
    for run in work.glob("*.out.json"):
        recs = json.loads(run.read_text())["records"]
        assert recs and all(r["max_tokens"] == cap and r["finish_reason"] == "stop" for r in recs)
    with gzip.open(out / "bench_engine.records.json.gz", "rt") as f:
        records = json.load(f)
    assert len(records["runs"]) == 10 and all(len(run["rows"]) == 8 for run in records["runs"])
    assert sum(run["preemptions"] for run in records["runs"]) == sum(row[5] for run in records["runs"]
                                                                     for row in run["rows"])
    assert (out / "work.tar.gz").stat().st_size > 0 and "bench exit 0" in (out / "steps.log").read_text()
    assert (out / "step_profile.csv").read_text().startswith("prefill_tokens,")  # a second command's calibration


@pytest.fixture(scope="module")
def llama3_csv(tmp_path_factory) -> Path:
    return write_length_workload(tmp_path_factory.mktemp("wl") / "sharegpt.llama3.csv", n=80)


def test_prediction_mode_simulates_the_presets_plan_without_an_engine(tmp_path, llama3_csv):
    """The prediction committed before a GPU run: the preset's arms on each of its seeds at 1.5x the knee and the knee,
    the main arm with the trained predictor's own predictions (the committed file, made for this very workload)."""
    out = tmp_path / "prediction.json"
    code = main(["bench", "engine", "--preset", "h200-llama8b", "--predict", "roofline", "--max-requests", "60",
                 "--workload", str(llama3_csv), "--json", str(out)])
    assert code == 0
    d = json.loads(out.read_text())
    assert d["prediction"] and d["latency_model"]["gpu"] == "h200" and d["config"]["kv_blocks"] == 458
    hi, lo = d["rates"]
    assert hi == pytest.approx(1.5 * lo, rel=0.01) and lo == pytest.approx(d["sim_max_rate_at_90_slo"]["stock"], rel=0.01)
    assert set(d["points"][0]["arms"]) == {"lengthwise", "sarathi", "lengthwise-posterior",
                                           f"lengthwise+noise-tau:{TRAINED_TAU}", "lengthwise+oracle"}
    assert {(p["rate"], p["seed"]) for p in d["points_all_seeds"]} == {(r, s) for r in (hi, lo) for s in (1, 2, 0)}
    assert d["arms"]["lengthwise"]["predictor"].startswith("given:")
    tau = d["arms"][f"lengthwise+noise-tau:{TRAINED_TAU}"]["quality"]["kendall_tau"]
    assert abs(tau - TRAINED_TAU) < 0.1  # the noise ranks the trace about as well as the trained predictor
    assert {"jct_goodput_ratio", "ttft+tpot_goodput_ratio"} <= set(d["table"][0])


def _predictions_file(path: Path, lengths: list[int]) -> Path:
    rows = {str(i): {"length": 100.0, "hi": 128, "bucket": 2, "edges": [64, 128], "probs": [0.2, 0.5, 0.3],
                     "truth_tokens": n} for i, n in enumerate(lengths)}
    path.write_text(json.dumps({"predictions": rows}))
    return path


@pytest.mark.unit
def test_given_predictions_are_refused_for_another_workload(tmp_path):
    from serving.sim.predictions import PredictorSpecError, make_predictor
    from serving.sim.workload import TraceRequest

    reqs = [TraceRequest(i, 0.0, 10, n) for i, n in enumerate([50, 60, 70])]
    p = make_predictor(f"given:{_predictions_file(tmp_path / 'ok.json', [50, 60, 70, 80])}")
    got = p.predict(reqs)
    assert [g.probs for g in got] == [(0.2, 0.5, 0.3)] * 3 and got[0].remaining_after(100) > 0
    with pytest.raises(PredictorSpecError, match="another workload"):
        make_predictor(f"given:{_predictions_file(tmp_path / 'other.json', [50, 61, 70])}").predict(reqs)
    with pytest.raises(PredictorSpecError, match="no prediction for 1"):
        make_predictor(f"given:{_predictions_file(tmp_path / 'short.json', [50, 60])}").predict(reqs)
    with pytest.raises(PredictorSpecError, match="no file"):
        make_predictor(f"given:{tmp_path / 'missing.json'}")


@pytest.mark.unit
def test_the_committed_gpu_predictions_belong_to_the_gpu_workload_and_rank_it():
    """The trained predictor's predictions travel with the tree: one per workload row, each a bucket distribution, and
    their ranking of the rows' true Llama-3 lengths as the file says (the predictor held those prompts out)."""
    from training.evaluate import kendall_tau

    doc = json.loads(GPU_PREDICTIONS.read_text())
    rows = [doc["predictions"][str(i)] for i in range(len(doc["predictions"]))]
    assert len(rows) == doc["workload_rows"] == 1000 and doc["dropped_as_run_prompts"] >= 1000
    assert all(abs(sum(r["probs"]) - 1) < 1e-3 and len(r["probs"]) == len(r["edges"]) + 1 for r in rows)
    tau = kendall_tau(np.array([r["length"] for r in rows]), np.array([r["truth_tokens"] for r in rows], dtype=float))
    assert tau == pytest.approx(doc["kendall_tau_on_workload"], abs=1e-3) and tau > 0.2  # lengths kept to 0.01


def test_the_llama3_workload_is_length_only(llama3_csv):
    lines = llama3_csv.read_text().splitlines()
    assert lines[0] == "num_prefill_tokens,num_decode_tokens" and len(lines) == 81
    assert all(int(a) > 0 and int(b) > 0 and int(a) + int(b) <= 2048 for a, b in (x.split(",") for x in lines[1:]))


@pytest.mark.unit
def test_a_flag_given_wins_over_the_preset():
    p = argparse.ArgumentParser()
    p.add_argument("--preset")
    p.add_argument("--kv-blocks", dest="kv_blocks", type=int, default=128)
    p.add_argument("--max-requests", dest="max_requests", type=int, default=200)
    a = with_preset(p.parse_args(["--preset", "h200-llama8b", "--max-requests", "50"]), p.get_default)
    assert a.kv_blocks == PRESETS["h200-llama8b"]["kv_blocks"] and a.max_requests == 50


@pytest.mark.unit
def test_stock_engines_are_shared_whatever_the_plugin_settings_and_follow_async_scheduling():
    job = {"engine": {"shape": "micro"}, "scheduler": "stock", "plugin": {"tfs": 512}}
    assert engine_key(job) == engine_key({**job, "plugin": {}})
    ours = {**job, "scheduler": "lengthwise"}
    assert engine_key(ours) != engine_key({**ours, "plugin": {}})
    assert scheduler_cls(job) == STOCK
    assert scheduler_cls({**job, "engine": {"async_scheduling": True}}) == STOCK_ASYNC


def test_the_knee_search_reaches_a_slow_engine(tmp_path):
    """A CPU engine twice as slow as expected (112.5 ms + 4.74 ms a prefill token + 13.6 ms a decoded sequence) once made
    the search, which started at 1 req/s, find no rate and replay at 0 req/s; it now starts where one request at a time
    would be served."""
    cfg = bench.EngineBenchConfig(max_requests=40, kv_blocks=96, max_model_len=1536, rate_factors=[1.5])
    console = Console(quiet=True)
    wl, _ = bench._trace(cfg, console)
    cfg = bench._with_cap(cfg, wl)
    slow = FittedLatency(0.1125, 4.74e-3, 13.6e-3, r2=0.981, mape=0.1, n_rows=500)
    setup, _ = bench._setup(cfg, wl, slow, console)
    assert setup.scenario.start_rate < 0.1
    rates, cap = bench._rates(cfg, setup, console)
    assert cap["vllm"] > 0 and rates == [pytest.approx(1.5 * cap["vllm"], rel=0.01)]


@pytest.mark.unit
@pytest.mark.parametrize("spec", ["noise-tau:2", "noise-tau:x", "noise-tau:0"])
def test_a_bad_tau_target_is_refused_before_any_engine_starts(spec, capsys, tmp_path):
    code = main(["bench", "engine", "--predictor", spec, "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "noise-tau" in err and "\n" not in err


class _Base:
    """The two scheduler calls the recorder wraps, answering like vLLM's: scheduled tokens per request."""

    def __init__(self, plan):
        self.plan = list(plan)
        self.requests = {"a": SimpleNamespace(num_computed_tokens=0, num_prompt_tokens=4)}

    def schedule(self):
        n = self.plan.pop(0)
        self.requests["a"].num_computed_tokens += n
        return SimpleNamespace(num_scheduled_tokens={"a": n})

    def update_from_output(self, *_):
        return None


    def _preempt_request(self, request, timestamp):
        return None


class _Recorded(StepRecorder, _Base):
    pass


@pytest.mark.unit
def test_the_step_recorder_counts_preemptions_per_request():
    s = _Recorded([4])
    for rid in ("a", "b", "a"):
        s._preempt_request(SimpleNamespace(request_id=rid), 0.0)
    assert s.profile_preemptions == 3 and s.profile_preempted == {"a": 2, "b": 1}


@pytest.mark.unit
def test_the_step_recorder_keeps_overlapping_steps_in_order(monkeypatch):
    """Under async scheduling the engine schedules the next step before the last one's output is back: each row keeps
    its own shape, and a step is charged from its predecessor's end, so the steps add up to the busy time."""
    clock = iter([0.0, 0.001, 0.010, 0.011, 0.030, 0.050])
    monkeypatch.setattr("serving.engine.profile.time.perf_counter", lambda: next(clock))
    s = _Recorded([4, 1])
    s.schedule()  # step 1: the prompt, 4 tokens, at t=0
    s.schedule()  # step 2: one decode token, scheduled at t=0.010 while step 1 runs
    s.update_from_output()  # step 1 done at t=0.030
    s.update_from_output()  # step 2 done at t=0.050
    first, second = s.step_rows()
    assert (first["prefill_tokens"], first["decode_tokens"]) == (4, 0)
    assert (second["prefill_tokens"], second["decode_tokens"]) == (0, 1)
    assert first["step_s"] == pytest.approx(0.030) and second["step_s"] == pytest.approx(0.020)
    assert second["start_s"] == pytest.approx(0.030)


def _pack(tmp_path: Path) -> Path:
    pack = tmp_path / "pack"
    (pack / "wheels").mkdir(parents=True)
    (pack / "wheels" / "x-1.0-py3-none-any.whl").write_bytes(b"")
    (pack / "install.sh").write_text("exit 0\n")
    (pack / "manifest.json").write_text("{}")
    (pack / "sharegpt-first-turns.llama3.csv").write_text("num_prefill_tokens,num_decode_tokens\n10,20\n")
    return pack


@pytest.mark.unit
def test_the_gpu_script_dry_run_checks_the_pack_and_runs_nothing(tmp_path):
    env = {**os.environ, "LENGTHWISE_GPU_PACK": str(_pack(tmp_path))}
    r = subprocess.run(["bash", "serving/bench/gpu/run.sh", str(tmp_path / "out"), "--dry-run"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert "would run" in r.stdout and "1 wheels and 1 requests" in r.stdout
    assert "--preset h200-llama8b" in r.stdout and "--budget-s 510" in r.stdout
    assert not (tmp_path / "out" / "bench_engine.json").exists()


@pytest.mark.unit
@pytest.mark.parametrize("args,needle,bench_s", [([], "usage", "500"), (["--dry-run"], "usage", "500"),
                                                 (["OUT"], "no pack", "500"), (["OUT", "--rates", "3"], "no pack", "500"),
                                                 (["OUT"], "whole seconds", "9m"), (["OUT"], "more than 60", "30")])
def test_the_gpu_script_refuses_bad_input_with_one_line(args, needle, bench_s, tmp_path):
    env = {**os.environ, "LENGTHWISE_GPU_PACK": str(tmp_path / "missing"), "LENGTHWISE_GPU_BENCH_S": bench_s}
    r = subprocess.run(["bash", "serving/bench/gpu/run.sh", *[str(tmp_path / a) if a == "OUT" else a for a in args]],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1
