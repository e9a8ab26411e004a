"""``lengthwise bench engine``'s steps (calibrate, replay at each rate, compare with the simulator, report) without an
engine: the engine runs are stand-ins whose step profile follows a known linear cost, over a small synthetic trace.

The real bench (tests/test_engine_bench.py) takes minutes; these pin, in a second, what ``run_bench`` asks the engines
to run, what it prints and what it reports, which splitting it into its steps must keep.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from serving.bench.engine import bench
from serving.bench.engine.bench import EngineBenchConfig, run_bench

pytestmark = pytest.mark.unit

C0, C1, C2 = 2e-3, 4e-6, 3e-5  # the stand-in engine's step: 2 ms + 4 µs a prefill token + 30 µs a decoded sequence
GAP = 1e-3  # its loop between two steps: the bench fits the cycle, step + gap


def _trace(path: Path, n: int = 16) -> Path:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:17:{i:02d}.0000000,{40 + 37 * i % 300},{10 + 173 * i % 700}" for i in range(n)]
    path.write_text("\n".join(rows) + "\n")
    return path


def _profile(n_steps: int) -> list[dict[str, float]]:
    rows, t = [], 0.0
    for i in range(n_steps):
        prefill, decode = (64 * (i % 5) if i % 3 == 0 else 0), 1 + i % 7
        step = C0 + C1 * prefill + C2 * decode
        rows.append({"start_s": t, "step_s": step, "prefill_tokens": prefill, "decode_tokens": decode,
                     "kv_read_tokens": 50 * (i % 4), "num_seqs": decode + (prefill > 0), "prefill_seqs": int(prefill > 0),
                     "sched_s": 1e-4})
        t += step + GAP
    return rows


class Engines:
    """Stands in for ``run_engines``: records every job; stock answers each request in 5 ms a token, the plug-in in 4."""

    def __init__(self) -> None:
        self.calls: list[list[dict]] = []

    def __call__(self, jobs: list[dict], work: Path, console: Console) -> list[dict]:
        self.calls.append(jobs)
        outs = []
        for job in jobs:
            per_token = 0.005 if job["scheduler"] == "stock" else 0.004
            recs = [{"id": r["id"], "arrival": r["arrival"], "first": r["arrival"] + 0.01,
                     "finished": r["arrival"] + 0.01 + per_token * r["output_tokens"], "tokens": r["output_tokens"]}
                    for r in job["requests"]]
            plugin = {} if job["scheduler"] == "stock" else {"requests": len(recs), "pauses": 1, "hosted": 2}
            outs.append({"scheduler": job["scheduler"], "profile": _profile(40), "records": recs, "preemptions": 0,
                         "plugin_stats": plugin,
                         "wall_s": max(r["finished"] for r in recs)})
        return outs


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=400, color_system=None, force_terminal=False), buf


@pytest.fixture
def engines(monkeypatch) -> Engines:
    e = Engines()
    monkeypatch.setattr(bench, "run_engines", e)
    return e


def _cfg(tmp_path: Path, **kw) -> EngineBenchConfig:
    """One replay a pair unless the test asks for the swapped second one (its own test below)."""
    kw.setdefault("swap_cores", False)
    return EngineBenchConfig(workload=str(_trace(tmp_path / "trace.csv")), max_requests=12, calibration_requests=8,
                             tokenizer=str(tmp_path / "unused-tokenizer.json"), **kw)


def test_calibrates_then_runs_both_schedulers_at_each_rate_and_reports(engines, tmp_path):
    con, buf = _console()
    out_json = tmp_path / "out" / "engine.json"
    result = run_bench(_cfg(tmp_path, rates=[2.0, 4.0]), out_json, tmp_path / "out" / "engine.png", con)
    text = buf.getvalue()

    calibration, *runs = engines.calls
    assert [j["scheduler"] for j in calibration] == ["stock"] and calibration[0]["tag"] == "calibration0"
    burst = calibration[0]["requests"]
    assert len(burst) == 8 and [r["arrival"] for r in burst] == pytest.approx([0.05 * i for i in range(8)])
    assert set(burst[0]) == {"id", "arrival", "prompt_tokens", "output_tokens"}
    cap = result["config"]["max_tokens"]  # the trace's longest response rounded up to a multiple of 256
    assert cap == 768 and all(job["max_tokens"] == cap for jobs in engines.calls for job in jobs)
    assert calibration[0]["engine"] == {"shape": "tiny", "max_model_len": 2048, "block_size": 32, "max_num_seqs": 256,
                                        "max_num_batched_tokens": 2048, "kv_blocks": 128, "threads": 1,
                                        "model": None}
    assert [[(j["scheduler"], j["tag"]) for j in r] for r in runs] == [[("stock", "r2-0"), ("lengthwise", "r2-0")],
                                                                      [("stock", "r4-0"), ("lengthwise", "r4-0")]]
    tfs = result["calibration"]["tfs"]
    for pair in runs:
        for job in pair:
            assert len(job["requests"]) == 12 and job["plugin"]["tfs"] == tfs and job["plugin"]["knobs"]["slo_kind"] == "jct"
            assert all("pred_len" in r["extra_args"] and r["slo_s"] > 0 for r in job["requests"])
        assert pair[0]["requests"] == pair[1]["requests"]  # same arrivals, same predictions

    lat = result["calibration"]["latency_model"]
    assert lat["n_rows"] == 40
    assert lat["c0_s"] == pytest.approx(C0 + GAP, rel=1e-6) and lat["c1_s_per_prefill_token"] == pytest.approx(C1, rel=1e-6)
    assert lat["c2_s_per_decode_token"] == pytest.approx(C2, rel=1e-6) and lat["c3_s_per_kv_token"] == pytest.approx(0, abs=1e-12)
    assert Path(result["calibration"]["profile_csv"]).name == "step_profile.csv"
    assert result["calibration"]["sim_max_rate_at_90_slo"] == {}  # rates given: no saturation sweep
    assert set(result) == {"config", "device", "stock", "lengthwise", "goodput_ratio", "rate", "headline_rule", "points",
                           "capacity", "calibration", "work_dir", "arms", "relabel", "cut", "elapsed_s"}
    assert result["cut"] is None
    assert result["relabel"] is None and set(result["arms"]) == {"lengthwise"}
    assert result["arms"]["lengthwise"]["predictor"] == "noise:0.55" and -1 <= result["arms"]["lengthwise"]["quality"][
        "kendall_tau"] <= 1
    assert [p["rate"] for p in result["points"]] == [2.0, 4.0]
    for p in result["points"]:
        for lab in ("stock", "lengthwise"):
            assert p[lab]["requests_completed"] == 12 and p[lab]["extra"]["wrong_or_lost"] == 0
            assert set(p[lab]["extra"]["sim_error"]) == {"jct_mean_s", "jct_p50_s", "throughput_rps"}
            assert math.isfinite(p[lab]["extra"]["sim"]["jct_mean_s"])
        assert p["goodput_ratio"] == pytest.approx(p["lengthwise"]["goodput_rps"] / p["stock"]["goodput_rps"])
    assert result["points"][1]["lengthwise"]["extra"]["plugin"] == {"requests": 12, "pauses": 1, "hosted": 2}
    assert result["capacity"]["target_attainment"] == bench.SLO_TARGET
    assert set(result["calibration"]["sim_error"]["stock"]) == {"rate_2", "rate_4"}
    assert result["headline_rule"] in text and result["config"]["rates"] == [2.0, 4.0]

    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    assert lines.pop(0) == f"work dir {result['work_dir']} (every engine's job, output and log)"
    if lines[0] == "loading the trace...":  # a wait, said as a line on a console that is not a terminal once it lasts 2 s
        lines.pop(0)
    assert lines[0] == "calibrating: 8 requests through stock vLLM (tiny model, 128 KV blocks, max_tokens 768)"
    assert lines[1].startswith("fitted step model: 3.00 ms + 4.0 µs/prefill token + 30.0 µs/decode token + 0.0 ns/KV token")
    assert lines[2].startswith("arm lengthwise: policy lengthwise, predictor noise:0.55: Kendall tau ")
    assert lines[3] == "replaying at 2, 4 req/s"
    assert lines[4] == "stock and lengthwise, side by side, at 2 req/s (12 requests each)"
    assert sum(ln.startswith("real engine: stock vLLM vs the plug-in") for ln in lines) == 2  # the table after each rate
    assert any(ln.startswith("headline: ") and "max rate at >= 90% SLO: stock " in ln for ln in lines)
    assert lines[-2:] == [f"wrote {out_json}", f"wrote {tmp_path / 'out' / 'engine.png'}"]
    assert json.loads(out_json.read_text())["points"][0]["rate"] == 2.0
    assert (tmp_path / "out" / "engine.png").stat().st_size > 0


def test_default_rates_are_factors_of_the_simulated_stock_capacity(engines, tmp_path, monkeypatch):
    swept = []

    def sweep(setup, name):
        swept.append(name)
        return {"max_rate_at_90_slo": {"vllm": 1.5, "lengthwise": 2.25}[name]}

    monkeypatch.setattr(bench, "sweep_policy", sweep)
    con, buf = _console()
    result = run_bench(_cfg(tmp_path), None, None, con)
    assert swept == ["vllm", "lengthwise"]
    assert [p["rate"] for p in result["points"]] == [float(f"{1.5 * f:.3g}") for f in bench.DEFAULT_RATE_FACTORS]
    assert result["calibration"]["sim_max_rate_at_90_slo"] == {"vllm": 1.5, "lengthwise": 2.25}
    text = buf.getvalue()
    assert "simulated max rate at 90% SLO: stock 1.5 req/s, lengthwise 2.25 req/s" in text
    assert "replaying at 1.5, 1.88, 2.25, 3 req/s" in text and "wrote" not in text


def test_each_arm_runs_beside_a_stock_run_of_its_own(engines, tmp_path):
    """An ablation policy and another predictor are each replayed beside their own stock run, with the same arrivals;
    the ablation arm sends the main predictions, the predictor arm its own; the top level stays the main arm's."""
    con, _ = _console()
    result = run_bench(_cfg(tmp_path, rates=[3.0], ablation=["sarathi"], compare_predictors=["oracle"]), None, None, con)
    _calibration, *runs = engines.calls
    assert [[j["scheduler"] for j in pair] for pair in runs] == [["stock", "lengthwise"], ["stock", "sarathi"],
                                                                 ["stock", "lengthwise"]]
    xargs = [[r["extra_args"]["pred_len"] for r in pair[1]["requests"]] for pair in runs]
    assert xargs[0] == xargs[1] and xargs[2] == [float(r["output_tokens"]) for r in runs[2][1]["requests"]]
    assert all(pair[0]["requests"][i]["arrival"] == runs[0][0]["requests"][i]["arrival"] for pair in runs
               for i in range(12))
    point = result["points"][0]
    assert list(point["arms"]) == ["lengthwise", "sarathi", "lengthwise+oracle"]
    assert point["lengthwise"] == point["arms"]["lengthwise"]["run"] and point["stock"] == point["arms"]["lengthwise"]["stock"]
    for pair in point["arms"].values():
        assert pair["goodput_ratio"] == pytest.approx(pair["run"]["goodput_rps"] / pair["stock"]["goodput_rps"])
    assert result["arms"]["lengthwise+oracle"]["quality"]["kendall_tau"] == pytest.approx(1.0)


class SlowFirstCore(Engines):
    """The stand-in with its first cores 25% slower: whichever job runs there takes 1.25 times as long a token."""

    def __call__(self, jobs: list[dict], work: Path, console: Console) -> list[dict]:
        outs = super().__call__(jobs, work, console)
        for r in outs[0]["records"]:
            r["finished"] = r["first"] + 1.25 * (r["finished"] - r["first"])
        outs[0]["preemptions"] = 3
        return outs


def test_swapped_cores_replay_each_pair_twice_and_report_the_mean(monkeypatch, tmp_path):
    """With ``swap_cores`` (the default) each pair runs a second time with the jobs' order, so their cores, swapped;
    each side's figures are its two replays' mean, lost requests summed, each replay and its ratio kept, and the table
    shows both ratios beside the mean's."""
    e = SlowFirstCore()
    monkeypatch.setattr(bench, "run_engines", e)
    con, buf = _console()
    result = run_bench(_cfg(tmp_path, rates=[2.0], swap_cores=True, slo_scale=10), None, None, con)
    _calibration, *runs = e.calls
    assert [[(j["scheduler"], j["tag"]) for j in r] for r in runs] == [
        [("stock", "r2-0"), ("lengthwise", "r2-0")], [("lengthwise", "r2-0-swapped"), ("stock", "r2-0-swapped")]]
    assert runs[0][0]["requests"] == runs[1][1]["requests"] and runs[0][1]["requests"] == runs[1][0]["requests"]
    pair = result["points"][0]["arms"]["lengthwise"]
    first, swapped = pair["replays"]
    assert first["stock_first_cores"] and not swapped["stock_first_cores"]
    assert first["stock"]["preemptions"] == 3 and swapped["run"]["preemptions"] == 3  # the slow cores' side each time
    for side in ("stock", "run"):
        assert pair[side]["preemptions"] == 1.5
        for key in ("goodput_rps", "slo_attainment", "jct_p99_s"):
            assert pair[side][key] == pytest.approx((first[side][key] + swapped[side][key]) / 2)
        assert pair[side]["extra"]["sim_error"]["jct_mean_s"] == pytest.approx(
            (first[side]["extra"]["sim_error"]["jct_mean_s"] + swapped[side]["extra"]["sim_error"]["jct_mean_s"]) / 2)
    # the slow cores hurt whichever side ran there: the stock side's JCT is worse in the first replay, better in the second
    assert first["stock"]["jct_mean_s"] > swapped["stock"]["jct_mean_s"]
    assert first["run"]["jct_mean_s"] < swapped["run"]["jct_mean_s"]
    assert pair["goodput_ratio"] == pytest.approx(pair["run"]["goodput_rps"] / pair["stock"]["goodput_rps"])
    text = buf.getvalue()
    assert "stock and lengthwise, side by side, cores swapped, at 2 req/s (12 requests each)" in text
    ratios = [r["goodput_ratio"] for r in pair["replays"]]
    assert None not in ratios and ratios[0] != ratios[1]  # a loose SLO (scale 10): every run has goodput
    assert f"{pair['goodput_ratio']:.2f}x ({ratios[0]:.2f}x, {ratios[1]:.2f}x)" in text


@pytest.mark.unit
def test_mean_metrics_sums_losses_and_keeps_what_is_not_a_number():
    a = {"policy": "x", "goodput_rps": 1.0, "preemptions": 2, "extra": {"wrong_or_lost": 1, "sim": {"jct_p99_s": 4.0}},
         "flag": True}
    b = {"policy": "y", "goodput_rps": 3.0, "preemptions": 5, "extra": {"wrong_or_lost": 2, "sim": {"jct_p99_s": 6.0}},
         "flag": False}
    m = bench.mean_metrics([a, b])
    assert m == {"policy": "x", "goodput_rps": 2.0, "preemptions": 3.5,
                 "extra": {"wrong_or_lost": 3, "sim": {"jct_p99_s": 5.0}}, "flag": True}
    assert bench.mean_metrics([a]) is a


class StandInSessions:
    """Stands in for the one-GPU layout's engine sessions: the same answers as :class:`Engines`, one job at a time; a job
    whose tag is in ``cut_at`` raises KeyboardInterrupt, as a time limit's SIGINT would."""

    def __init__(self, engines: Engines, cut_at: set[str]) -> None:
        self.engines, self.cut_at, self.closed = engines, cut_at, False
        self.startups: list[float] = []

    def __call__(self, work: Path, console: Console) -> StandInSessions:
        return self

    def run(self, job: dict, tag: str) -> dict:
        if tag in self.cut_at:
            raise KeyboardInterrupt
        return self.engines([job], Path("."), None)[0]

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("cut", [False, True])
def test_sequential_runs_stock_the_main_arm_the_baselines_then_the_oracle_and_a_cut_keeps_what_finished(monkeypatch,
                                                                                                        tmp_path, cut):
    e = Engines()
    sessions = StandInSessions(e, {"lengthwise-r4-2"} if cut else set())
    monkeypatch.setattr(bench, "Sessions", sessions)
    con, _ = _console()
    result = run_bench(_cfg(tmp_path, rates=[2.0, 4.0], sequential=True, ablation=["sarathi"],
                            compare_predictors=["oracle"]), None, None, con)
    order = [(j["scheduler"], j["tag"]) for jobs in e.calls for j in jobs]
    expected = [("stock", "calibration0"), ("stock", "r2"), ("stock", "r4"), ("lengthwise", "r2-0"),
                ("lengthwise", "r4-0"), ("sarathi", "r2-1"), ("sarathi", "r4-1"), ("lengthwise", "r2-2"),
                ("lengthwise", "r4-2")]
    assert order == (expected[:-1] if cut else expected) and sessions.closed
    for p in result["points"]:
        arms = p["arms"]
        stock = arms["lengthwise"]["stock"]  # one replay; its simulation differs by each arm's predictions
        assert all(a["shared_stock"] and a["stock"]["jct_mean_s"] == stock["jct_mean_s"] for a in arms.values())
        assert set(arms) == ({"lengthwise", "sarathi"} if cut and p["rate"] == 4.0
                             else {"lengthwise", "lengthwise+oracle", "sarathi"})
    assert (result["cut"] is not None) == cut and (result["cut"] or "").startswith("KeyboardInterrupt" if cut else "")


def test_a_plan_replays_every_seed_then_stock_again_and_keeps_every_request_and_prediction(monkeypatch, tmp_path):
    """Seeds 1 and 2 and stock again: each engine once (stock, the arms, stock in a second process, the oracle), each
    seed with its own arrivals; the table has every arm, rate and seed on every SLO kind, stock again beside stock
    (the stand-in is deterministic: a ratio of exactly 1), and the records file every replay's requests."""
    import gzip

    e = Engines()
    monkeypatch.setattr(bench, "Sessions", StandInSessions(e, set()))
    con, buf = _console()
    out = tmp_path / "out" / "engine.json"
    result = run_bench(_cfg(tmp_path, rates=[2.0], sequential=True, seed=1, seeds=[1, 2], stock_again=True,
                            ablation=["sarathi"], compare_predictors=["oracle"]), out, None, con)
    jobs = [j for jobs in e.calls for j in jobs][1:]  # after the calibration
    assert [(j["scheduler"], j["tag"], j.get("process", "")) for j in jobs] == [
        ("stock", "r2-s1", ""), ("stock", "r2-s2", ""), ("lengthwise", "r2-0-s1", ""), ("lengthwise", "r2-0-s2", ""),
        ("sarathi", "r2-1-s1", ""), ("sarathi", "r2-1-s2", ""), ("stock", "r2-s1-again", "again"),
        ("stock", "r2-s2-again", "again"), ("lengthwise", "r2-2-s1", ""), ("lengthwise", "r2-2-s2", "")]
    assert [r["arrival"] for r in jobs[0]["requests"]] != [r["arrival"] for r in jobs[1]["requests"]]
    assert [r["arrival"] for r in jobs[0]["requests"]] == [r["arrival"] for r in jobs[6]["requests"]]
    rows = {(r["arm"], r["seed"]): r for r in result["table"]}
    assert set(rows) == {(a, s) for a in ("stock", "lengthwise", "sarathi", "lengthwise+oracle", "stock-again")
                         for s in (1, 2)}
    for r in rows.values():
        assert {"jct_goodput_ratio", "ttft+tpot_goodput_ratio", "normalised_latency_ratio", "ttft+tpot_attainment"} <= set(r)
    assert rows[("stock-again", 2)]["jct_goodput_ratio"] == pytest.approx(1.0)
    assert result["stock_spread"]["max_departure_jct_goodput_ratio"] == pytest.approx(0.0)
    assert [p["seed"] for p in result["points"]] == [1] and len(result["points_all_seeds"]) == 2
    assert "stock-again" in buf.getvalue() and "TTFT+TPOT att." in buf.getvalue()
    with gzip.open(out.with_name("engine.records.json.gz"), "rt") as f:
        rec = json.load(f)
    assert len(rec["runs"]) == 10 and rec["columns"][:4] == ["rid", "arrival_s", "first_token_s", "finished_s"]
    assert all(len(run["rows"]) == 12 for run in rec["runs"])
    oracle = rec["predictions"]["lengthwise+oracle"]["2"]["rows"]
    truth = {r["id"]: r["output_tokens"] for r in jobs[1]["requests"]}
    assert all(length == truth[rid] for rid, length, _ in oracle)
    assert json.loads(out.read_text())["records_file"] == "engine.records.json.gz"
    # the records alone give the table again, and at a looser SLO no arm attains less
    from serving.bench.engine.rescore import main as rescore

    assert rescore(["--records", str(out.with_name("engine.records.json.gz")), "--json", str(tmp_path / "re.json")]) == 0
    again = {(r["arm"], r["seed"]): r for r in json.loads((tmp_path / "re.json").read_text())}
    for key, row in rows.items():
        for k in ("jct_attainment", "jct_goodput_rps", "ttft+tpot_attainment", "ttft+tpot_goodput_rps",
                  "normalised_latency_s"):
            assert again[key][k] == pytest.approx(row[k], rel=1e-4), (key, k)  # records keep 0.1 ms
    loose = {(r["arm"], r["seed"]): r for r in bench.plan.rescore(out.with_name("engine.records.json.gz"), 100.0)}
    assert all(loose[k]["jct_attainment"] >= rows[k]["jct_attainment"] for k in rows)


def test_a_plan_over_budget_runs_what_fits_in_order_of_value_and_names_the_rest(monkeypatch, tmp_path):
    """A budget that holds the first rate's stock, main arm and baseline but nothing more (stock again comes after the
    baselines within a rate and seed): the rest is named."""
    from serving.bench.engine import plan

    e = Engines()
    monkeypatch.setattr(bench, "Sessions", StandInSessions(e, set()))
    monkeypatch.setattr(plan, "replay_estimate", lambda setup, rate, cap: 10.0)
    con, buf = _console()
    result = run_bench(_cfg(tmp_path, rates=[4.0, 2.0], sequential=True, stock_again=True, ablation=["sarathi"],
                            budget_s=48.0, engine_start_s=5.0), None, None, con)
    assert result["plan"]["chosen"] == ["stock at 4 req/s, seed 0", "lengthwise at 4 req/s, seed 0",
                                        "sarathi at 4 req/s, seed 0"]
    assert result["plan"]["left_out"][0] == "stock-again at 4 req/s, seed 0" and len(result["plan"]["left_out"]) == 5
    assert "left out: stock-again at 4 req/s" in " ".join(buf.getvalue().split())


def test_a_cut_during_calibration_still_writes_the_json(monkeypatch, tmp_path):
    e = Engines()
    monkeypatch.setattr(bench, "Sessions", StandInSessions(e, {"stock-calibration0"}))
    out = tmp_path / "cut.json"
    with pytest.raises(bench.EngineBenchError, match="cut during calibration"):
        run_bench(_cfg(tmp_path, rates=[2.0], sequential=True), out, None, _console()[0])
    d = json.loads(out.read_text())
    assert d["cut"] == "KeyboardInterrupt during calibration" and d["points"] == []


def test_plan_flags_need_engines_one_after_another(tmp_path):
    with pytest.raises(ValueError, match="add --sequential"):
        _cfg(tmp_path, seeds=[1, 2])
    with pytest.raises(ValueError, match="no such file"):
        _cfg(tmp_path, sequential=True, calibration_profile=str(tmp_path / "none.csv"))


def test_arrivals_are_the_same_for_the_replays_and_the_simulation_and_every_arm_reports_three_slo_kinds(
        engines, tmp_path, monkeypatch):
    """``--arrivals gamma:3``: both engines of a pair replay the Gamma draws of the bench's seed, the simulator that
    predicts each run is given those very arrivals, and the table and JSON carry all three SLO kinds for every arm."""
    from serving.sim.arrivals import arrival_times

    simulated = []
    real_simulate = bench.simulate

    def simulate(reqs, *args, **kw):
        simulated.append(sorted((r.rid, r.arrival) for r in reqs))
        return real_simulate(reqs, *args, **kw)

    monkeypatch.setattr(bench, "simulate", simulate)
    con, buf = _console()
    result = run_bench(_cfg(tmp_path, rates=[2.0], arrivals="gamma:3", seed=1, ablation=["sarathi"]), None, None, con)
    _calibration, *runs = engines.calls
    want = arrival_times("gamma:3", 12, 2.0, seed=1)
    assert want[-1] != pytest.approx(arrival_times("poisson", 12, 2.0, seed=1)[-1])
    for pair in runs:
        for job in pair:
            assert [r["arrival"] for r in job["requests"]] == pytest.approx(list(want))
    replayed = sorted((r["id"], r["arrival"]) for r in runs[0][0]["requests"])
    assert simulated and all(s == replayed for s in simulated)
    assert result["config"]["arrivals"] == "gamma:3"
    for pair in result["points"][0]["arms"].values():
        for side in ("stock", "run"):
            m = pair[side]
            assert 0 <= m["slo_attainment"] <= 1 and 0 <= m["ttft_tpot_attainment"] <= 1 and m["normalized_latency_s"] > 0
            assert {"slo_attainment", "ttft_tpot_attainment", "normalized_latency_s"} <= set(m["extra"]["sim"])
    header = next(ln for ln in buf.getvalue().splitlines() if "JCT SLO att." in ln)
    assert "TTFT+TPOT att." in header and "norm. lat. s/tok" in header


def test_the_services_table_shows_the_three_slo_kinds_per_service():
    kinds = {"a": {"slo_attainment": 0.5, "ttft_tpot_attainment": 0.25, "normalized_latency_s": 0.0123},
             "b": {"slo_attainment": 1.0, "ttft_tpot_attainment": 0.75, "normalized_latency_s": 0.02}}
    better = {n: {k: v * 2 for k, v in d.items()} for n, d in kinds.items()}
    point = {"rate": 2.0, "arms": {"lengthwise": {"stock": {"extra": {"per_service": kinds}},
                                                  "run": {"extra": {"per_service": better}}}}}
    con, buf = _console()
    bench._service_table([point], con)
    text = buf.getvalue()
    assert "0.50 -> 1.00" in text and "0.25 -> 0.50" in text and "0.0123 -> 0.0246" in text
    assert all(k in text for k in ("JCT SLO att.", "TTFT+TPOT att.", "norm. lat. s/tok"))


def test_per_service_reports_the_three_slo_kinds_by_the_summarys_definitions():
    from serving.perf.slo import SLO
    from serving.sim.metrics import RequestRecord, per_service, slo_kinds

    slo = SLO(scale=2.0, t_p=0.1, t_g=0.01, ttft_s=0.5, tpot_s=0.02)
    recs = [RequestRecord(0, 0.0, 10, 11, slo.jct_limit(11), first_token=0.2, finished=0.3, tokens=11, service="a"),
            RequestRecord(1, 0.0, 10, 11, slo.jct_limit(11), first_token=0.9, finished=1.0, tokens=11, service="a"),
            RequestRecord(2, 0.0, 10, 11, slo.jct_limit(11), first_token=0.1, finished=0.5, tokens=11, service="b"),
            RequestRecord(3, 0.0, 10, 11, slo.jct_limit(11), service="b")]
    per = per_service(recs, slo)
    # JCT limit 0.42 s. a: the first meets both; the second misses its JCT and its TTFT (0.9 s). b: the first misses its
    # JCT (0.5 s) and its TPOT (0.04 s a token); the second never finished
    assert per["a"]["slo_attainment"] == 0.5 and per["a"]["ttft_tpot_attainment"] == 0.5
    assert per["b"]["slo_attainment"] == 0.0 and per["b"]["ttft_tpot_attainment"] == 0.0
    assert per["a"]["normalized_latency_s"] == pytest.approx((0.3 + 1.0) / 2 / 11)
    total = slo_kinds(recs, slo)
    assert total == {"slo_attainment": 0.25, "ttft_tpot_attainment": 0.25, "normalized_latency_s": pytest.approx(
        (0.3 + 1.0 + 0.5) / 3 / 11)}
