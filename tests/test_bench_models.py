"""``lengthwise bench models --fidelity``: MuxServe's placements and measurements read as published, our simulator run
on them, and the comparison's contract (every model of every chosen level, its error against the measured figure)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from serving.bench.models.fidelity import COMPARED, Engine, FidelityConfig, fidelity, kv_shares, summary
from serving.bench.models.muxserve import SYSTEMS, load_levels, load_placement
from serving.cli import main
from serving.perf.hardware import get_model, kv_blocks
from tests.cli_inproc import run_main
from tests.datafiles import need_files

# MuxServe's trace; lengths from ShareGPT's or AlpacaEval's answers in Llama-2 tokens (serving/bench/models/lengths.py)
NEEDS = ("traces/muxserve_chatlmsys_day55.json", "prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz",
         "prompts/alpaca_eval_model_outputs.62models.jsonl.xz", "tokenizers/llama2/tokenizer.model")


def test_each_level_places_its_sixteen_models_once_per_system_within_the_cluster(data):
    need_files(*NEEDS)
    levels = load_levels()
    assert list(levels) == ["condense500", "condense800", "condense1200", "condense1600", "condense2000"]
    for name, level in levels.items():
        assert len(level.models) == 16 and level.cluster_gpus == 32
        sizes = {m.name: m.size for m in level.models}
        for system in SYSTEMS:
            units = load_placement(name, system)
            placed = [m for u in units for m in u.models]
            assert sorted(m.name for m in placed) == sorted(sizes), (name, system)
            assert all(m.size == sizes[m.name] and m.tp == u.gpus for u in units for m in u.models)
            assert sum(u.gpus for u in units) <= 32
            for u in units:  # the KV share of the mesh and every model's weights fit its memory (MuxServe's reading)
                weights = sum(get_model(m.size).weight_bytes() for m in u.models)
                assert weights + u.kv_fraction * u.gpus * 80 * 2**30 <= u.gpus * 80 * 2**30, (name, system, u)
    assert levels["condense500"].total_rate == pytest.approx(47.5, abs=0.5)
    # a model's mean tokens per request is its requests' own: the same at every level
    assert {round(lv.tokens_per_request("llm-3"), 6) for lv in levels.values()} == {209.443535}
    assert levels["condense2000"].total_rate == pytest.approx(190, abs=1)


def test_a_spatial_level_is_simulated_per_model_against_its_measured_figures(data):
    need_files(*NEEDS)
    level = load_levels()["condense500"]
    cfg = FidelityConfig(lengths_limit=1500, replays=1)
    rows = fidelity(level, "spatial", cfg)
    assert len(rows) == 16
    for name, r in rows.items():
        sim, measured = r["simulated"], r["measured"]
        assert sim["requests"] == measured["requests"] == sim["completed"], name
        # each model's own mean tokens per request, as MuxServe's tokens/s over its requests/s give it
        assert sim["mean_prompt_tokens"] + sim["mean_output_tokens"] == pytest.approx(level.tokens_per_request(name),
                                                                                      rel=0.02)
        for k in COMPARED:
            assert r["error"][k] == pytest.approx(sim[k] / measured[k] - 1)
    # a slower engine (a third of the bandwidth, a TP cost) decodes slower: every model's mean TPOT rises
    slow = fidelity(level, "spatial", FidelityConfig(lengths_limit=1500, replays=1,
                                                     engine=Engine(mbu=0.27, tp_overhead_s=0.02)))
    assert all(slow[n]["simulated"]["tpot_mean_s"] > rows[n]["simulated"]["tpot_mean_s"] for n in rows)
    s = summary(rows)
    assert set(s) == set(COMPARED) and all(v["models"] == 16 and 0 <= v["within"] <= 1 for v in s.values())
    assert s["throughput_rps"]["within_noise"] >= s["throughput_rps"]["within"]
    total = sum(r["simulated"]["throughput_rps"] for r in rows.values()) / sum(r["measured"]["throughput_rps"]
                                                                                for r in rows.values())
    assert s["throughput_rps"]["total_error"] == pytest.approx(total - 1)
    # MuxServe's shared meshes: each model with its MPS shares and its part of the KV pool, slower than alone
    flex = fidelity(level, "flexsm", cfg)
    shared = {n: r for n, r in flex.items() if r["shares_mesh_with"]}
    assert shared and all(r["simulated"]["completed"] == r["measured"]["requests"] for r in shared.values())
    units = load_placement(level.name, "flexsm")
    for u in units:
        if len(u.models) > 1:
            shares = kv_shares(u, level)
            assert sum(shares.values()) == pytest.approx(1) and all(0 < v < 1 for v in shares.values())
            blocks = [flex[m.name]["simulated"]["kv_blocks"] for m in u.models]
            alone = kv_blocks(get_model(u.models[0].size), u.kv_fraction * u.gpus * 80 * 2**30, 16)
            assert blocks[0] < alone


def test_the_cli_writes_the_tables_json_and_plot(data, tmp_path):
    need_files(*NEEDS)
    out = tmp_path / "fid.json"
    r = run_main(main, ["bench", "models", "--fidelity", "--levels", "condense500", "--calibrate-on", "none",
                        "--first-turns", "1500", "--replays", "1", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    run = res["levels"]["condense500"]["spatial"]["roofline"]
    assert set(res["levels"]["condense500"]) == {"spatial", "flexsm", "temporal"}
    assert len(run["models"]) == 16 and run["held_out"] and "calibration" not in res
    assert out.with_suffix(".png").stat().st_size > 10_000 and "summary: median |error|" in r.stdout


@pytest.mark.parametrize("argv,said", [
    (["--levels", "condense9"], "unknown level 'condense9'"),
    (["--calibrate-on", "nope"], "unknown level 'nope'"),
    (["--first-turns", "5"], "--first-turns needs at least 100"),
    (["--replays", "0"], "--replays must be at least 1"),
    (["--systems", "spatial,alpaserve"], "unknown system 'alpaserve'"),
])
def test_bad_arguments_exit_2_with_one_line(argv, said):
    need_files(*NEEDS)  # the levels and systems are checked against MuxServe's file
    r = run_main(main, ["bench", "models", "--fidelity", *argv])
    assert r.returncode == 2 and said in r.stderr and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr


def test_spatial_sizing_gives_each_model_the_fewest_gpus_that_keep_it_at_the_target(data):
    need_files(*NEEDS)
    import dataclasses

    from serving.bench.models.sizing import size_spatial, smallest_mesh

    assert [smallest_mesh(s) for s in ("llama-7b", "llama-13b", "llama-30b", "llama-65b")] == [1, 1, 1, 2]
    level = load_levels()["condense2000"]
    by = {m.name: m for m in level.models}
    # a quiet 7B, and the busiest 13B at its own rate and at a tenth of it
    quiet = dataclasses.replace(level, models=(by["llm-7"], by["llm-1"],
                                               dataclasses.replace(by["llm-1"], rate=by["llm-1"].rate / 10)))
    cfg = FidelityConfig(lengths_limit=1500, replays=1, engine=Engine(mbu=0.35, tp_overhead_s=0.01))
    seen = []
    sized = size_spatial(quiet, cfg, duration_s=60, on_model=seen.append)
    assert seen == sized and all(s.attainment >= 0.99 for s in sized)
    seven, busy, tenth = sized
    assert seven.total_gpus == 1 and tenth.total_gpus == 1
    assert busy.total_gpus > 1  # 32 req/s of a 13B do not fit one A100 at this SLO


def test_the_gpus_needed_cli_sizes_spatial_and_ours_beside_what_muxserve_ran_on(data, tmp_path):
    need_files(*NEEDS)
    out = tmp_path / "gpus.json"
    r = run_main(main, ["bench", "models", "--gpus-needed", "--levels", "condense500", "--calibrate-on", "none",
                        "--placements", "spatial,lengthwise", "--first-turns", "1500", "--replays", "1",
                        "--duration", "20", "--json", str(out)])
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    e = res["levels"]["condense500"]
    assert e["muxserve_ran_on"] == {"flexsm": 28, "spatial": 32, "temporal": 28}
    sp = e["placements"]["spatial"]
    assert len(sp["models"]) == 16 and sp["gpus"] == sum(m["total_gpus"] for m in sp["models"])
    assert sp["gpus"] <= sp["every_model_at_target"] and sp["min_attainment"] >= 0.9
    ours = e["placements"]["lengthwise"]
    assert e["fewest_possible"] <= ours["gpus"] <= ours["given"] <= 64
    assert ours["plan"]["gpus"] == ours["gpus"] and ours["tried"][str(ours["given"])]["passes"]
    met = sum(m["met"] for m in ours["models"].values()) / sum(m["requests"] for m in ours["models"].values())
    assert met >= 0.99 and min(m["attainment"] for m in ours["models"].values()) >= 0.9
    assert {m["name"] for u in ours["plan"]["units"] for m in u["models"]} == {f"llm-{k}" for k in range(1, 17)}
    assert res["setting"]["engine"]["name"] == "roofline" and out.with_suffix(".png").stat().st_size > 10_000
    bad = run_main(main, ["bench", "models", "--gpus-needed", "--placements", "alpaserve"])
    assert bad.returncode == 2 and "unknown placement 'alpaserve'; built: spatial, muxserve" in bad.stderr
    bad = run_main(main, ["bench", "models", "--gpus-needed", "--arrival-cv", "0"])
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--arrival-cv must be between 0 and 100" in bad.stderr


def test_bursty_arrivals_keep_the_rate_and_spread_their_gaps():
    import numpy as np

    from serving.sim.engine import poisson_arrivals

    poisson, bursty = poisson_arrivals(20_000, 5.0, 3), poisson_arrivals(20_000, 5.0, 3, cv=4.0)
    for times, cv in ((poisson, 1.0), (bursty, 4.0)):
        gaps = np.diff(times)
        assert times[0] == 0.0 and gaps.mean() == pytest.approx(0.2, rel=0.1)
        assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    with pytest.raises(ValueError, match="cv must be a positive number"):
        poisson_arrivals(10, 5.0, 3, cv=0.0)


def test_spatial_is_allocated_at_the_fleets_criterion_from_each_models_curve():
    from serving.bench.models.sizing import Sized, allocate

    # a busy model whose second GPU brings it from 92% to 100%, and a quiet one already at 95% on one
    busy = Sized("busy", "llama-13b", 1, 2, 1.0, ((1, 1, 0.92), (1, 2, 1.0)))
    quiet = Sized("quiet", "llama-7b", 1, 2, 0.99, ((1, 1, 0.95), (1, 2, 0.99)))
    rates = {"busy": 9.0, "quiet": 1.0}
    got = {s.model: s.total_gpus for s in allocate([busy, quiet], rates, 0.99, 0.90)}
    assert got == {"busy": 2, "quiet": 1}  # 9 x 1.0 + 1 x 0.95 over 10 = 99.5%: the quiet model's second GPU is spared
    assert {s.model: s.total_gpus for s in allocate([busy, quiet], rates, 0.90, 0.90)} == {"busy": 1, "quiet": 1}


def test_the_alpaca_eval_variant_gives_each_model_a_different_llms_lengths(data):
    need_files(*NEEDS)
    from serving.bench.models.fidelity import requests_for
    from serving.bench.models.lengths import alpaca_generators

    gens = alpaca_generators(16)
    assert len(set(gens)) == 16
    level = load_levels()["condense500"]
    cfg = FidelityConfig(lengths="alpaca-eval")
    means = {m.name: sum(r.output_tokens for r in requests_for(300, 1.0, cfg, k, level, m.name)) / 300
             for k, m in enumerate(level.models[:4])}
    assert max(means.values()) > 1.5 * min(means.values())  # the models answer as differently long LLMs do


def test_seallms_placement_grows_its_plan_by_the_unserved_index_its_simulator_scores(data):
    need_files(*NEEDS)
    import dataclasses

    from serving.bench.models.placing import predicted_demands, seallm_score
    from serving.placement.models.seallm import MAX_SHARED, place_seallm

    full = load_levels()["condense500"]
    by = {m.name: m for m in full.models}
    level = dataclasses.replace(full, models=tuple(by[n] for n in ("llm-4", "llm-7", "llm-12", "llm-13")))
    cfg = FidelityConfig(lengths_limit=1500, replays=1, engine=Engine(mbu=0.35, tp_overhead_s=0.01))
    calls: list[int] = []
    score = seallm_score(level, cfg, window_s=20)

    def counted(units):
        calls.append(len(units))
        return score(units)
    plan = place_seallm(predicted_demands(level, cfg), 4, counted, 20)
    assert plan is not None and plan.gpus <= 4 and plan.notes["scored_plans"] == len(calls) > 4
    shares: dict[str, float] = {}
    for u in plan.units:
        assert 1 <= len(u.models) <= MAX_SHARED
        for m in u.models:
            shares[m.name] = shares.get(m.name, 0.0) + m.rate_share
    assert shares == pytest.approx({n: 1.0 for n in ("llm-4", "llm-7", "llm-12", "llm-13")})
    assert plan.notes["tp"] in (1, 2, 4) and 0 <= plan.notes["estimated_attainment"] <= 1
    assert place_seallm(predicted_demands(level, cfg), 1, score, 20) is None  # four services, two to a GPU at most


# --- rates drifting: placing again -----------------------------------------------------------------------------------
def test_seallms_interval_shrinks_when_its_estimate_misses_and_grows_when_it_holds():
    """SeaLLM §4.3, Eq. 8, with beta 0.2: off by more than 20% of the estimate, x0.8; within, x1.2."""
    from serving.placement.models.replace import AdaptiveInterval

    i = AdaptiveInterval(100.0, beta=0.2)
    assert i.next(real=0.70, estimated=0.95) == pytest.approx(80.0)  # 26% off
    assert i.next(real=0.90, estimated=0.95) == pytest.approx(96.0)  # 5% off
    with pytest.raises(ValueError, match="beta is in"):
        AdaptiveInterval(100.0, beta=1.5)


def test_drifting_levels_keep_the_total_rate_and_the_decisions_read_only_the_past(data):
    need_files(*NEEDS)
    from serving.bench.models.drift import DriftConfig, arrivals, decide, drifted_levels, observed, simulate_timeline
    from serving.bench.models.fidelity import FidelityConfig
    from serving.bench.models.muxserve import load_levels
    from serving.bench.models.placing import Criterion, predicted_demands

    level = load_levels()["condense500"]
    phases = drifted_levels(level, 3, seed=0)
    assert phases[0] is level
    for p in phases[1:]:
        assert sorted(m.rate for m in p.models) == sorted(m.rate for m in level.models)
        assert [m.rate for m in p.models] != [m.rate for m in level.models]
    cfg = FidelityConfig(lengths_limit=1500)
    stream = arrivals(phases, 90.0, cfg)
    busiest = max(level.models, key=lambda m: m.rate).name
    later = phases[1].models[[m.name for m in level.models].index(busiest)].rate
    lengths = predicted_demands(level, cfg)
    seen = {d.name: d.rate for d in observed(stream, lengths, 30.0, 90.0)}
    assert seen[busiest] == pytest.approx(phases[0].models[[m.name for m in level.models].index(busiest)].rate, rel=0.4)
    seen_later = {d.name: d.rate for d in observed(stream, lengths, 90.0, 150.0)}
    assert seen_later[busiest] == pytest.approx(max(later, 1 / 60), rel=0.6, abs=0.2)
    dc = DriftConfig(gpus=40, phases=2, phase_s=90.0, check_s=30.0, window_s=60.0, lag_s=30.0)
    static = decide("lengthwise-static", dc, level, stream, lengths, cfg, Criterion())
    moving = decide("lengthwise", dc, level, stream, lengths, cfg, Criterion())
    assert len(static) == 1 and static[0].plan.units == moving[0].plan.units  # the same first plan: phase 0's rates
    assert len(moving) > 1 and all(d.effective_at == d.decided_at + 30.0 for d in moving[1:])
    # the same plan decided twice is one mesh that keeps its queues: the same run as deciding it once
    once, _ = simulate_timeline(static, stream, level, cfg, 0.0, 60.0, Criterion(), seed=0)
    twice, _ = simulate_timeline([*static, dataclasses.replace(static[0], decided_at=20.0, effective_at=30.0)], stream,
                                 level, cfg, 0.0, 60.0, Criterion(), seed=0)
    assert once == twice
    assert sum(r["requests"] for r in once.values()) == sum(1 for v in stream.values() for r in v if r.arrival < 60.0)


@pytest.mark.slow
def test_the_drift_cli_writes_each_arms_attainment_and_plot(data, tmp_path):
    """The whole --drift run, short (fast counterparts: the decisions and the mesh lifetimes above, the exit-2 lines
    below)."""
    need_files(*NEEDS)
    out = tmp_path / "drift.json"
    r = run_main(main, ["bench", "models", "--drift", "--levels", "condense500", "--calibrate-on", "none", "--gpus", "40",
                        "--arms", "lengthwise", "--phases", "2", "--phase-s", "60", "--first-turns", "1500", "--json",
                        str(out)])
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert set(res["arms"]) == {"lengthwise"} and out.with_suffix(".png").is_file()
    row = res["arms"]["lengthwise"]
    assert 0 < row["attainment"] <= 1 and len(row["over_time"]) == 4
    assert sum(m["requests"] for m in row["models"].values()) == res["requests"]
    assert row["replacements"] == len(row["decisions"]) - 1 and row["decisions"][0]["at"] == 0.0


def test_the_drift_cli_says_a_bad_arm_or_too_few_gpus_in_one_line(data, tmp_path):
    need_files(*NEEDS)
    out = tmp_path / "drift.json"
    bad = run_main(main, ["bench", "models", "--drift", "--arms", "alpaserve"])
    assert bad.returncode == 2 and "unknown arm 'alpaserve'" in bad.stderr
    few = run_main(main, ["bench", "models", "--drift", "--levels", "condense500", "--calibrate-on", "none", "--gpus", "2",
                          "--arms", "lengthwise-static", "--first-turns", "1500", "--json", str(out)])
    assert few.returncode == 2 and "places nothing on 2 GPUs" in few.stderr
