"""``lengthwise demo``'s story, step by step, without a model, an engine or a sidecar: what it prints, the commands
it starts, the timing keys, the files and the exit code.

The real demo takes minutes (SmolLM2 on vLLM-CPU); here every child, wait, request and the trace are stand-ins, and
the clock ticks one second per reading, so each printed time and timing is a known number. These tests pin the
behaviour that splitting ``_run`` into its steps must keep.
"""

from __future__ import annotations

import argparse
import json
import sys
import time as real_time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from serving import demo
from serving.bench import replay

pytestmark = pytest.mark.unit

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class FakeProc:
    pid: int
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode


@dataclass
class World:
    """What the demo did: the children it started, the waits, the plan it asked for, the requests it sent."""

    starts: list = field(default_factory=list)
    waits: list = field(default_factory=list)
    gets: list = field(default_factory=list)
    posts: list = field(default_factory=list)  # (url, json) of each request to the sidecar
    arrivals_rate: float | None = None  # the rate the trace's arrivals were drawn at
    plan_args: dict = field(default_factory=dict)
    calibrate_args: tuple = ()
    replay_args: tuple = ()
    report_args: tuple = ()
    stopped: int = 0
    converted: list = field(default_factory=list)
    ready: dict = field(default_factory=lambda: {"model_name": "length-predictor", "model_version": "3"})
    short: int = 0  # prompts fewer than the demo asks for
    completed: int | None = None  # what the replay's summary reports as completed (default: every request)


def _args(work: Path, **kw) -> argparse.Namespace:
    a = {"work_dir": work, "gguf": None, "predictor": "models:/length-predictor@champion", "requests": 4, "load": 0.5,
         "rate": None, "max_tokens": 256, "seed": 0, "policy": "lengthwise", "engine_cores": "1", "engine_compile": False,
         "engine_arg": [], "kv_cache_gib": 1.0, "max_model_len": 2048, "predictor_timeout_ms": 1000.0, "sidecar_threads": 1,
         "slo_scale": 2.0, "start_timeout": 900.0, "max_replay_minutes": 10.0}
    return argparse.Namespace(**(a | kw))


@pytest.fixture
def world(tmp_path, monkeypatch) -> World:
    w = World()
    gguf = tmp_path / "data" / GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"")
    sharegpt = tmp_path / "data" / "sharegpt.json"
    sharegpt.write_text("[]")
    monkeypatch.setenv("COLUMNS", "1000")  # rich wraps nothing

    ticks = iter(range(1000, 100000))
    monkeypatch.setattr(demo, "time", SimpleNamespace(monotonic=lambda: float(next(ticks)), sleep=real_time.sleep,
                                                      perf_counter=real_time.perf_counter))
    monkeypatch.setattr(demo, "_check", lambda a: (gguf, sharegpt))
    monkeypatch.setattr(demo, "_registered", lambda uri: "length-predictor v3")
    ports = iter(range(5001, 5100))
    monkeypatch.setattr(demo, "free_port", lambda: next(ports))
    monkeypatch.setattr(demo, "cpu_cores", lambda spec: "7")

    class FakeChildren:
        def __init__(self) -> None:
            self.children: list = []

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.stop_all()

        def start(self, name, cmd, log, env=None, grace_s=20.0):
            w.starts.append({"name": name, "cmd": cmd, "log": log, "env": env, "grace_s": grace_s})
            child = demo.Child(name, FakeProc(len(w.starts)), log, grace_s)
            self.children.append(child)
            return child

        def stop_all(self) -> None:
            w.stopped += len(self.children)
            self.children.clear()

    monkeypatch.setattr(demo, "Children", FakeChildren)

    def wait_child(child, url, timeout_s, what):
        w.waits.append((child.name, url, timeout_s, what))
        return 0.0

    monkeypatch.setattr(demo, "wait_child", wait_child)

    def get(url, timeout=None):
        w.gets.append(url)
        if url.endswith("/ready"):
            return SimpleNamespace(json=lambda: w.ready)
        return SimpleNamespace(text="lengthwise_gateway_requests_total 4\nlengthwise_gateway_request_latency_seconds_bucket"
                                    "{le=\"1\"} 2\nvllm_other 1\nlengthwise_gateway_inflight 0\n")

    monkeypatch.setattr(httpx, "get", get)

    def post(url, json=None, timeout=None):  # the sidecar predicts the trace: one prediction above max_tokens (256)
        w.posts.append((url, json))
        expected = [20.0, 30.0, 34.0, 500.0][:len(json["prompts"])]
        return SimpleNamespace(raise_for_status=lambda: None,
                               json=lambda: {"predictions": [{"expected_tokens": e} for e in expected]})

    monkeypatch.setattr(httpx, "post", post)

    def plan_jobs(workload, **kw):
        w.plan_args = {"workload": workload, **kw}
        n = kw["max_requests"] - w.short
        jobs = [replay.Job(i, 0.0, (("user", f"q{i}"),), 10 + i, 50 + i, 40 + i) for i in range(n)]
        return replay.Plan(jobs, "sharegpt", str(kw["tokenizer"]), 0, 0)

    monkeypatch.setattr(demo, "plan_jobs", plan_jobs)
    def poisson_arrivals(n, rate, seed):
        w.arrivals_rate = rate
        return [float(i) * 2 for i in range(n)]

    monkeypatch.setattr(demo, "poisson_arrivals", poisson_arrivals)

    def calibrate(url, model, jobs, n, tokens):
        w.calibrate_args = (url, model, [j.index for j in jobs], n, tokens)
        rs = [SimpleNamespace(prompt_tokens=10, output_tokens=32, ttft=0.25, jct=1.0) for _ in range(n)]
        return 0.25, 0.0125, rs

    monkeypatch.setattr(demo, "calibrate", calibrate)

    def run_with_progress(jobs, s, console=None):
        w.replay_args = ([(j.index, j.arrival) for j in jobs], s)
        return ["r"] * len(jobs), 12.5

    monkeypatch.setattr(demo, "run_with_progress", run_with_progress)

    def build_report(plan, s, rate, seed, cap, results, duration, max_tokens=None):
        w.report_args = (len(plan.jobs), s.url, rate, seed, cap, max_tokens, len(results), duration)
        done = len(results) if w.completed is None else w.completed
        return {"summary": {"requests": {"completed": done, "failed": len(results) - done},
                            "slo": {"with_deadline": done, "met": max(done - 1, 0), "attainment": 0.75 if done else None,
                                    "slack_p50_s": 1.5 if done else None}}, "s": s.url}

    monkeypatch.setattr(demo, "build_report", build_report)
    monkeypatch.setattr(demo, "report_table", lambda summary, title: f"TABLE {title}")

    def convert_gguf(src, dst):
        w.converted.append((src, dst))

    import predictor.convert

    monkeypatch.setattr(predictor.convert, "convert_gguf", convert_gguf)
    return w


def _cached(work: Path) -> Path:
    model = work / "SmolLM2-135M-Instruct"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    return model


def _lines(text: str) -> list[str]:
    return [ln.rstrip() for ln in text.splitlines() if ln.strip()]


def test_the_demo_tells_its_story_in_five_steps(world, tmp_path, capsys):
    work = tmp_path / "work"
    model = _cached(work)
    bin_dir = Path(sys.executable).parent
    assert demo.run(_args(work)) == 0
    out, err = capsys.readouterr()
    logs = work / "logs"

    assert world.converted == []  # a cached model is not converted again
    sc = "http://127.0.0.1:5001"
    gw = "http://127.0.0.1:5002"
    assert _lines(err) == [
        f"[1/5] model: {model} (cached)",
        # each wait, told as a line when the output is not a terminal (a spinner there), so a log shows what it waits on
        f"starting predictor-sidecar (models:/length-predictor@champion) on {sc} ...",
        f"[2/5] predictor-sidecar: length-predictor v3 on {sc}, ready in 1 s (log {logs / 'sidecar.log'})",
        "      the predictor records no target model: whose lengths it learned is unknown",
        "loading the ShareGPT trace while the engine starts ...",
        "starting lengthwise serve with one vLLM engine on cores 7 (about a minute) ...",
        (f"[3/5] lengthwise serve on {gw}: one engine (lengthwise, cores 7, KV 1 GiB), ready in 2 s "
         f"(logs {logs / 'gateway.log'}, {logs / 'engines'}); 4 prompts loaded meanwhile in 1 s"),
        "calibrating: 3 requests alone ...",
        ("[4/5] lone request here: t_p 250 ms to the first token, t_g 12.5 ms per token; "
         "SLO headers x-slo-ttft-ms 500, x-slo-tpot-ms 25.0 (scale 2)"),
        # predictions 20, 30, 34 and 500 capped at max_tokens 256: mean 85; 0.25 + 0.0125 x 85 = 1.3125 s a request
        ("      offered load 0.381 req/s (--load): 0.50 x one engine's lone-request capacity 0.762 req/s "
         "(t_p + t_g x 85 predicted tokens = 1.3 s a request)"),
        # the last arrival (6 s) and one lone service (1.3125 s): 0.1 min
        ("[5/5] replaying 4 ShareGPT first turns at 0.381 req/s (Poisson, seed 0), "
         "max_tokens 256, about 0.1 min: each answer ends where SmolLM2 stops"),
        f"reports: {work / 'replay.json'}, {work / 'demo.json'}; logs: {logs}",
    ]
    assert "TABLE lengthwise demo: SmolLM2-135M-Instruct behind lengthwise serve" in out
    assert "lengthwise demo: where the time went" in out
    verdict = ("only 3 of 4 requests met their SLO at 0.50 x the lone-request capacity, median slack 1.5 s: the engine "
               "fell behind its queue at this rate (below 90%); a lower --load shows the rate it sustains")
    assert verdict in " ".join(out.split())

    assert world.starts == [
        {"name": "predictor-sidecar", "log": logs / "sidecar.log", "env": None, "grace_s": 20.0,
         "cmd": [str(bin_dir / "predictor-sidecar"), "--model", "models:/length-predictor@champion", "--host", "127.0.0.1",
                 "--port", "5001", "--threads", "1", "--reload-interval", "0", "--max-actual-tokens", "2048"]},
        {"name": "lengthwise serve", "log": logs / "gateway.log", "grace_s": 60.0,
         "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "7", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
         "cmd": [str(bin_dir / "lengthwise"), "serve", "--model", str(model), "--engines", "1", "--policy", "lengthwise",
                 "--predictor-url", sc, "--predictor-timeout-ms", "1000", "--port", "5002",
                 "--engine-log-dir", str(logs / "engines"), "--engine-start-timeout", "900",
                 "--engine-arg=--dtype float32", "--engine-arg=--max-model-len 2048", "--engine-arg=--enforce-eager"]},
    ]
    assert world.stopped == 2
    assert world.waits == [("predictor-sidecar", sc + "/ready", 900.0, "ready"),
                           ("lengthwise serve", gw + "/health", 960.0, "serving")]
    assert world.gets == [sc + "/ready", gw + "/metrics"]
    assert world.plan_args == {"workload": tmp_path / "data" / "sharegpt.json", "max_requests": 4 + demo.CALIBRATION_REQUESTS,
                               "max_tokens_cap": None, "max_tokens": 256, "rate": None, "seed": 0, "tokenizer": model,
                               "max_model_len": 2048}
    assert world.calibrate_args == (gw, str(model), [4, 5, 6], 3, demo.CALIBRATION_TOKENS)  # prompts outside the trace
    jobs, s = world.replay_args
    assert jobs == [(0, 0.0), (1, 2.0), (2, 4.0), (3, 6.0)]  # the trace, with its Poisson arrivals
    assert (s.url, s.model, s.slo_ttft_ms, s.slo_tpot_ms, s.timeout_s) == (gw, str(model), 500.0, 25.0, 600)
    # sampled as SmolLM2 is served and relabelled, so the predictor is judged on the lengths it was trained for
    assert s.extra_body == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
    assert world.posts == [(sc + "/v1/predict", {"prompts": ["q0", "q1", "q2", "q3"]})]  # the trace, not the calibration
    assert world.arrivals_rate == pytest.approx(0.5 / 1.3125)
    assert world.report_args == (4, gw, pytest.approx(0.5 / 1.3125), 0, None, 256, 4, 12.5)

    replay_json = json.loads((work / "replay.json").read_text())
    assert replay_json["s"] == gw and replay_json["summary"]["requests"] == {"completed": 4, "failed": 0}
    report = json.loads((work / "demo.json").read_text())
    assert list(report) == ["model", "predictor", "predictor_model", "policy", "engine_cores", "kv_cache_gib",
                            "max_model_len", "calibration", "replay", "gateway_metrics", "predictor_fit", "load", "verdict",
                            "timings"]
    assert report["model"] == str(model) and report["engine_cores"] == "7"
    assert report["predictor_model"] == {"model_name": "length-predictor", "model_version": "3"}
    assert report["calibration"] == {"t_p_s": 0.25, "t_g_s": 0.0125, "slo_scale": 2.0, "requests": [
        {"prompt_tokens": 10, "output_tokens": 32, "ttft": 0.25, "jct": 1.0}] * 3}
    assert report["replay"] == replay_json
    assert report["load"] == {"rate_req_s": pytest.approx(0.5 / 1.3125), "given": False, "load": pytest.approx(0.5),
                              "capacity_req_s": pytest.approx(1 / 1.3125), "mean_predicted_tokens": 85.0,
                              "lone_service_s": 1.3125, "requests_asked": 4, "estimated_replay_s": 7.3125}
    assert report["verdict"] == verdict
    assert report["gateway_metrics"] == ["lengthwise_gateway_requests_total 4", "lengthwise_gateway_inflight 0"]
    # one clock reading a second: every step's time is the number of readings between its start and its end
    assert list(report["timings"].items()) == list({"convert_s": 1.0, "sidecar_ready_s": 1.0, "load_trace_s": 1.0,
                                                    "engine_ready_s": 2.0, "calibrate_s": 1.0, "replay_s": 1.0, "stop_s": 1.0,
                                                    "total_s": 14.0}.items())


def test_an_uncached_model_is_converted_and_engine_options_reach_the_gateway(world, tmp_path, capsys):
    work = tmp_path / "work"
    a = _args(work, engine_compile=True, engine_arg=["--max-num-seqs 4"], kv_cache_gib=0.5, policy="vllm",
              predictor_timeout_ms=250.5, start_timeout=30.0, sidecar_threads=2)
    assert demo.run(a) == 0
    err = capsys.readouterr().err
    model = work / "SmolLM2-135M-Instruct"
    assert world.converted == [(tmp_path / "data" / GGUF_NAME, model)]
    assert f"[1/5] model: {model} (converted in 1 s)" in err
    sidecar, gateway = world.starts
    assert sidecar["cmd"][-6:] == ["--threads", "2", "--reload-interval", "0", "--max-actual-tokens", "2048"]
    assert gateway["cmd"][-2:] == ["--engine-arg=--max-model-len 2048", "--engine-arg=--max-num-seqs 4"]
    assert "--engine-arg=--enforce-eager" not in gateway["cmd"]
    assert gateway["cmd"][gateway["cmd"].index("--policy") + 1] == "vllm"
    assert gateway["cmd"][gateway["cmd"].index("--predictor-timeout-ms") + 1] == "250.5"
    assert gateway["cmd"][gateway["cmd"].index("--engine-start-timeout") + 1] == "30"
    assert gateway["env"]["VLLM_CPU_KVCACHE_SPACE"] == "0.5"
    assert world.waits[1][2] == 90.0  # the gateway gets a minute more than its engine
    assert json.loads((work / "demo.json").read_text())["kv_cache_gib"] == 0.5


@pytest.mark.parametrize("target", ["ChatGPT", "SmolLM2-135M-Instruct"])
def test_a_predictor_for_another_model_is_served_only_with_the_override_and_said(world, tmp_path, capsys, target):
    """The gateway refuses a predictor trained for another model's lengths; the demo passes the override only then,
    and says so, so a ShareGPT-trained champion still runs but nobody takes its predictions for SmolLM2's."""
    work = tmp_path / "work"
    _cached(work)
    world.ready = {"model_name": "length-predictor", "model_version": "3", "target": {"model": target}}
    assert demo.run(_args(work)) == 0
    err = " ".join(capsys.readouterr().err.split())
    gateway = world.starts[1]["cmd"]
    fit = json.loads((work / "demo.json").read_text())["predictor_fit"]
    assert fit["target"] == target and fit["served"].startswith("SmolLM2-135M-Instruct@")
    if target == "ChatGPT":
        assert "--allow-predictor-for-other-model" in gateway and fit["verdict"] == "different"
        assert "the predictor learned the lengths of ChatGPT, not of the served SmolLM2-135M-Instruct@" in err
    else:
        assert "--allow-predictor-for-other-model" not in gateway and fit["verdict"] == "same_name"


def test_a_given_rate_is_replayed_as_it_is_and_reported_against_the_capacity(world, tmp_path, capsys):
    work = tmp_path / "work"
    _cached(work)
    assert demo.run(_args(work, rate=1.5)) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert world.arrivals_rate == 1.5
    assert ("offered load 1.5 req/s (--rate): 1.97 x one engine's lone-request capacity 0.762 req/s "
            "(t_p + t_g x 85 predicted tokens = 1.3 s a request)") in err
    assert json.loads((work / "demo.json").read_text())["load"]["given"] is True


def test_a_slow_machine_is_warned_of_and_the_replay_cut_to_its_time_bound(world, tmp_path, capsys, monkeypatch):
    """A calibration 10x slower than the documented pace: the user is told before the replay, and only the requests
    whose arrival and lone service fit --max-replay-minutes are sent, at the same rate."""
    work = tmp_path / "work"
    _cached(work)

    def slow(url, model, jobs, n, tokens):
        return 2.5, 0.5, [SimpleNamespace(prompt_tokens=10, output_tokens=32, ttft=2.5, jct=18.0)] * n

    monkeypatch.setattr(demo, "calibrate", slow)
    # lone service 2.5 + 0.5 x 85 = 45 s; arrivals 0, 2, 4, 6 s; a 0.8-minute (48 s) bound fits the first two
    assert demo.run(_args(work, rate=0.5, max_replay_minutes=0.8)) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "this machine runs SmolLM2 12x slower than the documented pace" in err
    assert ("at this pace 4 requests would take longer than --max-replay-minutes 0.8: replaying the first 2 "
            "(about 0.8 min; raise --max-replay-minutes to replay them all)") in err
    assert [i for i, _ in world.replay_args[0]] == [0, 1] and world.arrivals_rate == 0.5
    load = json.loads((work / "demo.json").read_text())["load"]
    assert (load["requests_asked"], load["estimated_replay_s"]) == (4, 47.0)


def test_requests_within_keeps_at_least_one():
    assert demo.requests_within([0.0, 10.0, 20.0], 5.0, 16.0) == 2
    assert demo.requests_within([0.0, 10.0], 100.0, 16.0) == 1


def _report(met: int, n: int, failed: int = 0, slack: float | None = 2.0, missed: list | None = None) -> dict:
    """A replay report: its summary and, for the misses, (predicted, actual tokens, seconds past the deadline)."""
    misses = [{"ok": True, "met_slo": False, "deadline": 100.0, "finished_at": 100.0 + late, "pred_len": pred,
               "output_tokens": actual} for pred, actual, late in missed or []]
    return {"summary": {"requests": {"completed": n - failed, "failed": failed},
                        "slo": {"with_deadline": n - failed, "met": met, "attainment": met / n, "slack_p50_s": slack}},
            "requests": misses}


def test_the_verdict_says_whether_one_engine_kept_up():
    load = demo.Load(rate=0.05, given=False, mean_predicted_tokens=200.0, lone_service_s=10.0)
    assert load.capacity == pytest.approx(0.1) and load.load == pytest.approx(0.5)
    assert demo.verdict(_report(23, 24), load) == (
        "23 of 24 requests met their SLO at 0.50 x the lone-request capacity, median slack 2.0 s: one engine keeps up "
        "at this rate; a higher --load shows where it stops")
    # a failed request counts against attainment, as the replay's report counts it; misses that ran no longer than
    # predicted are the engine's: it fell behind
    queued = _report(20, 24, failed=2, slack=-70.0, missed=[(400, 300, 80.0), (400, 350, 60.0), (300, 512, 2.0)])
    assert demo.verdict(queued, load).startswith(
        "only 20 of 24 requests met their SLO at 0.50 x the lone-request capacity, median slack -70.0 s: the engine fell "
        "behind its queue")
    # misses that ran past a short prediction had deadlines set too early: the engine kept pace (the demo's own run:
    # three answers ran to 512 tokens, predicted 354-432, and finished 0.4-1.5 s late)
    short = _report(13, 16, slack=15.3, missed=[(354, 512, 0.8), (361, 512, 1.5), (432, 512, 0.4)])
    assert demo.verdict(short, load) == (
        "13 of 16 requests met their SLO at 0.50 x the lone-request capacity, median slack 15.3 s: 3 of the 3 misses "
        "ran longer than predicted and finished a median 0.8 s after a deadline set from the short prediction; the "
        "engine kept pace, the predictions were short")
    no_deadline = {"summary": {"requests": {"completed": 4, "failed": 0},
                               "slo": {"with_deadline": 0, "met": 0, "attainment": None, "slack_p50_s": None}}}
    assert demo.verdict(no_deadline, load).startswith("no request carried a deadline")


def test_a_sidecar_that_cannot_predict_the_trace_is_an_error_and_every_child_stops(world, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    _cached(work)

    def post(url, json=None, timeout=None):
        raise httpx.ConnectError("connection refused")

    monkeypatch.setattr(httpx, "post", post)
    assert demo.run(_args(work)) == 1
    assert ("lengthwise demo: error: predicting the trace's lengths with the sidecar failed: connection refused"
            in capsys.readouterr().err)
    assert world.stopped == 2


def test_no_completed_request_exits_1_with_the_reports_written(world, tmp_path):
    work = tmp_path / "work"
    _cached(work)
    world.completed = 0
    assert demo.run(_args(work)) == 1
    assert (work / "replay.json").exists() and (work / "demo.json").exists()


def test_too_few_prompts_for_calibration_is_an_error_and_every_child_stops(world, tmp_path, capsys):
    work = tmp_path / "work"
    _cached(work)
    world.short = demo.CALIBRATION_REQUESTS  # the file holds the trace's prompts and none more
    assert demo.run(_args(work)) == 1
    err = capsys.readouterr().err
    assert f"lengthwise demo: error: the ShareGPT file holds fewer than {4 + demo.CALIBRATION_REQUESTS} usable prompts" in err
    assert world.stopped == 2 and world.calibrate_args == ()
    assert not (work / "demo.json").exists()


def test_a_bad_trace_is_an_error_naming_it(world, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    _cached(work)

    def bad(workload, **kw):
        raise replay.ReplayError("--workload x: no such file")

    monkeypatch.setattr(demo, "plan_jobs", bad)
    assert demo.run(_args(work)) == 1
    assert "lengthwise demo: error: --workload x: no such file" in capsys.readouterr().err
    assert world.stopped == 2


def test_ctrl_c_in_a_step_exits_130(world, tmp_path, capsys, monkeypatch):
    work = tmp_path / "work"
    _cached(work)

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "calibrate", interrupted)
    assert demo.run(_args(work)) == 130
    assert f"lengthwise demo: interrupted; every process stopped (logs in {work / 'logs'})" in capsys.readouterr().err
    assert world.stopped == 2
