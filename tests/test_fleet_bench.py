"""``bench fleet``'s orchestration with its engines, gateways and replays faked: what each step hands the next.

The real run needs vLLM engines and minutes of CPU; these fakes stand in for the processes and the HTTP replay
(deterministic results from each job) so the steps around them run for real: the calibration's fit from a step
profile, the simulator at the replay's rate, the gateway's command line per placement, the comparison with
round-robin and JSQ, and the JSON written.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from serving.bench import fleet
from serving.bench.engine.exactlen import STOP_TOKEN_ID, TRUE_LEN_KEY
from serving.bench.replay import Result, request_body
from serving.sim.workload import TraceRequest


def _trace(cfg: fleet.FleetBenchConfig) -> list[TraceRequest]:
    return [TraceRequest(i, 0.0, 20 + (i * 37) % 200, 5 + (i * 53) % 900, (("user", f"prompt {i}"),))
            for i in range(cfg.max_requests)]


def _profile(engine: int) -> list[dict[str, float]]:
    rows, t = [], 0.0
    for k in range(60):
        prefill, decode, kv = (k * 41) % 700, 1 + (k * 7) % 30, 200 + (k * 113) % 3000
        step = 0.002 + 1e-5 * prefill + 4e-5 * decode + 1e-8 * kv + 1e-4 * engine
        rows.append({"start_s": t, "step_s": step, "prefill_tokens": prefill, "decode_tokens": decode, "kv_read_tokens": kv,
                     "num_seqs": decode, "prefill_seqs": 1 if prefill else 0, "sched_s": 1e-4})
        t += step + 0.001
    return rows


class Fake(SimpleNamespace):
    """What a faked fleet run did: its dict, each gateway's argv, what it printed, the JSON path, and what went out:
    the calibration jobs, the engines' settings, and every replay's request bodies in job order."""


def run_fake_fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **config: Any) -> Fake:
    """``run_fleet_bench`` with every process and request faked. The fake engines answer as the exact-length logits
    processor makes real ones answer: with the length in ``vllm_xargs`` when it fits ``max_tokens``, else
    ``max_tokens`` (what an engine without the processor does under ``ignore_eos``)."""

    work = tmp_path / "work"
    work.mkdir()
    gateways: list[list[str]] = []
    bodies: list[list[dict[str, Any]]] = []
    calibration: list[dict[str, Any]] = []
    engines: list[Any] = []

    class Popen:
        def __init__(self, args: list[str], **_: Any) -> None:
            gateways.append(list(args))
            self.returncode = None

        def poll(self) -> None:
            return None

        def terminate(self) -> None:
            self.returncode = 0

        def wait(self, timeout: float | None = None) -> int:
            return 0

    def placement() -> str:
        args = gateways[-1]
        return args[args.index("--placement") + 1]

    async def replay(jobs: list, settings: list) -> tuple[list, float]:
        slow = 1.0 + 0.15 * fleet.PLACEMENTS.index(placement())
        out, sent = [], []
        for j, s in zip(jobs, settings):
            body = request_body(j, s)
            sent.append(body)
            n = min((body.get("vllm_xargs") or {}).get(TRUE_LEN_KEY, body["max_tokens"]), body["max_tokens"])
            r = Result(j.index, j.arrival, j.max_tokens, j.trace_output_tokens, j.prompt_tokens, sent=j.arrival + 0.001)
            if j.index % 17 == 16:
                r.error = "connection reset"
            else:
                r.ok, r.ttft = True, slow * (0.02 + 0.0001 * j.prompt_tokens) + (0.4 if j.index % 9 == 0 else 0.0)
                r.jct, r.output_tokens = r.ttft + slow * 0.002 * n, n
                r.engine = f"engine-{(j.index + int(s.extra_headers['x-lengthwise-pred-len'])) % 2}"
            out.append(r)
        bodies.append(sent)
        return out, max(r.sent + (r.jct or 0) for r in out)

    def get(url: str, timeout: float = 0) -> SimpleNamespace:
        text = ('# TYPE lengthwise_gateway_prefill_hops_total counter\n'
                f'lengthwise_gateway_prefill_hops_total{{outcome="ok"}} {len(gateways)}\n')
        return SimpleNamespace(json=lambda: {"placement_state": {"placement": placement()}}, text=text, status_code=200)

    def start_engines(settings: Any, log_dir: Path) -> list[SimpleNamespace]:
        engines.append((settings, os.environ.get("VLLM_USE_V2_MODEL_RUNNER")))
        n = settings.engines + settings.prefill_engines
        return [SimpleNamespace(url=f"http://127.0.0.1:{9000 + i}", metrics_url=f"http://127.0.0.1:{9000 + i}/metrics")
                for i in range(n)]

    idle = iter([None, "the engines did not report idle within 120 s (still busy)"])
    monkeypatch.setattr(fleet.tempfile, "mkdtemp", lambda **_: str(work))
    monkeypatch.setattr(fleet.subprocess, "Popen", Popen)
    monkeypatch.setattr(fleet.httpx, "get", get)
    monkeypatch.setattr(fleet, "_trace", _trace)
    monkeypatch.setattr(fleet, "bench_dtype", lambda: "float32")
    monkeypatch.setattr(fleet, "dummy_model", lambda *a: "/models/dummy")
    def run_engines(jobs: list[dict[str, Any]], w: Path, c: Console) -> list[dict[str, Any]]:
        calibration.extend(jobs)
        return [{"profile": _profile(i)} for i in range(len(jobs))]

    monkeypatch.setattr(fleet, "run_engines", run_engines)
    monkeypatch.setattr(fleet, "wait_idle", lambda urls: next(idle, None))
    monkeypatch.setattr(fleet, "_wait_gateway", lambda url, proc, timeout_s=120.0: None)
    monkeypatch.setattr(fleet, "replay_jobs", replay)
    monkeypatch.setattr(fleet, "start_engines", start_engines)
    monkeypatch.setattr(fleet, "stop_engines", lambda procs: None)
    monkeypatch.setattr(fleet, "wait_started", lambda procs, timeout: None)
    # no processes to watch (serving.launch.supervise is tested on real ones in tests/test_engine_start.py)
    monkeypatch.setattr(fleet, "supervised", lambda procs: contextlib.nullcontext(SimpleNamespace(restarts={})))
    monkeypatch.setattr(fleet, "free_port", lambda: 8123)
    buf = io.StringIO()
    json_path = tmp_path / "out" / "fleet.json"
    out = fleet.run_fleet_bench(fleet.FleetBenchConfig(**config), json_path, Console(file=buf, width=200))
    return Fake(out=out, gateways=gateways, printed=buf.getvalue(), json_path=json_path, bodies=bodies,
                calibration=calibration, engines=engines)


@pytest.mark.unit
def test_fleet_bench_steps_with_faked_engines(monkeypatch, tmp_path):
    run = run_fake_fleet(monkeypatch, tmp_path, max_requests=40, rate=2.0,
                         placements=["round-robin", "jsq", "aladdin", "lengthwise"])
    out, gateways, printed, json_path = run.out, run.gateways, run.printed, run.json_path
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(out, default=float))
    assert out["rate"] == 2.0 and out["requests"] == 40
    assert list(out["placements"]) == ["round-robin", "jsq", "aladdin", "lengthwise"]
    cal = out["calibration"]
    assert cal["latency_model"] and Path(cal["profile_csv"]).name == "step_profile.csv"
    assert 0 < cal["slo"]["ttft_s"] and 0 < cal["slo"]["atgt_s"]
    # a gateway per placement, on every decode engine; Aladdin's limits read the calibration's profile
    assert [a[a.index("--placement") + 1] for a in gateways] == list(out["placements"])
    for args in gateways:
        profiled = "--latency-profile" in args
        assert profiled == (args[args.index("--placement") + 1] in ("aladdin", "lengthwise"))
        assert args.count("--engine-url") == 2 and "--prefill-url" not in args
        assert args[args.index("--slo-ttft-ms") + 1] == f"{cal['slo']['ttft_s'] * 1e3:.3f}"
    rr, jsq = out["placements"]["round-robin"], out["placements"]["jsq"]
    assert rr["goodput_vs_round-robin"] == 1.0 and jsq["goodput_vs_jsq"] == 1.0
    assert jsq["goodput_vs_round-robin"] == pytest.approx(jsq["goodput_ttft_atgt_rps"] / rr["goodput_ttft_atgt_rps"])
    for r in out["placements"].values():
        assert r["requests_total"] == 40 and r["requests_completed"] == 38 and r["errors"] == ["connection reset"]
        assert (r["wrong_or_lost"], r["wrong_or_lost_ids"]) == (2, [16, 33])  # the two failed requests, no wrong length
        assert 0 <= r["sim"]["ttft_tpot_attainment"] <= 1 and r["prefill_hops"] is None
        assert sum(r["per_engine_requests"].values()) == 40
    assert rr["not_idle_at_start"] is None and jsq["not_idle_at_start"].startswith("the engines did not report idle")
    assert "jsq starts anyway" in printed and f"JSON: {json_path}" in printed


@pytest.mark.unit
def test_fleet_bench_default_rate_and_prefill_engines(monkeypatch, tmp_path):
    run = run_fake_fleet(monkeypatch, tmp_path, max_requests=24, prefill_engines=1, placements=["jsq", "lengthwise"])
    out, gateways = run.out, run.gateways
    assert out["rate"] > 0  # what the calibrated simulator says the fleet sustains under JSQ
    for args in gateways:
        assert args.count("--engine-url") == 2 and args.count("--prefill-url") == 1
    assert [r["prefill_hops"] for r in out["placements"].values()] == [{"ok": 1}, {"ok": 2}]
    assert out["placements"]["lengthwise"]["goodput_vs_round-robin"] is None


@pytest.mark.unit
def test_every_request_asks_for_the_same_cap_and_only_the_sampler_gets_its_true_length(monkeypatch, tmp_path):
    """The fleet's leak, closed: the gateway and the plug-in clamp each prediction to ``max_tokens``, so a request sent
    with ``max_tokens`` = its true length would hand them the truth. Every body the replay sends must ask for the one
    bench-wide cap and carry its true length only in ``vllm_xargs[bench_true_output_len]`` for the logits processor."""
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    run = run_fake_fleet(monkeypatch, tmp_path, max_requests=40, rate=2.0, placements=["jsq", "lengthwise"])
    truth = [r.output_tokens for r in _trace(fleet.FleetBenchConfig(max_requests=40))]
    cap = run.out["config"]["max_tokens"]
    assert cap == 1024 and max(truth) == 854  # the trace's longest, rounded up to a multiple of 256
    assert len(run.bodies) == 2
    for bodies in run.bodies:
        assert [b["max_tokens"] for b in bodies] == [cap] * 40
        assert [b["vllm_xargs"] for b in bodies] == [{TRUE_LEN_KEY: n} for n in truth]
        for b in bodies:
            assert (b["stop_token_ids"], b["ignore_eos"], b["temperature"], b["stream"]) == ([STOP_TOKEN_ID], True, 0.0, True)
            assert b["include_stop_str_in_output"] is True
    for r in run.out["placements"].values():  # the fake engines ended each request at its true length
        assert r["wrong_or_lost_ids"] == [16, 33] and r["requests_completed"] == 38
    # the calibration's in-process engines get the same cap; the served engines load the length processor
    assert run.calibration and all(job["max_tokens"] == cap for job in run.calibration)
    ((settings, v2),) = run.engines
    assert f"--logits-processors {fleet.EXACT_LENGTH_PROCESSOR}" in settings.engine_args
    assert v2 == "0" and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ  # V1 runner for the engines; this process as it was


@pytest.mark.unit
def test_a_given_cap_is_every_requests_max_tokens(monkeypatch, tmp_path):
    run = run_fake_fleet(monkeypatch, tmp_path, max_requests=24, rate=2.0, max_tokens=1500, placements=["jsq"])
    assert run.out["config"]["max_tokens"] == 1500
    assert {b["max_tokens"] for bodies in run.bodies for b in bodies} == {1500}


@pytest.mark.unit
def test_a_cap_below_a_true_length_exits_2_with_one_line_before_anything_starts(monkeypatch, tmp_path, capsys):
    from serving.cli import main

    monkeypatch.setattr(fleet, "_trace", _trace)
    monkeypatch.setattr(fleet.tempfile, "mkdtemp", lambda **_: pytest.fail("the bench started"))
    code = main(["bench", "fleet", "--max-requests", "40", "--max-tokens", "850", "--json", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--max-tokens 850 is below the trace's longest response (854 tokens)" in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.unit
def test_the_exact_length_fields_refuse_a_length_the_cap_would_cut():
    assert fleet.exact_length_fields(7, 7)["vllm_xargs"] == {TRUE_LEN_KEY: 7}
    for n, cap in ((8, 7), (0, 7)):
        with pytest.raises(ValueError, match="does not fit max_tokens"):
            fleet.exact_length_fields(n, cap)


@pytest.mark.unit
def test_the_engines_argument_names_the_exact_length_processor_as_vllm_parses_it():
    """The engines are ``vllm serve``: its own argument parser must read the fleet's engine arguments, and the class
    they name must be the processor (a renamed class would otherwise surface only when the engines start)."""
    import importlib
    import shlex

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from serving.bench.engine.exactlen import ExactLengthLogitsProcessor

    argv = [part for a in fleet.bench_engine_args(fleet.FleetBenchConfig(), "float32") for part in shlex.split(a)]
    args = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--model", "m", *argv])
    (name,) = args.logits_processors
    module, sep, cls = name.partition(":")  # vLLM loads module:Class and refuses a dotted path at engine start
    assert sep and getattr(importlib.import_module(module), cls) is ExactLengthLogitsProcessor
