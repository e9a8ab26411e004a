"""Workload loading (real traces and prompt sets in $LENGTHWISE_DATA) and simulated length predictions."""

from __future__ import annotations

import lzma
import shutil
from dataclasses import replace

import numpy as np
import pytest

from predictor.buckets import BucketScheme
from predictor.runtime import PredictionBatch
from serving.policy.request import Prediction
from serving.sim.predictions import (
    GaussianNoise,
    LogNormalNoise,
    ModelPredictor,
    PredictorSpecError,
    bucket_accuracy,
    make_predictor,
)
from serving.sim.workload import TraceRequest, WorkloadError, detect_format, load_workload
from tests.datafiles import need_data

AZURE = "traces/AzureLLMInferenceTrace_code_2023.csv"
MOONCAKE = "traces/mooncake_conversation_trace.jsonl"
LENGTHS = "traces/length_only/sharegpt_8k_filtered_stats_llama2_tokenizer.csv"
SHAREGPT = "prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"
ALPACA = "prompts/alpaca_eval_model_outputs.62models.jsonl.xz"


@pytest.fixture(scope="module")
def sharegpt(data):
    """300 ShareGPT first turns (parsing the whole file takes a few seconds, so once per module)."""
    return load_workload(need_data(SHAREGPT), rate=2.0, max_requests=300, max_prompt_tokens=2048, seed=1)


@pytest.fixture(scope="module")
def lengths(data):
    return load_workload(need_data(LENGTHS), rate=4.0, max_requests=2000)


# --- formats -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("rel, kind", [(AZURE, "azure"), (MOONCAKE, "mooncake"), (LENGTHS, "lengths"), (SHAREGPT, "sharegpt"),
                                       (ALPACA, "alpaca-eval"), ("traces/mooncake_synthetic_trace.jsonl", "mooncake")])
def test_detect_format_real_files(data, rel, kind):
    assert detect_format(need_data(rel)) == kind


def test_detect_format_ignores_the_name(data, tmp_path):
    renamed = tmp_path / "trace.txt"
    shutil.copy(need_data(AZURE), renamed)
    assert detect_format(renamed) == "azure"
    packed = tmp_path / "lengths.data"
    packed.write_bytes(lzma.compress((need_data(LENGTHS)).read_bytes()[:5000].rsplit(b"\n", 1)[0] + b"\n"))
    assert detect_format(packed) == "lengths"
    assert load_workload(packed, rate=1.0).kind == "lengths"


def test_azure_trace_arrivals(data):
    w = load_workload(need_data(AZURE), max_requests=500)
    assert (w.kind, w.has_timestamps, w.arrival, len(w.requests)) == ("azure", True, "trace", 500)
    r = w.requests
    assert r[0].arrival == 0.0 and r[0].prompt_tokens == 4808 and r[0].output_tokens == 10
    # second row is 0.052 s after the first (7-digit fractions parsed, not truncated to seconds)
    assert r[1].arrival == pytest.approx(0.052, abs=1e-6)
    arr = np.array([x.arrival for x in r])
    assert np.all(np.diff(arr) >= 0)
    assert [x.rid for x in r] == list(range(500))
    assert all(x.turns is None for x in r)


def test_azure_full_trace_matches_readme(data):
    w = load_workload(need_data(AZURE))
    assert len(w.requests) == 8819 and w.dropped == 0
    assert w.duration == pytest.approx(3436, abs=1)
    assert np.mean([x.prompt_tokens for x in w.requests]) == pytest.approx(2048, abs=1)


def test_mooncake_trace(data):
    w = load_workload(need_data(MOONCAKE), max_requests=1000)
    assert (w.kind, w.arrival, len(w.requests)) == ("mooncake", "trace", 1000)
    assert w.requests[0].prompt_tokens == 6758 and w.requests[0].output_tokens == 500
    assert w.requests[-1].arrival > 0


def test_mooncake_ticks_are_spread_not_bursts(data):
    """Mooncake stamps arrivals in 3-second ticks; requests sharing a tick are spread over it, counts kept."""
    import json

    raw = [json.loads(line)["timestamp"] / 1000.0 for line in (need_data(MOONCAKE)).open()][:1000]
    w = load_workload(need_data(MOONCAKE), max_requests=1000)
    arr = np.array([r.arrival for r in w.requests])
    assert len(set(raw)) < 200 and len(np.unique(arr)) == 1000       # ~9 requests per tick before, none tied after
    assert np.all(np.diff(arr) > 0) and [r.rid for r in w.requests] == list(range(1000))
    ticks = sorted(set(raw))
    per_tick = np.searchsorted(ticks, np.array(raw) - raw[0] + ticks[0], side="right")
    assert np.array_equal(np.searchsorted(np.array(ticks) - ticks[0], arr, side="right"), per_tick)  # each stays in its tick


@pytest.mark.unit
def test_spread_ties_unit():
    from serving.sim.workload import spread_ties

    assert spread_ties(np.array([0.0, 0.0, 3.0, 3.0, 3.0, 6.0])).tolist() == [0.0, 1.5, 3.0, 4.0, 5.0, 6.0]
    assert spread_ties(np.array([0.0, 1.0, 2.5])).tolist() == [0.0, 1.0, 2.5]   # no ties: unchanged
    assert spread_ties(np.array([0.0, 2.0, 2.0])).tolist() == [0.0, 2.0, 3.0]   # last tick: the median gap


def test_max_prompt_tokens_drops_and_counts(data):
    w = load_workload(need_data("traces/mooncake_synthetic_trace.jsonl"), max_prompt_tokens=2048)
    assert w.dropped > 0 and len(w.requests) + w.dropped == 3993
    assert all(r.prompt_tokens + r.output_tokens <= 2048 for r in w.requests)
    assert w.requests[0].arrival == 0.0  # rebased to the first kept request


def test_lengths_need_a_rate(data, lengths):
    assert (lengths.kind, lengths.has_timestamps, lengths.arrival) == ("lengths", False, "poisson")
    assert lengths.requests[0].prompt_tokens == 74 and lengths.requests[0].output_tokens == 918
    with pytest.raises(WorkloadError, match="no timestamps"):
        load_workload(need_data(LENGTHS))
    with pytest.raises(WorkloadError, match="no timestamps"):
        load_workload(need_data(LENGTHS), arrival="trace")


def test_sharegpt_keeps_turns(sharegpt):
    w = sharegpt
    assert (w.kind, w.arrival, len(w.requests), w.has_text) == ("sharegpt", "poisson", 300, True)
    assert w.dropped > 0  # some first turns exceed 2048 prompt + output tokens
    for r in w.requests:
        assert r.prompt_tokens > 0 and r.output_tokens > 0 and r.prompt_tokens + r.output_tokens <= 2048
        assert r.turns[-1][0] == "user" and r.turns[-1][1].strip()
    assert "Jeff Walker" in w.requests[0].turns[-1][1]  # file order is kept


def test_alpaca_eval_generator(data):
    w = load_workload(need_data(ALPACA), rate=1.0, max_requests=50)
    assert w.kind == "alpaca-eval" and "gpt4_1106_preview" in w.name and len(w.requests) == 50
    short = load_workload(need_data(ALPACA), rate=1.0, max_requests=50, generator="text_davinci_001")
    assert np.mean([r.output_tokens for r in short.requests]) < np.mean([r.output_tokens for r in w.requests])
    assert [r.turns for r in short.requests] == [r.turns for r in w.requests]  # same instructions, other answers



def test_alpaca_eval_unknown_generator(data, tmp_path):
    p = tmp_path / "outputs.jsonl"
    p.write_text('{"instruction_id": 0, "generator": "m1", "instruction": "Say hi.", "output": "Hi there!"}\n')
    assert [r.output_tokens for r in load_workload(p, rate=1.0, generator="m1").requests] == [3]
    with pytest.raises(WorkloadError, match="not-a-model"):
        load_workload(p, rate=1.0, generator="not-a-model")
    with pytest.raises(WorkloadError, match="only to AlpacaEval"):
        load_workload(need_data(LENGTHS), rate=1.0, generator="m1")


# --- arrivals ----------------------------------------------------------------------------------------


def test_poisson_rate_and_determinism(data):
    a = load_workload(need_data(LENGTHS), rate=5.0, max_requests=4000, seed=3)
    b = load_workload(need_data(LENGTHS), rate=5.0, max_requests=4000, seed=3)
    c = load_workload(need_data(LENGTHS), rate=5.0, max_requests=4000, seed=4)
    ta = np.array([r.arrival for r in a.requests])
    assert ta[0] == 0.0 and np.all(np.diff(ta) > 0)
    assert (len(ta) - 1) / ta[-1] == pytest.approx(5.0, rel=0.1)  # 4000 gaps: sd of the rate estimate is ~1.6%
    gaps = np.diff(ta)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.1)  # exponential: cv = 1
    assert a.requests == b.requests
    assert [r.arrival for r in c.requests] != [r.arrival for r in a.requests]
    # a trace re-timed with Poisson arrivals keeps its order and lengths
    az = load_workload(need_data(AZURE), rate=10.0, max_requests=100)
    assert az.arrival == "poisson" and az.requests[0].prompt_tokens == 4808


@pytest.mark.parametrize("kw, msg", [
    ({"arrival": "poisson"}, "rate"),
    ({"arrival": "poisson", "rate": 0.0}, "positive"),
    ({"arrival": "poisson", "rate": -1.0}, "positive"),
    ({"arrival": "trace", "rate": 2.0}, "only to Poisson"),
    ({"arrival": "bursty"}, "unknown arrival"),
    ({"max_requests": 0}, "max_requests"),
    ({"max_prompt_tokens": 1}, "max_prompt_tokens"),
])
def test_bad_options(data, kw, msg):
    with pytest.raises(WorkloadError, match=msg):
        load_workload(need_data(AZURE), **kw)


# --- malformed files ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, text, msg", [
    ("bad_header.csv", "time,prompt,output\n1,2,3\n", r":1: unknown workload format"),
    ("non_numeric.csv", "num_prefill_tokens,num_decode_tokens\n10,20\n30,abc\n", r":3: num_decode_tokens is 'abc', not a number"),
    ("negative.csv", "num_prefill_tokens,num_decode_tokens\n10,20\n-5,7\n", r":3: num_prefill_tokens is '-5', negative"),
    ("missing.csv", "num_prefill_tokens,num_decode_tokens\n10,20\n\n30\n", r":4: num_decode_tokens is missing"),
    ("ragged.csv", "num_prefill_tokens,num_decode_tokens\n10,20\n30,40,50\n", r"line 3"),
    ("bad_time.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,10,5\nyesterday,3,4\n",
     r":3: TIMESTAMP 'yesterday'"),
    ("header_only.csv", "num_prefill_tokens,num_decode_tokens\n", r"no data rows"),
    ("empty.jsonl", "", r"empty file"),
    ("blank.csv", "\n\n  \n", r"empty file"),
    ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"timestamp": 1, "input_length": 5\n',
     r":2: not valid JSON"),
    ("text_len.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"timestamp": 1, "input_length": "x"}\n',
     r":2: input_length is 'x', not a number"),
    ("no_field.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 3}\n\n{"timestamp": 1, "input_length": 4}\n',
     r":3: missing field 'output_length'"),
    ("unknown.jsonl", '{"foo": 1}\n', r":1: unknown JSONL workload"),
    ("binary.bin", None, r"cannot read as UTF-8"),
])
@pytest.mark.unit
def test_malformed_files_raise_with_line(tmp_path, name, text, msg):
    p = tmp_path / name
    if text is None:
        p.write_bytes(bytes(range(256)) * 4)
    else:
        p.write_text(text)
    with pytest.raises(WorkloadError, match=msg) as exc:
        load_workload(p, rate=1.0)
    assert str(p) in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.unit
def test_missing_file_and_directory(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        load_workload(tmp_path / "nope.csv")
    with pytest.raises(WorkloadError, match="directory"):
        detect_format(tmp_path)


@pytest.mark.unit
def test_zero_lengths_are_dropped_and_timestamps_sorted(tmp_path):
    p = tmp_path / "mc.jsonl"
    rows = [(3000, 5, 3), (1000, 0, 3), (2000, 7, 0), (1500, 9, 4)]
    p.write_text("".join(f'{{"timestamp": {t}, "input_length": {i}, "output_length": {o}, "hash_ids": []}}\n'
                         for t, i, o in rows))
    w = load_workload(p)
    assert w.dropped == 2
    assert [(r.arrival, r.prompt_tokens) for r in w.requests] == [(0.0, 9), (1.5, 5)]


def test_all_rows_dropped_is_an_error(data):
    with pytest.raises(WorkloadError, match="max_prompt_tokens"):
        load_workload(need_data(MOONCAKE), max_prompt_tokens=10)


# --- predictions ---------------------------------------------------------------------------------------


def test_oracle_is_exact(lengths):
    o = make_predictor("oracle")
    preds = o.predict(lengths.requests)
    assert [p.length for p in preds] == [float(r.output_tokens) for r in lengths.requests]
    r = lengths.requests[0]
    assert o.repredict(r, 100, preds[0]) == r.output_tokens - 100
    assert o.repredict(r, r.output_tokens + 5, preds[0]) == 1


@pytest.mark.parametrize("acc", [0.3, 0.55, 0.8, 1.0])
def test_noise_hits_accuracy(lengths, acc):
    o = make_predictor(f"noise:{acc}", seed=7)
    preds = o.predict(lengths.requests)
    truth = np.array([r.output_tokens for r in lengths.requests])
    assert bucket_accuracy(truth, np.array([p.length for p in preds])) == pytest.approx(acc, abs=0.02)
    assert all(p.bucket == int(p.length // 200) for p in preds if p.length < 2000)
    if acc == 1.0:
        assert o.sigma == 0.0 and [p.length for p in preds] == list(truth.astype(float))
    again = make_predictor(f"noise:{acc}", seed=7).predict(lengths.requests)
    assert again == preds


def test_noise_is_per_request(lengths):
    o = make_predictor("noise:0.55", seed=2)
    assert isinstance(o, LogNormalNoise)
    full = o.predict(lengths.requests)
    other = make_predictor("noise:0.55", seed=3)
    assert other.predict(lengths.requests) != full


@pytest.mark.parametrize("spec", ["noise:0.55", "gauss:0.3"])
def test_noisy_predictors_repredict_from_the_first_prediction_alone(lengths, spec):
    """As the engine must: the true remaining length never enters a re-prediction (only the oracle sees it)."""
    o = make_predictor(spec, seed=2)
    o.predict(lengths.requests)
    short, long = (replace(lengths.requests[0], output_tokens=n) for n in (120, 1900))
    point = Prediction(100.0)
    assert o.repredict(short, 110, point) == o.repredict(long, 110, point) == point.remaining_after(110) == 100.0
    dist = Prediction(150.0, edges=(200, 400), probs=(0.5, 0.3, 0.2))
    assert o.repredict(short, 250, dist) == o.repredict(long, 250, dist) == pytest.approx(dist.remaining_after(250))
    assert dist.remaining_after(250) == pytest.approx((0.3 * (250 + 400) / 2 + 0.2 * (400 + 800) / 2) / 0.5 - 250)


def test_noise_unreachable_accuracy_is_explained(data):
    # Azure code: 95% of outputs are < 200 tokens, so even random guesses are right half the time
    w = load_workload(need_data(AZURE), max_requests=2000)
    with pytest.raises(PredictorSpecError, match="gauss:SIGMA"):
        make_predictor("noise:0.2").predict(w.requests)


def test_gauss_is_deterministic(lengths):
    g = make_predictor("gauss:0.3", seed=5)
    assert isinstance(g, GaussianNoise)
    a = g.predict(lengths.requests)
    assert a == make_predictor("gauss:0.3", seed=5).predict(lengths.requests)
    assert a != make_predictor("gauss:0.3", seed=6).predict(lengths.requests)
    assert min(p.length for p in a) >= 1.0
    truth = np.array([r.output_tokens for r in lengths.requests], dtype=float)
    rel = np.array([p.length for p in a]) / truth - 1
    assert np.std(rel[rel > -0.9]) == pytest.approx(0.3, abs=0.05)
    assert [p.length for p in make_predictor("gauss:0").predict(lengths.requests)] == list(truth)
    # a subset gets the same predictions: noise is keyed by request id, not by position
    assert g.predict(lengths.requests[10:20]) == a[10:20]
    r = lengths.requests[0]
    assert g.repredict(r, 40, a[0]) == g.repredict(r, 40, a[0]) >= 1


@pytest.mark.unit
@pytest.mark.parametrize("spec", ["", "oracle:1", "noise", "noise:0", "noise:1.5", "noise:abc", "noise:nan", "gauss:-0.1",
                                  "gauss:", "uniform:0.5", "magic"])
def test_bad_specs(spec):
    with pytest.raises(PredictorSpecError) as exc:
        make_predictor(spec)
    assert "\n" not in str(exc.value)


@pytest.mark.unit
def test_bad_model_paths(tmp_path):
    with pytest.raises(PredictorSpecError, match="not a predictor package"):
        make_predictor(str(tmp_path))
    with pytest.raises(PredictorSpecError, match="not a predictor package"):
        make_predictor(str(tmp_path / "missing"))
    with pytest.raises(PredictorSpecError, match="quantile"):
        make_predictor("oracle", quantile=0.9)


class _StubOnnx:
    """Stands in for OnnxLengthPredictor: a fixed distribution over 200-token buckets."""

    def __init__(self):
        self.scheme = BucketScheme.equal_width(200, 1000)
        self.calls = []

    def predict(self, prompts, quantile=0.9):
        self.calls.append(prompts)
        probs = np.tile([0.1, 0.6, 0.2, 0.05, 0.05], (len(prompts), 1))
        return PredictionBatch(buckets=probs.argmax(1), probs=probs, expected=self.scheme.expected(probs),
                               quantile=self.scheme.quantile(probs, quantile), truncated=np.zeros(len(prompts), bool))


def test_model_predictions_from_bucket_distribution(sharegpt, lengths):
    stub = _StubOnnx()
    m = ModelPredictor("stub", stub)
    preds = m.predict(sharegpt.requests[:3])
    assert stub.calls[0][0] == list(sharegpt.requests[0].turns)
    p = preds[0]
    assert (p.bucket, p.hi, p.edges, len(p.probs)) == (1, 400.0, (200, 400, 600, 800), 5)
    assert p.length == pytest.approx(float(stub.scheme.expected(np.array(p.probs))))
    assert m.repredict(sharegpt.requests[0], 500, p) == p.remaining_after(500)
    q = ModelPredictor("stub", stub, quantile=0.9).predict(sharegpt.requests[:1])[0]
    assert q.length > p.length
    with pytest.raises(WorkloadError, match="needs prompt text"):
        m.predict(lengths.requests[:2])


@pytest.mark.unit
def test_trace_request_is_frozen():
    r = TraceRequest(0, 0.0, 1, 1)
    with pytest.raises(AttributeError):
        r.arrival = 1.0  # type: ignore[misc]


def test_several_alpaca_eval_generators_are_services_of_one_workload(data):
    """Each generator's answers, shuffled together with a seed, each request tagged with the model that answered; the
    simulator reports attainment per service beside the totals."""
    from serving.sim.scenarios import SCENARIOS, build_setup
    from serving.sim.sweep import run_point

    path = need_data("prompts/alpaca_eval_model_outputs.62models.jsonl.xz")
    w = load_workload(path, rate=1.0, generator="alpaca-7b,gpt4", max_requests=300)
    again = load_workload(path, rate=1.0, generator="alpaca-7b,gpt4", max_requests=300)
    assert [r.service for r in w.requests] == [r.service for r in again.requests]
    assert {r.service for r in w.requests} == {"alpaca-7b", "gpt4"}
    by = {s: np.mean([r.output_tokens for r in w.requests if r.service == s]) for s in ("alpaca-7b", "gpt4")}
    assert by["gpt4"] > 2 * by["alpaca-7b"]  # their own answers' lengths, not one model's
    assert all(r.service == "" for r in load_workload(path, rate=1.0, generator="gpt4", max_requests=20).requests)
    setup = build_setup(SCENARIOS["seallm-services"], max_requests=200)
    m = run_point(setup, "seallm", 4.0)
    per = m.extra["per_service"]
    assert set(per) == set(SCENARIOS["seallm-services"].generator.split(","))
    assert sum(v["requests"] for v in per.values()) == m.requests_total == 200


@pytest.mark.unit
def test_length_noise_moves_lengths_the_predictions_never_see():
    """SeaLLM's figure 13: a Gaussian delta of std sigma x the length, within [1, the context left], the same for a seed;
    the predictions are made before it."""
    from serving.sim.scenarios import perturb_lengths

    reqs = [TraceRequest(i, float(i), 50, 100) for i in range(2000)]
    assert perturb_lengths(reqs, 0.0, 400) == reqs
    moved = perturb_lengths(reqs, 0.2, 400)
    assert moved == perturb_lengths(reqs, 0.2, 400) and moved != perturb_lengths(reqs, 0.2, 400, seed=1)
    rel = np.array([r.output_tokens for r in moved]) / 100 - 1
    assert abs(rel.mean()) < 0.02 and 0.18 < rel.std() < 0.22
    wide = [r.output_tokens for r in perturb_lengths(reqs, 16.0, 400)]
    assert min(wide) == 1 and max(wide) == 350  # clamped: at least a token, never past the context


@pytest.mark.unit
def test_a_max_rate_the_search_never_failed_past_is_shown_as_a_lower_bound():
    from serving.bench.sim import rate_text
    from serving.sim.sweep import max_rate

    class Met:  # what the walk reads of a run: a policy that meets every SLO at any rate it tries
        slo_attainment = 1.0

        def to_dict(self) -> dict:
            return {"slo_attainment": 1.0, "throughput_rps": 1.0}

    def always(rate: float) -> Met:
        return Met()

    r = max_rate(always, 2.0, max_points=3)
    assert r["first_failing_rate"] is None and rate_text(r) == ">=3.91"
    assert rate_text({"max_rate_at_90_slo": 35.38, "first_failing_rate": 36.38}) == "35.4"
