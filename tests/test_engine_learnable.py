"""What the plug-in tells the policy's learners of lengths about a request: the client key's opaque id from the
gateway's hints, and whether its sampling parameters leave its length to the model (serving/engine/inputs.py), read
from vLLM's own ``SamplingParams`` and carried to the policy twin by the real scheduler."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.sampling_params import SamplingParams, StructuredOutputsParams

from serving.engine.inputs import model_stop_ids, parse_inputs
from serving.engine.scheduler import LengthwiseScheduler
from tests.vllm_harness import EOS_TOKEN_ID, make_request, make_scheduler

pytestmark = pytest.mark.unit


def _inputs(params: SamplingParams | None, model_stops: frozenset[int] = frozenset()):
    extra = params.extra_args if params is not None else {"pred_len": 10}
    return parse_inputs(extra, arrival=0.0, max_tokens=64, default_pred_len=32, sampling=params, model_stops=model_stops)


def _params(**fields) -> SamplingParams:
    """Sampling parameters as the engine sees them: built, then completed from the model's generation config."""
    p = SamplingParams(max_tokens=64, **fields)
    p.update_from_generation_config({}, eos_token_id=EOS_TOKEN_ID)
    return p


def test_the_client_id_comes_from_the_hints_and_is_empty_when_not_told():
    assert _inputs(_params(extra_args={"pred_len": 10, "client": "key-3"})).client == "key-3"
    assert _inputs(_params(extra_args={"pred_len": 10})).client == ""
    assert _inputs(None).client == "" and _inputs(None).learnable  # nothing known to shape it
    odd = _inputs(_params(extra_args={"pred_len": 10, "client": "sk-live key with spaces"}))
    assert odd.invalid and odd.client == "" and odd.fallback_prediction  # malformed hints: defaults, never a crash
    assert _inputs(_params(extra_args={"pred_len": 10, "client": "k" * 65})).invalid


@pytest.mark.parametrize("fields", [
    {"stop": ["."]}, {"stop": "\n"}, {"stop_token_ids": [13]}, {"ignore_eos": True}, {"min_tokens": 4},
    {"bad_words": ["x"]}, {"logit_bias": {13: 5.0}}, {"allowed_token_ids": [1, 2]},
    {"structured_outputs": StructuredOutputsParams(regex="a+")}, {"extra_args": {"pred_len": 10, "my_processor": 1}},
])
def test_what_the_client_set_to_shape_the_length_makes_it_not_learnable(fields):
    assert not _inputs(_params(**fields)).learnable


def test_what_does_not_shape_the_length_leaves_it_learnable():
    assert _inputs(_params(extra_args={"pred_len": 10, "client": "key-0"})).learnable
    assert _inputs(_params(temperature=0.7, top_p=0.9, seed=3, n=1)).learnable  # sampling is the gateway's to judge
    # disaggregated serving's transfer parameters, which vLLM's own server puts in extra_args
    assert _inputs(_params(extra_args={"pred_len": 10, "kv_transfer_params": {"do_remote_decode": True}})).learnable


def test_the_models_own_end_ids_in_stop_token_ids_are_not_the_clients():
    """vLLM adds a generation config's further end-of-sequence ids to every request's ``stop_token_ids``."""
    config = {"eos_token_id": [EOS_TOKEN_ID, 7, 9]}
    stops = model_stop_ids(config)
    assert stops == {EOS_TOKEN_ID, 7, 9}
    plain = SamplingParams(max_tokens=64)
    plain.update_from_generation_config(config, eos_token_id=EOS_TOKEN_ID)
    assert sorted(plain.stop_token_ids) == [7, 9]
    assert _inputs(plain, stops).learnable and not _inputs(plain).learnable
    own = SamplingParams(max_tokens=64, stop_token_ids=[13])
    own.update_from_generation_config(config, eos_token_id=EOS_TOKEN_ID)
    assert not _inputs(own, stops).learnable
    assert model_stop_ids({"eos_token_id": 5}) == {5} and model_stop_ids({}) == frozenset()
    assert model_stop_ids({"eos_token_id": None}) == frozenset()


def test_the_scheduler_gives_the_policy_twin_the_client_and_learnable():
    s = make_scheduler(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64, scheduler_cls=LengthwiseScheduler)
    honest = make_request("honest", 8, 16, {"pred_len": 12, "client": "key-1"})
    shaped = make_request("shaped", 8, 16, {"pred_len": 12, "client": "key-2"})
    shaped.sampling_params.stop = ["."]  # as vLLM's front end hands it over: a list of the client's stop strings
    anonymous = make_request("anonymous", 8, 16, {"pred_len": 12})
    for r in (honest, shaped, anonymous):
        s.add_request(r)
    twins = {rid: s.lw_policy.requests[s._rid_of[rid]] for rid in ("honest", "shaped", "anonymous")}
    assert {rid: (t.client, t.learnable) for rid, t in twins.items()} == {
        "honest": ("key-1", True), "shaped": ("key-2", False), "anonymous": ("", True)}
