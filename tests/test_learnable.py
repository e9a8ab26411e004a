"""The one definition of a learnable length (serving/policy/learnable.py): its rules agree with the sidecar's, and a
window of samples lets one client key hold at most its share, through the gateway's profile as well."""

from __future__ import annotations

import pytest

from monitoring import online
from predictor.sidecar.schemas import FINISH_REASONS as SIDECAR_FINISH_REASONS
from serving.gateway.model_predictors import ProfilePredictor
from serving.gateway.prediction import LengthPrediction
from serving.gateway.requests import ClientRequest
from serving.policy.learnable import CUT, FINISHED, KEY_SHARE, WINDOW, ClientWindow, censored, refusal, shaping_field

pytestmark = pytest.mark.unit


def test_the_finish_reasons_are_the_sidecars():
    assert (FINISHED, CUT) == (online.FINISHED, online.CUT)
    assert set(SIDECAR_FINISH_REASONS) == set(FINISHED + CUT)


@pytest.mark.parametrize("reason", [*FINISHED, *CUT, None, "something-new"])
def test_a_length_is_learnt_exactly_when_the_sidecar_takes_it_as_uncensored(reason):
    """The sidecar's rule (monitoring/online.py's ``Feedback.censored``) and this one, over every finish reason."""
    fb = online.Feedback("m", "1", 0, 0, 20.0, None, 20, reason)
    assert censored(reason) == fb.censored
    assert (refusal(None, reason) is None) == (not fb.censored)


@pytest.mark.parametrize(("fields", "reason"), [
    ({}, None), ({"stop": "."}, "stop"), ({"stop": ["\n"]}, "stop"), ({"stop_token_ids": [13]}, "stop_token_ids"),
    ({"ignore_eos": True}, "ignore_eos"), ({"min_tokens": 4}, "min_tokens"), ({"logit_bias": {"13": 5}}, "logit_bias"),
    ({"allowed_token_ids": [1]}, "allowed_token_ids"), ({"bad_words": ["x"]}, "bad_words"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"), ({"repetition_detection": {"min_count": 3}},
                                                                       "repetition_detection"),
    ({"response_format": {"type": "json_schema"}}, "response_format"), ({"vllm_xargs": {"mine": 1}}, "vllm_xargs"),
    ({"stop": [], "stop_token_ids": (), "logit_bias": {}, "ignore_eos": False, "min_tokens": 0,
      "response_format": {"type": "text"}, "vllm_xargs": {"pred_len": 9, "client": "key-1"}, "max_tokens": 1}, None),
])
def test_the_fields_that_shape_a_length(fields, reason):
    assert shaping_field(fields) == reason


def test_why_an_answer_is_refused():
    assert refusal(None, "stop") is None and refusal(None, None) is None
    assert refusal("stop", "stop") == "stop"  # the client's field first: it says more than the finish reason
    assert refusal(None, "stop", outputs=2) == "n"
    assert refusal(None, "length") == "length" and refusal(None, "abort") == "abort"


def test_one_key_flooding_learnable_looking_answers_holds_at_most_a_quarter_of_the_window():
    w = ClientWindow()
    assert (w.size, w.cap) == (WINDOW, int(WINDOW * KEY_SHARE)) == (512, 128)
    for i in range(300):  # three honest keys, answers of 20 tokens
        w.add(20, f"key-{i % 3}")
    for _ in range(1000):  # one key, answers of 1 token that ended by themselves
        w.add(1, "key-9")
    assert w.held_by("key-9") == 128 and w.n == 428 and w.over_share == 1000 - 128
    assert w.mean == pytest.approx((300 * 20 + 128) / 428)
    for i in range(600):  # bounded: each honest key at its share pushes out its own oldest; the flood keeps a quarter
        w.add(30, f"key-{i % 3}")
    assert w.n == 512 and w.held_by("key-9") == 128 and sum(w.per_client.values()) == 512
    assert max(w.held_by(f"key-{i}") for i in range(3)) <= 128


def test_a_key_past_its_share_pushes_out_its_own_oldest_never_anothers():
    w = ClientWindow(size=8, share=0.25)  # two samples a key
    w.add(5, "a")
    w.add(7, "b")
    w.add(6, "a")
    w.add(100, "a")  # "a" at its share: its 5 leaves, "b"'s 7 stays
    assert [s[1] for s in w.samples] == [7, 6, 100] and w.over_share == 1
    for _ in range(10):
        w.add(1)  # no key told (a gateway with fewer than two keys): not capped, the oldest leaves
    assert w.n == 8 and all(s[0] is None for s in w.samples) and w.per_client == {}
    assert w.mean == 1 and w.std == 0
    with pytest.raises(ValueError):
        ClientWindow(size=0)
    with pytest.raises(ValueError):
        ClientWindow(share=0)


def test_the_spread_is_the_samples_standard_deviation():
    w = ClientWindow()
    for x in (40, 60, 1):
        w.add(x)
    assert (round(w.mean, 1), round(w.std, 1)) == (33.7, 30.0)


def _fallback(req: ClientRequest, reason: str) -> LengthPrediction:
    return LengthPrediction(100, "fallback", reason)


def test_the_profile_learns_only_the_models_own_lengths_and_caps_one_key():
    profile = ProfilePredictor(_fallback)
    assert profile.learn("m", 20, 1, "stop", None, "key-0") is None
    assert profile.learn("m", 1, 1, "length", None, "key-2") == "length"  # cut at max_tokens 1
    assert profile.learn("m", 2, 1, "stop", "stop", "key-2") == "stop"  # ended by the client's stop string
    assert profile.learn("m", 40, 2, "stop", None, "key-2") == "n"  # two sequences: 40 is neither's length
    assert profile.learn("m", 5, 1, "abort", None, None) == "abort"
    assert profile.state("m") == {"answers": 1, "mean_tokens": 20.0, "std_tokens": 0.0, "refused": 4, "over_share": 0}
    for _ in range(200):  # learnable-looking answers of one key
        profile.learn("m", 1, 1, "stop", None, "key-2")
    state = profile.state("m")
    assert state["answers"] == 1 + 128 and state["over_share"] == 200 - 128
    assert profile.profiles["m"].held_by("key-2") == 128
    assert profile.state("other") == {"answers": 0, "mean_tokens": 0.0, "std_tokens": 0.0, "refused": 0, "over_share": 0}
