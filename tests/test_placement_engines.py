"""A plan of one base's services on its engines: the placement by predicted load, the catalogue that lays it on real
engines (``on_engines``), and the simulator placing each request only among its service's instances."""

from __future__ import annotations

import dataclasses
import json

import pytest

from serving.bench.fleet import bench_engine_args
from serving.bench.models.onengines import BASE, OnEnginesConfig, plan_catalogue
from serving.gateway.settings import GatewaySettings
from serving.perf.latency import FittedLatency
from serving.placement.models.engines import SPLIT_ABOVE, ServiceLoad, everywhere, place_services, service_work
from serving.sim.cluster import ClusterConfig, simulate_cluster
from serving.sim.engine import SimulationError
from serving.sim.scenarios import SCENARIOS, build_setup
from tests.datafiles import need_files

# a vLLM-CPU engine's step model as the on-engines bench fitted it (5.6 ms a step, 0.4 ms a prompt token, 1.8 ms a decode)
CPU = FittedLatency(5.6e-3, 4.0e-4, 1.8e-3, 2.7e-7)


def _services(base: float = 340, detailed: float = 280, terse: float = 55, rate: float = 0.33) -> list[ServiceLoad]:
    return [ServiceLoad("smollm2", rate, 690, base), ServiceLoad("detailed", rate, 650, detailed),
            ServiceLoad("terse", rate, 600, terse)]


@pytest.mark.unit
def test_services_are_laid_by_predicted_load_the_heaviest_apart():
    plan = place_services(_services(), 2, CPU, 256)
    assert plan.serves == (("smollm2",), ("detailed", "terse"))  # 0.34 + 0.28 + 0.05 of a load: the base alone
    assert plan.on_engines("terse") == [1] and plan.on_engines("smollm2") == [0]
    # the same truths, other predictions: a detailed adapter predicted longest is the one kept apart
    flipped = place_services(_services(base=280, detailed=340), 2, CPU, 256)
    assert flipped.serves == (("detailed",), ("smollm2", "terse"))


@pytest.mark.unit
def test_a_service_past_its_fair_share_is_split_and_no_engine_stands_idle():
    heavy = [ServiceLoad("big", 2.0, 600, 400), ServiceLoad("small", 0.1, 600, 30)]
    plan = place_services(heavy, 3, CPU, 256)
    work = {s.name: service_work(s, CPU, plan.batch) for s in heavy}
    fair = sum(work.values()) / 3
    assert work["big"] > SPLIT_ABOVE * fair
    assert plan.on_engines("big") == [0, 1, 2]  # over every engine, the small one beside one piece of it
    assert len(plan.on_engines("small")) == 1
    one = place_services([ServiceLoad("only", 1.0, 600, 200)], 2, CPU, 256)
    assert one.serves == (("only",), ("only",))  # one service, two engines: split, not one engine idle
    assert everywhere(heavy, 2).serves == (("big", "small"), ("big", "small"))
    with pytest.raises(ValueError, match="at least one engine"):
        place_services(heavy, 0, CPU, 256)


@pytest.mark.unit
def test_the_plans_catalogue_starts_the_engines_it_says(tmp_path):
    """What ``bench models --on-engines`` hands ``lengthwise serve --models``: read back as the gateway reads it, the
    base is started on both engines with its own name placed on engine 0 only, both adapters loaded on engine 1 only."""
    from serving.launch.engines import engine_args as vllm_args

    adapters = {}
    for name in ("detailed", "terse"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": 8}))
        adapters[name] = tmp_path / name
    plan = dataclasses.replace(place_services(_services(), 2, CPU, 256), serves=(("smollm2",), ("detailed", "terse")))
    f = tmp_path / "catalogue.yaml"
    f.write_text(json.dumps(plan_catalogue(plan, "./m", adapters, bench_engine_args(OnEnginesConfig(), "float32"))))
    s = GatewaySettings(models_file=f)
    assert s.catalogue.engine_names(BASE) == [["smollm2"], ["detailed", "terse"]]
    groups = s.engine_groups()
    assert [g.engines for g in groups] == [1, 1]
    assert "--enable-lora" not in vllm_args(groups[0]) and "--enable-lora" in vllm_args(groups[1])
    every = plan_catalogue(everywhere(_services(), 2), "./m", adapters, [])
    assert all("on_engines" not in m for m in every["models"])  # on every engine: nothing to say


@pytest.fixture(scope="module")
def setup(data):
    # the ecoserve-paper scenario's workload and tokenizer
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    return build_setup(SCENARIOS["ecoserve-paper"], max_requests=120)


def test_the_simulator_places_a_request_only_on_its_services_instances(setup):
    reqs = [dataclasses.replace(r, service="a" if r.rid % 3 else "b") for r in setup.at_rate(2.0)]
    run = lambda serves: simulate_cluster(reqs, setup.predictions, ClusterConfig(2, "jsq", serves=serves), setup.config,
                                          setup.kv_blocks, setup.latency, setup.slo, repredict=setup.predictor.repredict)
    apart = run((frozenset({"a"}), frozenset({"b"})))
    assert apart.extra["per_instance_requests"] == [sum(r.service == "a" for r in reqs), sum(r.service == "b" for r in reqs)]
    assert apart.requests_completed == len(reqs)
    shared = run(None)
    assert min(shared.extra["per_instance_requests"]) > sum(r.service == "b" for r in reqs) / 2  # JSQ spreads both
    with pytest.raises(SimulationError, match="no instance serves 'b'"):
        run((frozenset({"a"}), frozenset({"a"})))
    with pytest.raises(ValueError, match="serves names 1 instances"):
        ClusterConfig(2, "jsq", serves=(frozenset({"a"}),))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_plan_is_served_on_real_engines_as_it_says(data, tmp_path):
    """``bench models --on-engines`` end to end on vLLM-CPU: the plan's catalogue started by ``lengthwise serve --models``
    places the base only on its engine and both adapters only on theirs, every answer ends at its true length, and each
    model's attainment stands beside the simulator's. (The fast counterparts: the plan, its catalogue and the
    simulator's placement above.)"""
    need_files("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz", "tokenizers/gpt2/tokenizer.json")
    from serving.cli import main
    from tests.cli_inproc import run_main

    out = tmp_path / "on_engines.json"
    r = run_main(main, ["bench", "models", "--on-engines", "--plans", "lengthwise", "--requests", "12", "--rate", "1",
                        "--json", str(out)])
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())["plans"]["lengthwise"]
    assert res["real"]["wrong_or_lost"] == 0 and not res["real"]["errors"]
    where = {m: set(e) for m, e in res["real"]["engines_per_model"].items()}
    for name, engines in where.items():
        assert engines == {f"engine-{i}" for i, names in enumerate(res["serves"]) if name in names}, (name, res)
    assert set(res["real"]["per_model"]) == set(res["sim"]["per_model"]) == set(where)
