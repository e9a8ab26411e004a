"""``bench fleet``'s orchestration with its engines, gateways and replays faked: what each step hands the next.

The real run needs vLLM engines and minutes of CPU; these fakes stand in for the processes and the HTTP replay
(deterministic results from each job) so the steps around them run for real: the calibration's fit from a step
profile, the simulator at the replay's rate, the gateway's command line per placement, the comparison with
round-robin and JSQ, and the JSON written.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from serving.placementbench import fleet
from serving.replay import Result
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


def run_fake_fleet(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, **config: Any) -> tuple[dict, list[list[str]], str, Path]:
    """``run_fleet_bench`` with every process and request faked; returns (its dict, each gateway's argv, what it printed,
    the JSON path)."""
    from serving.gateway import launcher

    work = tmp_path / "work"
    work.mkdir()
    gateways: list[list[str]] = []

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

    async def replay(url: str, model: str, jobs: list, preds: list[float]) -> tuple[list, float]:
        slow = 1.0 + 0.15 * fleet.PLACEMENTS.index(placement())
        out = []
        for j, p in zip(jobs, preds):
            r = Result(j.index, j.arrival, j.max_tokens, j.trace_output_tokens, j.prompt_tokens, sent=j.arrival + 0.001)
            if j.index % 17 == 16:
                r.error = "connection reset"
            else:
                r.ok, r.ttft = True, slow * (0.02 + 0.0001 * j.prompt_tokens) + (0.4 if j.index % 9 == 0 else 0.0)
                r.jct, r.output_tokens = r.ttft + slow * 0.002 * j.max_tokens, j.max_tokens
                r.engine = f"engine-{(j.index + int(p)) % 2}"
            out.append(r)
        return out, max(r.sent + (r.jct or 0) for r in out)

    def get(url: str, timeout: float = 0) -> SimpleNamespace:
        text = ('# TYPE lengthwise_gateway_prefill_hops_total counter\n'
                f'lengthwise_gateway_prefill_hops_total{{outcome="ok"}} {len(gateways)}\n')
        return SimpleNamespace(json=lambda: {"placement_state": {"placement": placement()}}, text=text, status_code=200)

    def start_engines(settings: Any, log_dir: Path) -> list[SimpleNamespace]:
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
    monkeypatch.setattr(fleet, "run_engines", lambda jobs, w, c: [{"profile": _profile(i)} for i in range(len(jobs))])
    monkeypatch.setattr(fleet, "_wait_idle", lambda urls: next(idle, None))
    monkeypatch.setattr(fleet, "_wait_gateway", lambda url, proc: None)
    monkeypatch.setattr(fleet, "_replay", replay)
    monkeypatch.setattr(launcher, "start_engines", start_engines)
    monkeypatch.setattr(launcher, "stop_engines", lambda procs: None)
    monkeypatch.setattr(launcher, "wait_healthy", lambda urls, timeout, procs: None)
    monkeypatch.setattr(launcher, "free_port", lambda: 8123)
    buf = io.StringIO()
    json_path = tmp_path / "out" / "fleet.json"
    out = fleet.run_fleet_bench(fleet.FleetBenchConfig(**config), json_path, Console(file=buf, width=200))
    return out, gateways, buf.getvalue(), json_path


@pytest.mark.unit
def test_fleet_bench_steps_with_faked_engines(monkeypatch, tmp_path):
    out, gateways, printed, json_path = run_fake_fleet(monkeypatch, tmp_path, max_requests=40, rate=2.0,
                                                       placements=["round-robin", "jsq", "aladdin", "lengthwise"])
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
        assert 0 <= r["sim"]["ttft_tpot_attainment"] <= 1 and r["prefill_hops"] is None
        assert sum(r["per_engine_requests"].values()) == 40
    assert rr["not_idle_at_start"] is None and jsq["not_idle_at_start"].startswith("the engines did not report idle")
    assert "jsq starts anyway" in printed and f"JSON: {json_path}" in printed


@pytest.mark.unit
def test_fleet_bench_default_rate_and_prefill_engines(monkeypatch, tmp_path):
    out, gateways, _, _ = run_fake_fleet(monkeypatch, tmp_path, max_requests=24, prefill_engines=1,
                                         placements=["jsq", "lengthwise"])
    assert out["rate"] > 0  # what the calibrated simulator says the fleet sustains under JSQ
    for args in gateways:
        assert args.count("--engine-url") == 2 and args.count("--prefill-url") == 1
    assert [r["prefill_hops"] for r in out["placements"].values()] == [{"ok": 1}, {"ok": 2}]
    assert out["placements"]["lengthwise"]["goodput_vs_round-robin"] is None
