"""The predicted length distribution end to end, in process: the sidecar's response (``edges``, ``probs``) → the gateway's
prediction and hints (``pred_edges``, ``pred_probs`` in ``vllm_xargs``) → the plug-in's :func:`parse_inputs` →
:meth:`Prediction.remaining_after`, the re-prediction of a request that outlived its prediction.

No model file, server or engine: the sidecar's response is built by its own code (``predict_items``) over a stand-in
for the ONNX session, and answered to the gateway through an in-process HTTP transport. The real processes are in
``tests/test_sidecar.py`` and ``tests/test_gateway.py``.
"""

from __future__ import annotations

import asyncio
import json
import math
import queue
from types import SimpleNamespace

import numpy as np
import pytest

from predictor.buckets import BucketScheme
from predictor.prompt import Encoded
from predictor.runtime import MODEL, RoutedProbs
from predictor.sidecar.loading import PredictItem, ServedModel, predict_fast, predict_items
from predictor.sidecar.schemas import PredictResponse
from predictor.slices import TFIDF
from serving.engine.inputs import parse_inputs
from serving.gateway.gateway import Call, Gateway
from serving.policy.request import Prediction

pytestmark = pytest.mark.unit

SCHEME = BucketScheme.from_edges([100, 200, 400], max_tokens=800)  # buckets [0,100) [100,200) [200,400) [400,800)
PROBS = [0.4, 0.3, 0.2, 0.1]
EXPECTED = 0.4 * 50 + 0.3 * 150 + 0.2 * 300 + 0.1 * 600  # 185: the midpoints are the scheme's centers


class _Session:
    """Stands in for the sidecar's onnxruntime session: the scheme, and logits whose softmax is PROBS for every prompt."""

    scheme = SCHEME

    def encode(self, convs):
        return [Encoded([1, 2, 3], False) for _ in convs]

    def logits_encoded(self, ids):
        return np.log(np.array([PROBS] * len(ids), dtype=np.float64))

    def probs_routed(self, convs):
        """No routes: every prompt to the model, as OnnxLengthPredictor.probs_routed does for a package without any."""
        n = len(convs)
        return RoutedProbs(np.array([PROBS] * n, dtype=np.float64), np.full(n, MODEL, dtype=object), np.zeros(n, bool),
                           np.full(n, 3))

    def has_fast_tier(self, convs):
        return True

    def probs_fast(self, convs):
        """The fast tier: the same probabilities, as the TF-IDF route answers them."""
        n = len(convs)
        return RoutedProbs(np.array([PROBS] * n, dtype=np.float64), np.full(n, TFIDF, dtype=object), np.zeros(n, bool),
                           np.full(n, 3))


def sidecar_answer(fast: bool = False) -> dict:
    """``/v1/predict``'s body for one prompt, as the sidecar builds it (``_predict`` adds the id and latency); with
    ``fast``, as its fast tier answers a prompt its encoder would have reached too late."""
    sessions: queue.SimpleQueue = queue.SimpleQueue()
    sessions.put(_Session())
    model = ServedModel(sessions, _Session(), SimpleNamespace(name="length-predictor", version="7"))
    items = [PredictItem([("user", "Tell me a story")], 0.9)]
    [(d, _)] = predict_fast(model, items) if fast else predict_items(model, items)
    d.update(prediction_id="lw-1", latency_ms=1.0)
    return PredictResponse.model_validate({"predictions": [d], "model_name": "length-predictor", "model_version": "7",
                                           "latency_ms": 1.0}).model_dump(mode="json")




def engine_xargs(gw: Gateway, headers: dict | None = None) -> dict:
    """Run the predict and hints steps for one request; the ``vllm_xargs`` as the engine parses them (JSON)."""
    call = Call("completion", arrival=1000.0)
    req = gw.validate("completion", json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 1000}).encode())
    pred = asyncio.run(gw.predict(call, req, headers or {}))
    body = gw.hints(call, req, pred, gw.deadline(call, pred, gw.slo_terms({})))
    return json.loads(json.dumps(body))["vllm_xargs"]


def dropped(gw: Gateway) -> dict[str, float]:
    return {s.labels["reason"]: s.value for m in gw.metrics.distributions_dropped.collect() for s in m.samples
            if s.name.endswith("_total")}


# --- the sidecar ------------------------------------------------------------------------------------------------
def test_the_sidecar_sends_the_bucket_tops_but_the_last_with_one_probability_per_bucket():
    p = sidecar_answer()["predictions"][0]
    assert p["edges"] == [100, 200, 400] == list(SCHEME.edges[1:])
    assert p["probs"] == pytest.approx(PROBS) and len(p["probs"]) == len(p["edges"]) + 1
    assert (p["bucket"], p["range"], p["expected_tokens"]) == (0, [0, 100], pytest.approx(EXPECTED))
    older = {k: v for k, v in p.items() if k != "edges"}  # a sidecar from before the field still fits the schema
    assert PredictResponse.model_validate({"predictions": [older], "model_name": "m", "model_version": "1",
                                           "latency_ms": 1.0}).predictions[0].edges is None


# --- the gateway: sidecar answer → hints ------------------------------------------------------------------------
def test_the_sidecars_distribution_goes_to_the_engine_with_the_prediction(make_gateway):
    gw = make_gateway(sidecar_answer())
    xargs = engine_xargs(gw)
    assert set(xargs) == {"pred_len", "pred_hi", "pred_bucket", "pred_edges", "pred_probs", "deadline"}
    assert (xargs["pred_len"], xargs["pred_hi"], xargs["pred_bucket"]) == (185, 100, 0)
    assert xargs["pred_edges"] == [100, 200, 400] and xargs["pred_probs"] == pytest.approx(PROBS)
    assert dropped(gw) == {} and gw.metrics.predictions.labels("sidecar")._value.get() == 1


def test_a_fast_tier_answer_keeps_the_sidecars_prediction_and_is_counted_and_marked(make_gateway):
    """A saturated sidecar's fast-tier answer (overflow) is a sidecar prediction like any other for the engine; the
    gateway counts it apart and its x-lengthwise-prediction says so, so an operator sees how much ran on the tier."""
    answer = sidecar_answer(fast=True)
    assert answer["predictions"][0]["overflow"] is True and answer["predictions"][0]["predictor"] == TFIDF
    gw = make_gateway(answer)
    call = Call("completion", arrival=1000.0)
    req = gw.validate("completion", json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 1000}).encode())
    pred = asyncio.run(gw.predict(call, req, {}))
    assert (pred.source, pred.fast_tier, pred.label, pred.tokens) == ("sidecar", True, "sidecar:fast-tier", 185)
    assert gw.metrics.prediction_fast_tier._value.get() == 1 and gw.metrics.predictions.labels("sidecar")._value.get() == 1
    assert engine_xargs(gw)["pred_edges"] == [100, 200, 400]
    plain = make_gateway(sidecar_answer())
    pred = asyncio.run(plain.predict(Call("completion", arrival=1000.0), req, {}))
    assert (pred.fast_tier, pred.label) == (False, "sidecar") and plain.metrics.prediction_fast_tier._value.get() == 0


def test_a_sidecar_without_the_distribution_still_predicts_and_the_absence_is_counted(make_gateway):
    answer = sidecar_answer()
    del answer["predictions"][0]["edges"]
    gw = make_gateway(answer)
    xargs = engine_xargs(gw)
    assert set(xargs) == {"pred_len", "pred_hi", "pred_bucket", "deadline"} and xargs["pred_len"] == 185
    assert dropped(gw) == {"absent": 1}


MALFORMED = {
    "a probability is nan": {"probs": [0.4, 0.3, math.nan, 0.1]},
    "a probability is infinite": {"probs": [0.4, 0.3, math.inf, 0.1]},
    "a probability is negative": {"probs": [0.5, 0.4, 0.2, -0.1]},
    "not summing to 1": {"probs": [0.4, 0.3, 0.2, 0.2]},
    "one probability short": {"probs": [0.4, 0.3, 0.3]},
    "no probabilities": {"probs": None},
    "the scheme's lower edges (leading 0)": {"edges": [0, 100, 200, 400]},
    "edges not increasing": {"edges": [200, 100, 400]},
    "a fractional edge": {"edges": [100.5, 200, 400]},
    "edges not a list": {"edges": "100,200,400"},
    "no edges but the probabilities": {"edges": [], "probs": [1.0]},
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_distribution_is_dropped_and_counted_never_the_request(make_gateway, case):
    answer = sidecar_answer()
    answer["predictions"][0].update(MALFORMED[case])
    gw = make_gateway(answer)
    xargs = engine_xargs(gw)
    assert set(xargs) == {"pred_len", "pred_hi", "pred_bucket", "deadline"} and xargs["pred_len"] == 185
    assert dropped(gw) == {"invalid": 1}
    assert gw.metrics.predictions.labels("sidecar")._value.get() == 1  # the point prediction is the sidecar's still


def test_fallback_and_client_predictions_send_no_distribution(make_gateway):
    assert set(engine_xargs(make_gateway())) == {"pred_len", "deadline"}  # no sidecar: the fallback
    trusting = make_gateway(sidecar_answer(), trust_client_predictions=True)
    client = engine_xargs(trusting, {"x-lengthwise-pred-len": "300"})
    assert set(client) == {"pred_len", "deadline"} and client["pred_len"] == 300 and dropped(trusting) == {}


# --- the plug-in: parse_inputs and re-prediction ---------------------------------------------------------------
def test_parse_inputs_reads_the_gateways_distribution_into_the_prediction(make_gateway):
    x = parse_inputs(engine_xargs(make_gateway(sidecar_answer())), arrival=1000.0, max_tokens=1000, default_pred_len=256)
    assert x.invalid is None and not x.fallback_prediction
    assert x.prediction.length == 185 and x.prediction.hi == 100 and x.prediction.bucket == 0
    assert x.prediction.edges == (100, 200, 400) and x.prediction.probs == pytest.approx(tuple(PROBS))


def test_parse_inputs_refuses_a_malformed_distribution_sent_to_the_engine_directly():
    x = parse_inputs({"pred_len": 50, "pred_edges": [100, 200], "pred_probs": [0.5, math.nan, 0.5]}, arrival=0.0,
                     max_tokens=None, default_pred_len=256)
    assert x.invalid and x.invalid.startswith("pred_probs") and x.fallback_prediction and x.prediction.probs is None


def test_remaining_after_is_the_conditional_remaining_length_with_a_distribution_and_doubling_without():
    p = Prediction(length=10, edges=(100, 200), probs=(0.5, 0.3, 0.2))
    # 150 generated: [100,200) cut to [150,200) (centre 175, mass 0.3), the open [200, 2*200) (centre 300, mass 0.2)
    assert p.remaining_after(150) == pytest.approx((0.3 * 175 + 0.2 * 300) / 0.5 - 150)  # 75
    assert Prediction(length=10).remaining_after(150) == 16  # doubling, at least 16
    assert Prediction(length=40).remaining_after(150) == 40


def test_a_request_that_outlived_the_sidecars_prediction_is_re_predicted_by_its_distribution(make_gateway):
    pred = parse_inputs(engine_xargs(make_gateway(sidecar_answer())), arrival=1000.0, max_tokens=1000,
                        default_pred_len=256).prediction
    # 250 generated, past the 185 predicted: [250,400) (centre 325, mass 0.2) and [400,800) (centre 600, mass 0.1)
    assert pred.remaining_after(250) == pytest.approx((0.2 * 325 + 0.1 * 600) / 0.3 - 250)  # 166.7, not 185 again
    assert pred.remaining_after(450) == pytest.approx((450 + 800) / 2 - 450)  # only the open bucket is left: 175
