"""Refinements through the gateway: at each point of ``--refine-at`` the sidecar reads the answer so far and the
request's engine queues what it predicts is left; whatever fails on the way, the answer itself is untouched.

Real parts: ``lengthwise serve``; the prediction sidecar serving a trained package marked as trained on answers so far
(the delivery is under test here, not the model's quality: python -m serving.bench.predictor.remaining measures that);
the scheduler plug-in's own port (serving/engine/channel.py) on a stand-in engine (tests/standin_engine.py) that
streams one token every 20 ms. tests/test_engine_refine.py covers that port in front of vLLM's real scheduler.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import httpx
import pytest

from serving.launch.process import free_port
from tests.gateway_proc import Gateway, start_gateway
from tests.sidecar_proc import start_sidecar, wait_for
from tests.standin_engine import MODEL, StandInEngine

POINTS = (4, 8, 16)
OUTCOME = "lengthwise_gateway_refinements_total"


@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("refine")


@pytest.fixture(scope="module")
def engine():
    e = StandInEngine(plugin=True)
    yield e
    e.stop()


@pytest.fixture(scope="module")
def sidecar(trained, logs):
    marked = logs / "remaining"
    shutil.copytree(Path(trained["work_dir"]) / "package", marked)
    meta = json.loads((marked / "meta.json").read_text())
    (marked / "meta.json").write_text(json.dumps({**meta, "remaining_length": True}))
    sc = start_sidecar(logs, "--model", str(marked), "--reload-interval", "0")
    yield sc
    sc.stop()


def _gateway(logs: Path, engine: StandInEngine, predictor_url: str, timeout_ms: str = "5000",
             first_ms: str = "5000") -> Gateway:
    return start_gateway(logs, "--engine-url", engine.url, "--engine-metrics-url", engine.metrics_url,
                         "--predictor-url", predictor_url, "--predictor-timeout-ms", first_ms,
                         "--allow-predictor-for-other-model", "--refine-at", ",".join(map(str, POINTS)),
                         "--refine-timeout-ms", timeout_ms, "--health-interval", "0.5",
                         env={"LENGTHWISE_API_KEY": "", "LENGTHWISE_ENGINE_API_KEY": ""})


@pytest.fixture(scope="module")
def gw(logs, engine, sidecar):
    g = _gateway(logs, engine, sidecar.url)
    yield g
    g.stop()


def _stream(gw: Gateway, prompt: str) -> tuple[str, str]:
    """The answer's text, streamed through the gateway, and the gateway's id of the request."""
    text = []
    with httpx.stream("POST", gw.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 64, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        rid = r.headers["x-lengthwise-request-id"]
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), rid


def _outcomes(gw: Gateway) -> dict[str, float]:
    names = ("delivered", "late", "busy", "refused", "sidecar_error", "gone", "engine_error", "no_port")
    return {k: v for k in names if (v := gw.metric(OUTCOME, outcome=k))}


def test_a_streamed_answer_is_refined_at_each_point_and_its_engine_queues_it(gw, engine):
    text, rid = _stream(gw, "count:30")
    assert text == "".join(f"t{i} " for i in range(30))  # the relay is untouched
    wait_for(lambda: sum(_outcomes(gw).values()) == len(POINTS), timeout=20, what="every point's refinement ended")
    outcomes = _outcomes(gw)
    mine = [u for u in engine.inbox.seen if u.ref == rid]
    assert outcomes.get("delivered", 0) == len(mine) >= 1, outcomes
    assert set(outcomes) <= {"delivered", "busy"}, outcomes  # busy: the previous point's call was still out
    assert [u.generated_tokens for u in mine] == sorted(u.generated_tokens for u in mine)
    assert {u.generated_tokens for u in mine} <= set(POINTS) and mine[0].generated_tokens == POINTS[0]
    assert all(u.pred_len > 0 and u.pred_edges and u.pred_probs for u in mine)
    assert gw.metric("lengthwise_gateway_refinement_delay_seconds_count") == len(mine)
    assert gw.metric("lengthwise_scheduler_refinements_received_total") == len(engine.inbox.seen)  # re-exported


def test_an_engine_that_no_longer_runs_the_request_refuses_its_refinement_and_nothing_else_changes(gw, engine):
    before = _outcomes(gw)
    received = len(engine.inbox.seen)
    text, _ = _stream(gw, "lost:12")  # the stand-in streams as an engine that started again since: the ref is unknown
    assert text == "".join(f"t{i} " for i in range(12))
    wait_for(lambda: sum(_outcomes(gw).values()) - sum(before.values()) == 2, timeout=20, what="both points ended")
    assert _outcomes(gw).get("gone", 0) - before.get("gone", 0) >= 1 and len(engine.inbox.seen) == received


def test_a_sidecar_that_is_down_or_late_costs_refinements_and_never_the_answer(logs, engine):
    silent = socket.socket()  # accepts connections and never answers: a hung sidecar
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    down = _gateway(logs, engine, f"http://127.0.0.1:{free_port()}", first_ms="300")
    late = _gateway(logs, engine, f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_ms="50", first_ms="300")
    try:
        for gw, outcome in ((down, "sidecar_error"), (late, "late")):
            text, _ = _stream(gw, "count:20")
            assert text == "".join(f"t{i} " for i in range(20))
            wait_for(lambda gw=gw: sum(_outcomes(gw).values()) == len(POINTS), timeout=20, what="every point ended")
            assert set(_outcomes(gw)) <= {outcome, "busy"} and _outcomes(gw)[outcome] >= 1, _outcomes(gw)
    finally:
        down.stop()
        late.stop()
        silent.close()


def test_a_non_streamed_request_is_read_as_a_stream_refined_and_answered_whole(gw, engine):
    r = gw.post("/v1/completions", json={"model": MODEL, "prompt": "count:20", "max_tokens": 64})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "".join(f"t{i} " for i in range(20))
    rid = r.headers["x-lengthwise-request-id"]
    wait_for(lambda: any(u.ref == rid for u in engine.inbox.seen), timeout=20, what="a refinement of the request")


def test_a_chat_stream_is_put_back_together_as_vllm_answers_it_whole():
    from serving.gateway.assemble import Assembler, assembles
    from serving.gateway.requests import ClientRequest

    whole = Assembler(chat=True)
    events = [{"id": "chatcmpl-1", "created": 5, "model": "m", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                                  "content": ""}}]},
              {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"reasoning": "hm. "}}]},
              {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]},
              {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop",
                                                "stop_reason": None}]},
              {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3,
                                                           "total_tokens": 6}}]
    for e in events:
        whole.add(json.dumps(e))
    whole.add("[DONE]")
    got = whole.answer()
    assert got["id"] == "chatcmpl-1" and got["object"] == "chat.completion" and got["usage"]["completion_tokens"] == 3
    message = got["choices"][0]["message"]
    assert (message["role"], message["content"], message["reasoning"], message["tool_calls"]) == ("assistant", "Hello",
                                                                                                 "hm. ", None)
    assert got["choices"][0]["finish_reason"] == "stop"

    def req(**body) -> ClientRequest:
        return ClientRequest("chat", body, MODEL, bool(body.get("stream")), False, 16, body.get("n", 1))

    assert assembles(req()) and assembles(req(n=1, logprobs=False))
    assert not any(assembles(req(**b)) for b in ({"n": 2}, {"logprobs": True}, {"tools": [{}]}, {"stream": True}))


@pytest.mark.slow
def test_the_cost_bench_runs_both_arms_and_loses_nothing(trained, tmp_path):
    """Engine, sidecar and gateways for real: a short run of each arm (the default tier checks its parts above)."""
    from serving.bench.refine_cost import main

    package = tmp_path / "remaining"
    shutil.copytree(Path(trained["work_dir"]) / "package", package)
    meta = json.loads((package / "meta.json").read_text())
    (package / "meta.json").write_text(json.dumps({**meta, "remaining_length": True}))
    out = tmp_path / "cost.json"
    assert main(["--package", str(package), "--requests", "8", "--rate", "2", "--refine-at", "4,16",
                 "--json", str(out), "--work-dir", str(tmp_path / "work")]) == 0
    doc = json.loads(out.read_text())
    assert [a["arm"] for a in doc["arms"]] == ["off", "on", "on", "off"] and doc["summary"]["lost_or_wrong"] == 0
    assert all(not a["refinements"] for a in doc["arms"] if a["arm"] == "off")
    assert any(a["refinements"].get("delivered", 0) for a in doc["arms"] if a["arm"] == "on")
    assert any(a["refinements_applied"] for a in doc["arms"] if a["arm"] == "on")  # the plug-in took them
