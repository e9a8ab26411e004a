"""The gateway's feedback carries the engine's finish reason: read from a whole answer and from a stream's last
chunk, and posted to a real sidecar process, where a capped answer becomes a censored row of its feedback store."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from monitoring.feedback_store import FeedbackStore
from serving.gateway.feedback import finish_reason_of
from serving.gateway.forward import Outcome
from serving.gateway.gateway import Call
from serving.gateway.prediction import LengthPrediction
from serving.gateway.sse import StreamRelay
from tests.sidecar_proc import start_sidecar, wait_for


@pytest.mark.unit
@pytest.mark.parametrize(("answer", "reason"), [
    ({"choices": [{"text": "hi", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}, "length"),
    ({"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}, "stop"),
    ({"choices": [{"delta": {"content": "hi"}, "finish_reason": None}]}, None),
    ({"choices": []}, None), ({"error": "x"}, None), (["not", "an", "answer"], None),
])
def test_finish_reason_of_an_answer(answer, reason):
    assert finish_reason_of(answer) == reason


@pytest.mark.unit
def test_a_stream_keeps_the_finish_reason_of_its_last_chunk():
    relay = StreamRelay(wants_usage=False)
    for chunk in ({"choices": [{"index": 0, "text": "a", "finish_reason": None}]},
                  {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]},
                  {"choices": [], "usage": {"completion_tokens": 2}}):
        relay.relay(json.dumps(chunk))
    relay.relay("[DONE]")
    assert relay.finish_reason == "length" and relay.completion_tokens == 2


def test_the_gateway_sends_the_finish_reason_to_a_real_sidecar(trained, make_gateway, tmp_path):
    db = tmp_path / "feedback.db"
    sc = start_sidecar(tmp_path, "--model", str(Path(trained["work_dir"]) / "package"), "--reload-interval", "0",
                       "--feedback-db", str(db))
    try:
        gw = make_gateway(predictor_url=sc.url)
        req = gw.validate("completion", json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 16}).encode())
        preds = sc.post("/v1/predict", json={"prompts": ["Tell me a story", "Tell me a joke"]}).json()["predictions"]

        async def finish() -> None:
            for p, reason in zip(preds, ["length", "something-new"]):
                call = Call("completion", pred=LengthPrediction(
                    16, "sidecar", bucket=p["bucket"], expected_tokens=p["expected_tokens"], prediction_id=p["prediction_id"],
                    model_name=p["model_name"], model_version=p["model_version"]))
                gw.finished(call, req, Outcome(200, "engine-0", completion_tokens=16, finish_reason=reason))
            await asyncio.wait(set(gw.feedback.pending), timeout=30)
            await gw.feedback.client.aclose()  # in the loop its connections were made in

        asyncio.run(finish())
        store = FeedbackStore(db)
        rows = wait_for(lambda: len(store.read()) == 2 and store.read(), what="both rows in the store")
        by_id = {r.prediction_id: r for r in rows}
        capped, odd = by_id[preds[0]["prediction_id"]], by_id[preds[1]["prediction_id"]]
        assert capped.finish_reason == "length" and capped.censored and capped.actual_tokens == 16
        assert odd.finish_reason is None and not odd.censored  # an unknown reason is left out, not the whole feedback
        assert sc.metric("lengthwise_online_feedback_censored", model_version=preds[0]["model_version"]) == 1
    finally:
        sc.stop()
