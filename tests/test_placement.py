"""Placement core (Aladdin Alg. 1/2, Eq. 7, baselines), the cluster simulator, `lengthwise bench placement` and `scale`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.cli import main
from serving.perf.latency import make_latency_model
from serving.placement import Instance, Job, LengthHistory, Limits, PlacementError, make_placement, placement_names, rebalance
from serving.placement.scaling import fit_scaling
from serving.sim.cluster import ClusterConfig, simulate_cluster
from serving.sim.engine import simulate
from serving.sim.scenarios import SCENARIOS, build_setup
from tests.cli_inproc import run_main
from tests.datafiles import need_files

# the placement scenarios' workloads and tokenizers (serving/bench/placement/scenarios.py, serving/sim/scenarios.py)
NEEDS = ("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json",
         "tokenizers/llama3/tokenizer.model", "traces/AzureLLMInferenceTrace_code_2023.csv",
         "traces/mooncake_conversation_trace.jsonl", "traces/mooncake_synthetic_trace.jsonl")

LAT = make_latency_model("blis", "llama-3.1-8b", "a100-80gb")


def lengthwise(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], capture_output=True, text=True, timeout=timeout,
                          check=False)


def brute_peak(jobs: list[Job], bs: int) -> float:
    """KV blocks at every future step, summed over jobs, by walking the steps one by one."""
    horizon = max((math.ceil(j.remaining) for j in jobs), default=0)
    return max((sum((j.context + s) / bs + 1 for j in jobs if s < math.ceil(j.remaining)) for s in range(horizon)), default=0.0)


jobs_st = st.lists(st.tuples(st.integers(1, 300), st.integers(1, 200), st.integers(0, 250)), min_size=0, max_size=12)


def make_jobs(rows) -> list[Job]:
    return [Job(i, p, float(pred), generated=g, started=g > 0, first_token_at=0.0 if g else None)
            for i, (p, pred, g) in enumerate(rows)]


@pytest.mark.unit
@settings(max_examples=150, deadline=None)
@given(jobs_st, st.sampled_from([1, 16, 32]))
def test_projected_kv_peak_is_exact_at_the_breakpoints(rows, bs):
    jobs = make_jobs(rows)
    lim = Limits(kv_tokens=10_000, block_size=bs)
    assert lim.kv_peak_blocks(jobs) == pytest.approx(brute_peak(jobs, bs))


@pytest.mark.unit
@settings(max_examples=100, deadline=None)
@given(st.lists(jobs_st, min_size=1, max_size=4), st.tuples(st.integers(1, 300), st.integers(1, 200)),
       st.sampled_from(["aladdin", "lengthwise-pack", "lengthwise"]))
def test_aladdin_keeps_projected_kv_within_capacity_whenever_some_instance_could(states, new, name):
    lim = Limits(kv_tokens=600, block_size=16, latency=LAT, ttft_s=2.0, atgt_s=0.05)
    insts = [Instance(f"i{k}", jobs={j.rid: j for j in make_jobs(rows)}) for k, rows in enumerate(states)]
    job = Job(10_000, new[0], float(new[1]))
    p = make_placement(name, lim)
    i = p.choose(insts, job, now=1.0)
    feasible = [k for k, inst in enumerate(insts) if lim.violation(inst, job, 1.0) is None]
    if feasible:
        assert i in feasible and p.stats["would_open"] == 0
        assert lim.kv_peak_blocks(insts[i].jobs.values(), job) <= lim.kv_blocks
        loads = sorted(lim.capacity_norm(insts[k]) for k in feasible)
        if name == "aladdin":  # best fit: the most loaded
            assert lim.capacity_norm(insts[i]) == loads[-1]
        elif name == "lengthwise-pack":  # best fit among those with no prompt waiting to prefill, if any is feasible
            idle = [k for k in feasible if all(j.first_token_at is not None for j in insts[k].jobs.values())]
            pool = idle or feasible
            assert i in pool and lim.capacity_norm(insts[i]) == max(lim.capacity_norm(insts[k]) for k in pool)
        else:  # ours: one of the two least loaded
            assert lim.capacity_norm(insts[i]) in loads[:2]
    else:
        assert p.stats["would_open"] == 1
        assert lim.capacity_norm(insts[i]) == min(lim.capacity_norm(x) for x in insts)


@pytest.mark.unit
def test_aladdin_pairs_long_prompts_with_long_outputs_where_jsq_may_not():
    """Aladdin Fig. 3: capacity 9, two long-prompt and two long-output requests: packing by KV over time fits all."""
    lim = Limits(kv_tokens=9, block_size=1)
    lp = [Job(0, 4, 1.0), Job(1, 4, 1.0)]   # peak 5 blocks at their first step
    lo = [Job(2, 1, 4.0), Job(3, 1, 4.0)]   # peak 5 blocks at their last step
    insts = [Instance("a"), Instance("b")]
    p = make_placement("aladdin", lim)
    for j in lp + lo:
        insts[p.choose(insts, j)].add(j)
    for inst in insts:
        assert sorted(j.prompt_len for j in inst.jobs.values()) == [1, 4]
        assert lim.kv_peak_blocks(inst.jobs.values()) <= 9
    assert p.stats["would_open"] == 0 and p.stats["rejected_kv"] >= 1


@pytest.mark.unit
def test_pack_best_fits_but_tries_instances_with_a_prompt_to_prefill_last():
    lim = Limits(kv_tokens=400_000, block_size=16, latency=LAT, ttft_s=5.0, atgt_s=0.5)
    decoding = {k: Job(k, 2_000, 100.0, generated=5, started=True, first_token_at=0.0) for k in range(1, 4)}
    busy = Instance("busy", jobs={**{k + 10: Job(k + 10, 2_000, 100.0, generated=5, started=True, first_token_at=0.0)
                                      for k in range(1, 4)}, 20: Job(20, 3_000, 100.0)})  # one prompt not prefilled yet
    calm = Instance("calm", jobs=dict(decoding))
    empty = Instance("empty")
    insts = [empty, calm, busy]
    assert lim.capacity_norm(busy) > lim.capacity_norm(calm) > lim.capacity_norm(empty)
    new = Job(99, 1_000, 50.0)
    assert all(lim.violation(x, new, 1.0) is None for x in insts)
    assert make_placement("aladdin", lim).choose(insts, new, now=1.0) == 2  # best fit: the most loaded, prefill and all
    pack = make_placement("lengthwise-pack", lim)
    assert pack.choose(insts, new, now=1.0) == 1  # the most loaded of those with nothing to prefill
    busy.jobs[20].first_token_at = 1.5  # its prompt is done: plain best fit again
    assert pack.choose(insts, new, now=2.0) == 2
    calm.healthy = False
    empty.jobs[30] = Job(30, 500, 10.0)  # every candidate now has a prompt waiting: best fit over all of them
    busy.jobs[20].first_token_at = None
    assert pack.choose(insts, new, now=2.0) == 2 and pack.stats["would_open"] == 0


def _graded_fleet(n: int) -> tuple[Limits, list[Instance], Job]:
    """``n`` instances, instance k holding k + 1 running jobs (so i0 is the least loaded), and a new job every one of
    them can take."""
    lim = Limits(kv_tokens=400_000, block_size=16, latency=LAT, ttft_s=5.0, atgt_s=0.5)
    insts = [Instance(f"i{k}", jobs={k * 10 + m: Job(k * 10 + m, 2_000, 100.0, generated=5, started=True, first_token_at=0.0)
                                     for m in range(k + 1)}) for k in range(n)]
    new = Job(99, 1_000, 50.0)
    assert all(lim.violation(x, new, 1.0) is None for x in insts)
    return lim, insts, new


@pytest.mark.unit
def test_pack_replicas_fill_their_own_share_of_the_fleet_first():
    lim, insts, new = _graded_fleet(4)  # i3 the most loaded, i0 the least
    picks = [make_placement("lengthwise-pack", lim, replica=(g, 2)).choose(insts, new, now=1.0) for g in range(2)]
    assert picks == [2, 3]  # replica 0 packs i0/i2, replica 1 i1/i3: each its own most loaded, not both the same
    assert make_placement("lengthwise-pack", lim).choose(insts, new, now=1.0) == 3  # one replica: plain best fit
    # nothing feasible in its own share: the others' instances, best fit again
    insts[1].healthy = insts[3].healthy = False
    assert make_placement("lengthwise-pack", lim, replica=(1, 2)).choose(insts, new, now=1.0) == 2
    for bad in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(PlacementError, match="replica"):
            make_placement("lengthwise-pack", lim, replica=bad)
    assert make_placement("aladdin", lim, replica=(1, 2)).choose(insts, new, now=1.0) == 2  # others ignore it


@pytest.mark.unit
def test_lengthwise_takes_the_least_loaded_alone_and_one_of_the_two_least_loaded_beside_other_replicas():
    lim, insts, new = _graded_fleet(3)  # i0 the least loaded, i2 the most
    alone = {make_placement("lengthwise", lim, seed=s).choose(insts, new, now=1.0) for s in range(20)}
    assert alone == {0}  # a lone gateway's view is fresh: no coin flip between i0 and i1
    shared = {make_placement("lengthwise", lim, seed=s, replica=(0, 4)).choose(insts, new, now=1.0) for s in range(20)}
    assert shared == {0, 1}  # several replicas: one of the two least loaded, never the most loaded


@pytest.mark.unit
def test_baselines_round_robin_jsq_p2c_and_health():
    insts = [Instance(f"i{k}") for k in range(3)]
    rr = make_placement("round-robin")
    assert [rr.choose(insts, Job(k, 10, 10.0)) for k in range(4)] == [0, 1, 2, 0]
    insts[1].healthy = False
    assert [rr.choose(insts, Job(k, 10, 10.0)) for k in range(3)] == [2, 0, 2]
    jsq = make_placement("least-outstanding")  # the old name still works
    assert jsq.name == "jsq"
    insts[0].add(Job(100, 10, 10.0))
    assert jsq.choose(insts, Job(5, 10, 10.0)) == 2
    assert jsq.choose(insts, Job(6, 10, 10.0), exclude=frozenset({"i2"})) == 0
    insts[0].healthy = insts[2].healthy = False
    assert jsq.choose(insts, Job(7, 10, 10.0)) is None and jsq.stats["no_instance"] == 1
    # p2c spreads heavy decodes: with one instance full of heavy jobs, a heavy job goes to the other of the pair
    two = [Instance("x", jobs={i: Job(i, 10, 900.0) for i in range(4)}), Instance("y", jobs={9: Job(9, 10, 5.0)})]
    p2c = make_placement("p2c", seed=3)
    assert all(p2c.choose(two, Job(50 + k, 10, 800.0)) == 1 for k in range(5))
    with pytest.raises(PlacementError, match="choose one of"):
        make_placement("random-ish")
    with pytest.raises(PlacementError, match="limits"):
        make_placement("aladdin")
    assert set(placement_names()) == {"round-robin", "jsq", "least-kv", "p2c", "aladdin", "lengthwise-pack", "lengthwise"}
    # least-kv weighs what the requests hold, not how many there are: one long context outweighs three short ones
    kv = make_placement("least-kv")
    pair = [Instance("long", jobs={1: Job(1, 100_000, 50.0, generated=10, started=True)}),
            Instance("short", jobs={k: Job(k, 500, 50.0) for k in (2, 3, 4)})]
    assert kv.choose(pair, Job(9, 100, 10.0)) == 1
    assert make_placement("jsq").choose(pair, Job(9, 100, 10.0)) == 0
    idle = [Instance(f"i{k}") for k in range(3)]
    assert [kv.choose(idle, Job(20 + k, 10, 1.0)) for k in range(3)] != [0, 0, 0]  # ties rotate over an idle fleet


@pytest.mark.unit
def test_rebalance_moves_only_unstarted_jobs_from_an_overrun_instance():
    lim = Limits(kv_tokens=100_000, block_size=16, latency=LAT, ttft_s=5.0, atgt_s=0.5)
    over = Instance("over", jobs={
        1: Job(1, 100, 50.0, generated=120, started=True, first_token_at=0.0, repredicted=400.0),  # outlived its prediction
        2: Job(2, 100, 300.0, started=False),
        3: Job(3, 100, 30.0, started=False),
    })
    under = Instance("under")
    under.add(Job(4, 100, 500.0, generated=10, started=True, first_token_at=0.0))
    under.finish(4)  # finished at 10 of a predicted 500: overestimated
    moves = rebalance([over, under], lim, now=1.0)
    assert moves and all(m.src == 0 and m.dst == 1 for m in moves)
    assert {m.rid for m in moves} <= {2, 3} and 1 in over.jobs
    assert all(m.rid in under.jobs and m.rid not in over.jobs for m in moves)
    assert rebalance([over, under], lim, now=2.0) == []  # each error is acted on once
    assert over.jobs[1].started and 1 not in under.jobs


@pytest.mark.unit
def test_length_history_conditional_mean_and_window():
    h = LengthHistory(window=5)
    for x in (10, 20, 30, 40, 50, 60):
        h.add(x)
    assert len(h) == 5  # 10 fell out of the window
    assert h.mean_beyond(25) == pytest.approx(np.mean([30, 40, 50, 60]))
    assert h.mean_beyond(60) is None
    assert h.repredict(predicted=35, generated=45) == pytest.approx(55.0)
    assert h.repredict(predicted=100, generated=70) == 140.0  # nothing longer seen: doubling


@pytest.mark.unit
def test_scaling_fit_recovers_a_linear_history_and_refuses_one_rate():
    fit = fit_scaling([(2, 2), (4, 3), (6, 4), (8, 5)])
    assert fit.k5 == pytest.approx(0.5) and fit.c5 == pytest.approx(1.0) and fit.r2 == pytest.approx(1.0)
    assert fit.recommend(7) == 5 and fit.recommend(0) == 1
    with pytest.raises(ValueError, match="two or more distinct rates"):
        fit_scaling([(4, 3), (4, 3)])


@pytest.fixture(scope="module")
def setup(data):
    need_files(*NEEDS)
    return build_setup(SCENARIOS["ecoserve-paper"], max_requests=300)


def test_cluster_of_one_is_the_single_instance_simulator(setup):
    reqs = setup.at_rate(1.3)
    one = simulate(reqs, setup.predictions, "vllm", setup.config, setup.kv_blocks, setup.latency, setup.slo,
                   repredict=setup.predictor.repredict)
    for name in ("jsq", "aladdin"):
        m = simulate_cluster(reqs, setup.predictions, ClusterConfig(1, name), setup.config, setup.kv_blocks, setup.latency,
                             setup.slo, repredict=setup.predictor.repredict)
        for k in ("slo_attainment", "ttft_tpot_attainment", "jct_p99_s", "makespan_s", "preemptions", "steps"):
            assert getattr(m, k) == getattr(one, k), k


@pytest.mark.parametrize("name,gateways,local", [("aladdin", 1, "vllm"), ("lengthwise", 1, "lengthwise"), ("p2c", 1, "vllm"),
                                                  ("lengthwise-pack", 1, "vllm"), ("lengthwise-pack", 3, "vllm"),
                                                  ("aladdin", 3, "vllm"), ("jsq", 2, "sjf")])
def test_cluster_places_every_request_once_and_is_deterministic(setup, name, gateways, local):
    reqs = setup.at_rate(5.0)
    cc = ClusterConfig(3, name, local, gateways=gateways, refresh_s=0.5, rebalance_s=0.25)
    runs = [simulate_cluster(reqs, setup.predictions, cc, setup.config, setup.kv_blocks, setup.latency, setup.slo,
                             repredict=setup.predictor.repredict, check=True) for _ in range(2)]
    m = runs[0]
    assert m.requests_completed == m.requests_total == len(reqs)
    assert sum(m.extra["per_instance_requests"]) == len(reqs)
    assert m.extra["placement_stats"]["placed"] == len(reqs)
    a, b = (r.to_dict() for r in runs)
    for d in (a, b):
        d.pop("wall_s"), d.pop("sim_requests_per_s"), d.pop("sched_us_per_step")
    assert a == b


def _bench_placement(out: Path, *args: str, scenario: str = "sharegpt") -> tuple[subprocess.CompletedProcess, dict]:
    """``lengthwise bench placement`` on a small fleet (ShareGPT's by default), its JSON written to ``out``: (the run,
    the JSON)."""
    r = lengthwise("bench", "placement", "--scenario", scenario, "--instances", "2", *args, "--json", str(out))
    assert r.returncode == 0, r.stderr
    return r, json.loads(out.read_text())


def _assert_fewest_instances(p: dict) -> None:
    """(a) found a count: it attains >= 99% and one instance fewer, where tried, does not."""
    n = p["instances_needed"]
    assert isinstance(n, int) and n >= 1, p
    assert p["tried"][str(n)] >= 0.99
    if str(n - 1) in p["tried"]:
        assert p["tried"][str(n - 1)] < 0.99


def test_bench_placement_cli_writes_the_contract_and_scale_reads_it(data, tmp_path):
    need_files(*NEEDS)
    out = tmp_path / "p.json"
    r, d = _bench_placement(out, "--max-requests", "150", "--placements", "jsq,aladdin", "--gateways", "1,2")
    for name in ("jsq", "aladdin"):
        p = d["policies"][name]
        _assert_fewest_instances(p)
        assert p["max_rate_at_90_slo"] > 0 and set(p["gateways"]) == {"1", "2"}
    assert d["scenarios"]["sharegpt"]["_meta"]["rate_a"] > 0
    assert (tmp_path / "p_sharegpt.png").stat().st_size > 10_000
    assert "(a) instances" in r.stdout
    # Eq. 7 is fitted for both placements (three (a) scans at rising rates), and `scale` reads each fit back
    assert {k for k, v in d["scaling"].items() if "k5" in v} == {"jsq", "aladdin"}
    for name in ("jsq", "aladdin"):
        s = lengthwise("scale", "--from", str(out), "--placement", name, "--rate", "3")
        assert s.returncode == 0 and "instances for 3 req/s" in s.stdout, s.stderr


def test_bench_placement_measures_a_alone_skips_b_and_eq7(data, tmp_path):
    need_files(*NEEDS)
    r, d = _bench_placement(tmp_path / "a.json", "--max-requests", "120", "--placements", "jsq,lengthwise", "--measures", "a")
    assert d["_meta"]["measures"] == ["a"] and d["scaling"] == {}
    for p in d["policies"].values():
        assert p["max_rate_at_90_slo"] is None and p["curve"] == []
        _assert_fewest_instances(p)
    assert "(a) instances" in r.stdout and "Eq. 7" not in r.stdout
    assert d["floor"] is None and "fluid floor" not in r.stdout  # a colocated fleet: prompt compute is not modelled


def test_bench_placement_reports_a_decode_pools_fluid_floor_and_no_placement_beats_it(data, tmp_path):
    """The floor's mean is the fluid model's bound: a fleet much smaller than it cannot keep requests on pace."""
    need_files(*NEEDS)
    r, d = _bench_placement(tmp_path / "d.json", "--max-requests", "150", "--placements", "jsq,least-kv,lengthwise",
                            "--measures", "a", scenario="sharegpt-decode")
    fl = d["floor"]
    assert fl["rate"] == d["_meta"]["rate_a"] and 0 < fl["mean"] < fl["peak"] and fl["window_s"] > 0
    for p in d["policies"].values():
        assert p["instances_needed"] >= fl["mean"]
        assert p["over_floor"] == pytest.approx(p["instances_needed"] / fl["mean"])
    assert "fluid floor" in r.stdout and "over the mean" in r.stdout


@pytest.mark.unit
@pytest.mark.parametrize("args,message", [
    (["bench", "placement", "--placements", "jsq,nope"], "unknown placement"),
    (["bench", "placement", "--measures", "b"], "includes a"),
    (["bench", "placement", "--measures", "a,c"], "--measures"),
    (["bench", "placement", "--instances", "0"], "--instances"),
    (["bench", "placement", "--gateways", "0"], "gateway replicas"),
    (["bench", "placement", "--local-policy", "fifo-magic"], "unknown policy"),
    (["bench", "placement", "--rate", "-1"], "--rate"),
    (["scale", "--points", "4:3", "--rate", "5"], "two or more distinct rates"),
    (["scale", "--points", "4-3,5-4", "--rate", "5"], "RATE:INSTANCES"),
    (["scale", "--from", "/nonexistent.json", "--rate", "5"], "not found"),
    (["bench", "fleet", "--placements", "jsq,nope"], "unknown placement"),
    (["bench", "fleet", "--kv-blocks", "8"], "--kv-blocks"),
    (["bench", "fleet", "--predictor", "models:/length-predictor@champion"], "not supported here"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    r = run_main(main, args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.unit
def test_scale_from_points():
    r = lengthwise("scale", "--points", "2:2,4:3,6:4,8:5", "--rate", "7")
    assert r.returncode == 0 and r.stdout.startswith("5 instances for 7 req/s"), r.stdout + r.stderr


def test_decode_pool_scenarios_keep_the_colocated_slo_and_drop_prompt_compute(data):
    need_files(*NEEDS)
    from serving.bench.placement.scenarios import build_placement_setup
    from serving.perf.latency import DecodePoolLatency, StepShape

    colocated = build_placement_setup("sharegpt", max_requests=40)
    pool = build_placement_setup("sharegpt-decode", max_requests=40)
    assert isinstance(pool.latency, DecodePoolLatency) and not isinstance(colocated.latency, DecodePoolLatency)
    assert (pool.slo.ttft_s, pool.slo.tpot_s) == (colocated.slo.ttft_s, colocated.slo.tpot_s)
    assert pool.kv_blocks == colocated.kv_blocks and \
        [r.prompt_tokens for r in pool.requests] == [r.prompt_tokens for r in colocated.requests]
    chunk = StepShape.of(prefill_chunks=[(0, 2048)], decode_contexts=[500] * 8)
    assert pool.latency.step_time(chunk) < colocated.latency.step_time(chunk) / 2
    assert "decode pool" in pool.scenario.description
    synthetic = build_placement_setup("mooncake-synthetic-decode", max_requests=40)
    conversation = build_placement_setup("mooncake-decode", max_requests=40)
    assert isinstance(synthetic.latency, DecodePoolLatency) and synthetic.scenario.arrival == "trace"
    assert [r.prompt_tokens for r in synthetic.requests] != [r.prompt_tokens for r in conversation.requests]
