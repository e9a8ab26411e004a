"""Several services in one engine for ``bench engine --services``: the trace of each service's own relabelled lengths,
its out-of-fold predictions, and (slow) the bench on the real engine with a LoRA adapter per service."""

from __future__ import annotations

import json
import lzma
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from serving.bench.engine.services import (
    SMOLLM2_SERVICES,
    VARIANTS,
    ServicesError,
    load_services,
    parse_services,
)
from serving.cli import main
from serving.sim.predictions import GivenPredictions
from tests.conftest import SHAREGPT
from tests.datafiles import need_data


def _subset(src: Path, out: Path, prompts: int) -> Path:
    """The first ``prompts`` prompts of a committed label file (every sample of each)."""
    keep: set[str] = set()
    rows = []
    with lzma.open(src, "rt") as f:
        for line in f:
            rec = json.loads(line)
            if rec["prompt_hash"] not in keep and len(keep) >= prompts:
                continue
            keep.add(rec["prompt_hash"])
            rows.append(line)
    out.write_text("".join(rows))
    return out


@pytest.fixture(scope="module")
def small_services(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("services")
    return {name: _subset(f, d / f"{name}.jsonl", 60) for name, f in SMOLLM2_SERVICES.items()}


@pytest.mark.unit
def test_the_spec_names_a_base_and_its_adapters_or_is_refused_in_one_line():
    assert parse_services("smollm2") == SMOLLM2_SERVICES and next(iter(SMOLLM2_SERVICES)) == "base"
    assert parse_services("a=x.jsonl, b=y.jsonl") == {"a": Path("x.jsonl"), "b": Path("y.jsonl")}
    for bad, said in (("a", "not NAME=LABELS"), ("a=x", "a base and at least one adapter"),
                      ("a=x,a=y", "named twice"), ("=x,b=y", "not NAME=LABELS")):
        with pytest.raises(ServicesError, match=said):
            parse_services(bad)


@pytest.mark.unit
def test_each_request_is_one_of_its_services_own_answers_predicted_by_folds_that_never_saw_it(small_services, data,
                                                                                             tmp_path):
    from training.data.served import read_served

    trace = load_services(small_services, need_data(SHAREGPT), 90, seed=3, max_model_len=2048, cache=tmp_path / "cache")
    reqs = trace.requests
    assert trace.base == "base" and len(reqs) == 90 and [r.rid for r in reqs] == list(range(90))
    counts = Counter(r.service for r in reqs)
    assert set(counts) == set(small_services) and min(counts.values()) >= 15  # drawn uniformly over services
    samples = {}
    for name, f in small_services.items():
        for rec in read_served(f)[0]:
            samples.setdefault((name, rec["prompt_tokens"]), set()).add(min(512, max(1, rec["response_tokens"])))
    for r in reqs:  # the service's own length of a prompt it answered (a capped sample at the cap), its prompt's size
        assert r.output_tokens in samples[(r.service, r.prompt_tokens)] and r.prompt_tokens + 512 + 16 <= 2048
    assert set(trace.predictions) == set(VARIANTS)
    for preds in trace.predictions.values():
        assert len(preds) == 90 and all(1 <= p.length <= 512 and abs(sum(p.probs) - 1) < 1e-6 for p in preds)
    terse = np.mean([p.length for p, r in zip(trace.predictions["model-mean"], reqs) if r.service == "smollm2-terse"])
    base = np.mean([p.length for p, r in zip(trace.predictions["model-mean"], reqs) if r.service == "base"])
    assert terse < 100 < base  # each service's profile is its own: the terse adapter's answers are short
    # a second load reads the predictions back instead of fitting them again, and draws the same trace
    assert len(list((tmp_path / "cache").glob("folds-*.npz"))) == 1
    again = load_services(small_services, need_data(SHAREGPT), 90, seed=3, max_model_len=2048, cache=tmp_path / "cache")
    assert again.requests == reqs and again.predictions["tfidf"] == trace.predictions["tfidf"]
    given = GivenPredictions("folds:tfidf", {r.rid: p for r, p in zip(reqs, trace.predictions["tfidf"])})
    assert given.predict(reqs[::-1]) == trace.predictions["tfidf"][::-1]
    not_sharegpt = tmp_path / "lines.jsonl"
    not_sharegpt.write_text('{"a": 1}\n{"a": 2}\n')
    with pytest.raises(ServicesError, match="is not a ShareGPT JSON file"):  # one line, as the CLI prints it
        load_services(small_services, not_sharegpt, 10, 0, 2048, cache=tmp_path / "cache")
    few = tmp_path / "few.json"  # a prompt set none of the labels' prompts is in
    few.write_text(json.dumps([{"id": "x", "conversations": [{"from": "human", "value": "Hi there"},
                                                              {"from": "gpt", "value": "Hello"}]}]))
    with pytest.raises(ServicesError, match="no labelled prompt"):
        load_services(small_services, few, 10, 0, 2048, cache=tmp_path / "cache")


@pytest.mark.slow  # the default tier's counterparts: the trace above and test_bench_engine_runs_one_pair_on_the_real_engine
@pytest.mark.timeout(900)
def test_bench_engine_serves_the_services_with_an_adapter_each_on_the_real_engine(small_services, tmp_path):
    """Stock vLLM and the plug-in (and seallm) on one engine each, every adapter service's requests through its own
    LoRA adapter: every request ends at exactly its service's length, and each run reports attainment per service."""
    out = tmp_path / "services.json"
    spec = ",".join(f"{n}={f}" for n, f in small_services.items())
    code = main(["bench", "engine", "--services", spec, "--predictor", "folds:tfidf", "--ablation", "seallm",
                 "--max-requests", "12", "--rates", "1", "--calibration-requests", "8", "--no-swap-cores",
                 "--max-model-len", "1024", "--kv-blocks", "40", "--json", str(out)])
    assert code == 0
    d = json.loads(out.read_text())
    assert set(d["services"]) == set(small_services) and sum(s["requests"] for s in d["services"].values()) == 12
    assert set(d["config"]["service_adapters"]) == {"smollm2-terse", "smollm2-detailed"}
    for arm in ("lengthwise", "seallm"):
        pair = d["points"][0]["arms"][arm]
        for run in (pair["stock"], pair["run"]):
            assert run["requests_completed"] == 12 and run["extra"]["wrong_or_lost"] == 0
            assert set(run["extra"]["per_service"]) == set(small_services)
    jobs = [json.loads(p.read_text()) for p in Path(d["work_dir"]).glob("*.job.json")]
    assert jobs and all(j["engine"]["loras"] == d["config"]["service_adapters"] for j in jobs)
    loras = {r.get("lora") for j in jobs for r in j["requests"]}
    assert loras == {None, "smollm2-terse", "smollm2-detailed"}  # the base's requests run without one
