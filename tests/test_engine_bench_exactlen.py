"""``bench engine`` keeps the true length from the scheduler: one ``max_tokens`` cap for every request, the length enforced
by a logits processor (serving/bench/engine/exactlen.py) under a key the plug-in never reads.

The unit tests pin the key, the plug-in's view of a request, the processor's masks and the simulator's like-for-like cap;
the last test replays a handful of requests through stock vLLM and the plug-in on the real engine.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from rich.console import Console
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from serving.bench.engine.bench import EngineBenchConfig, _with_cap, run_engines, trace_max_tokens
from serving.bench.engine.exactlen import STOP_TOKEN_ID, TRUE_LEN_KEY, ExactLengthLogitsProcessor, exact_length_params
from serving.engine.inputs import parse_inputs
from serving.policy.hints import HINT_KEYS, SchedulingHints
from serving.policy.request import Prediction
from serving.sim.instance import new_request
from serving.sim.workload import TraceRequest

VOCAB = 4096


@pytest.mark.unit
def test_the_true_length_key_is_the_benchs_and_the_plugin_never_reads_it():
    assert TRUE_LEN_KEY.startswith("bench_") and TRUE_LEN_KEY not in HINT_KEYS
    params = exact_length_params(37, 1024, {"pred_len": 80.0, "deadline": 12.5})
    assert params.max_tokens == 1024 and params.stop_token_ids == [STOP_TOKEN_ID] and params.ignore_eos
    assert params.extra_args == {"pred_len": 80.0, "deadline": 12.5, TRUE_LEN_KEY: 37}
    hints = SchedulingHints.model_validate(params.extra_args)
    assert TRUE_LEN_KEY not in hints.xargs() and hints.xargs() == {"pred_len": 80.0, "deadline": 12.5}
    assert SchedulingHints.model_validate({TRUE_LEN_KEY: 37}).xargs() == {}  # alone, it is no prediction either

    seen = parse_inputs(params.extra_args, arrival=0.0, max_tokens=params.max_tokens, default_pred_len=256)
    # above the true 37, below the cap: the plug-in's policy gets 80, not the truth
    assert seen.prediction.length == 80.0 and not seen.fallback_prediction and seen.invalid is None
    assert seen.deadline == 12.5
    over = exact_length_params(37, 1024, {"pred_len": 5000.0})
    assert parse_inputs(over.extra_args, arrival=0.0, max_tokens=1024, default_pred_len=256).prediction.length == 1024
    alone = exact_length_params(37, 1024)  # no prediction: the default, clamped to the cap, never the truth
    fallback = parse_inputs(alone.extra_args, arrival=0.0, max_tokens=1024, default_pred_len=256)
    assert fallback.fallback_prediction and fallback.prediction.length == 256
    with pytest.raises(ValueError):
        exact_length_params(1025, 1024)


def _update(added=(), removed=(), moved=(), size=4) -> BatchUpdate:
    return BatchUpdate(batch_size=size, removed=list(removed), added=list(added), moved=list(moved))


def _apply(proc: ExactLengthLogitsProcessor, rows: int) -> torch.Tensor:
    torch.manual_seed(0)
    logits = torch.randn(rows, VOCAB)
    logits[:, STOP_TOKEN_ID] = 50.0  # the stop token is every row's argmax unless masked
    return proc.apply(logits)


@pytest.mark.unit
def test_the_processor_masks_the_stop_token_before_the_length_and_forces_it_at_the_length():
    proc = ExactLengthLogitsProcessor(None, torch.device("cpu"), False)
    out0, out1, out2 = [], [], []
    proc.update_state(_update(added=[(0, exact_length_params(3, 64), None, out0),
                                     (1, SamplingParams(max_tokens=5), None, out1),  # a request without the key
                                     (2, exact_length_params(1, 64), None, out2)]))
    assert not proc.is_argmax_invariant()
    x = _apply(proc, 3)
    assert x[0, STOP_TOKEN_ID] == float("-inf") and torch.isfinite(x[0, :STOP_TOKEN_ID]).all()  # 0 of 3: held
    assert x[1].argmax() == STOP_TOKEN_ID  # untouched
    assert x[2].argmax() == STOP_TOKEN_ID and torch.isinf(x[2]).sum() == VOCAB - 1  # 1 token: the stop token now
    out0.append(17)
    assert _apply(proc, 3)[0, STOP_TOKEN_ID] == float("-inf")  # 1 of 3: still held
    out0.append(-1)  # a placeholder for a token in flight counts: vLLM appends one under async scheduling
    assert _apply(proc, 3)[0].argmax() == STOP_TOKEN_ID  # 2 of 3: the third is the stop token
    # rows follow vLLM's batch moves; a finished row is dropped
    proc.update_state(_update(removed=[2], moved=[(0, 2, MoveDirectionality.UNIDIRECTIONAL)]))
    x = _apply(proc, 3)
    assert x[2].argmax() == STOP_TOKEN_ID and torch.isinf(x[2]).sum() == VOCAB - 1 and x[0, STOP_TOKEN_ID] == 50.0


@pytest.mark.unit
@pytest.mark.parametrize("params,needle", [
    (SamplingParams(max_tokens=8, stop_token_ids=[STOP_TOKEN_ID], extra_args={TRUE_LEN_KEY: 9}), "exceeds max_tokens"),
    (SamplingParams(max_tokens=8, extra_args={TRUE_LEN_KEY: 4}), "stop_token_ids"),
    (SamplingParams(max_tokens=8, stop_token_ids=[STOP_TOKEN_ID], extra_args={TRUE_LEN_KEY: True}), "positive integer"),
    (SamplingParams(max_tokens=8, stop_token_ids=[STOP_TOKEN_ID], extra_args={TRUE_LEN_KEY: 0}), "positive integer"),
])
def test_the_processor_refuses_a_length_it_cannot_enforce(params, needle):
    with pytest.raises(ValueError, match=needle):
        ExactLengthLogitsProcessor.validate_params(params)
    ExactLengthLogitsProcessor.validate_params(SamplingParams(max_tokens=8))  # no key: not its request


@pytest.mark.unit
@pytest.mark.parametrize("pred", [Prediction(80.0, hi=100.0, bucket=3), Prediction(5000.0), Prediction(0.2), Prediction(64)])
def test_the_simulator_clamps_predictions_to_max_tokens_as_the_plugin_does(pred):
    cap = 1024
    tr = TraceRequest(rid=7, arrival=2.0, prompt_tokens=30, output_tokens=37)
    sim = new_request(tr, pred, lambda rl: 3.0 * rl, max_tokens=cap)
    hints = SchedulingHints(pred_len=pred.length, pred_hi=pred.hi, pred_bucket=pred.bucket).xargs()
    plugin = parse_inputs(hints, arrival=tr.arrival, max_tokens=cap, default_pred_len=256).prediction
    assert sim.pred == plugin and sim.max_tokens == cap
    assert sim.deadline == new_request(tr, pred, lambda rl: 3.0 * rl).deadline  # the gateway's, from the prediction
    assert new_request(tr, pred, lambda rl: 3.0 * rl).pred is pred  # no cap: as before


@pytest.mark.unit
def test_the_default_cap_is_the_longest_response_rounded_up_and_a_given_one_must_cut_none():
    assert trace_max_tokens([1419, 12, 300]) == 1536 and trace_max_tokens([256]) == 256 and trace_max_tokens([1]) == 256
    wl = SimpleNamespace(requests=[SimpleNamespace(output_tokens=n) for n in (10, 700, 31)])
    assert _with_cap(EngineBenchConfig(), wl).max_tokens == 768
    assert _with_cap(EngineBenchConfig(max_tokens=700), wl).max_tokens == 700
    with pytest.raises(ValueError, match="below the trace's longest response"):
        _with_cap(EngineBenchConfig(max_tokens=699), wl)


# -- the real engine ---------------------------------------------------------------------------------------------------
CAP = 128
LENGTHS = [1, 7, 40, 90, 127, 128]  # the last at the cap itself
PREDS = [50.0, 60.0, 100.0, 120.0, 127.5, 900.0]  # above every true length; all but the last below the cap


@pytest.mark.timeout(900)
def test_real_engine_ends_every_request_at_its_length_with_one_cap_and_unclamped_predictions(tmp_path):
    reqs = [{"id": i, "arrival": 0.0, "prompt_tokens": 24 + 17 * i, "output_tokens": n, "extra_args": {"pred_len": p},
             "slo_s": 60.0} for i, (n, p) in enumerate(zip(LENGTHS, PREDS))]
    # 256-token context, 9 usable blocks of 32 tokens: not all six fit at once, so stock vLLM preempts and recomputes
    engine = {"shape": "micro", "max_model_len": 256, "block_size": 32, "max_num_seqs": 256, "max_num_batched_tokens": 256,
              "kv_blocks": 10, "threads": 1}
    jobs = [{"scheduler": s, "tag": "exactlen", "engine": engine, "max_tokens": CAP, "requests": reqs, "plugin": {"tfs": 256}}
            for s in ("stock", "lengthwise")]
    stock, ours = run_engines(jobs, tmp_path, Console(file=io.StringIO()))
    for out in (stock, ours):
        recs = sorted(out["records"], key=lambda r: r["id"])
        assert [r["tokens"] for r in recs] == LENGTHS and all(r["finished"] is not None for r in recs)
        assert all(r["max_tokens"] == CAP for r in recs)  # the scheduler's max_tokens: the cap, never the length
        assert all(r["finish_reason"] == "stop" and r["stop_reason"] == STOP_TOKEN_ID for r in recs)
    assert all("policy_pred_len" not in r for r in stock["records"])
    recs = sorted(ours["records"], key=lambda r: r["id"])
    assert [r["policy_pred_len"] for r in recs] == [*PREDS[:-1], CAP]  # as sent, only the one above the cap clamped
    assert all(r["policy_pred_len"] > r["tokens"] for r in recs[:-1]) and all(r["policy_max_tokens"] == CAP for r in recs)
    assert ours["plugin_stats"]["requests"] == len(LENGTHS) and ours["plugin_stats"]["fallback_predictions"] == 0
