"""No client shapes what the gateway learns of a model's lengths: a catalogue name's ``profile`` learns only answers
whose length is the model's own, by the rules the sidecar's feedback keeps (serving/policy/learnable.py), and one
client key holds at most a quarter of its window.

Real parts: the gateway app in this process (``create_app``, its lifespan, three client keys, a catalogue), an engine
over HTTP that answers as vLLM does where lengths are concerned (an answer of the prompt's own length, cut at
``max_tokens`` with ``finish_reason`` "length"), and a recording sidecar (tests/recording_sidecar.py) for the
feedback side. No vLLM: what is under test is what the gateway learns from the answers, not how they are generated.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from monitoring.online import Feedback
from serving.gateway.app import create_app
from serving.gateway.settings import GatewaySettings
from tests.recording_sidecar import RecordingSidecar
from tests.sidecar_proc import wait_for
from tests.threaded_server import ThreadedServer

NAME = "smollm2-terse"
HONEST = (12, 15, 17, 19, 20, 22, 24, 27)  # the model's own lengths of the honest prompts: mean 19.5
KEYS = ("key-honest-one", "key-honest-two", "key-attacker")


class LengthEngine:
    """A real HTTP server answering ``/v1/completions`` as vLLM does where the length is concerned: the prompt
    ``"<length> <finish reason>"`` is answered in that many tokens ending with that reason, unless ``max_tokens`` cuts
    it first ("length"); ``n`` sequences each as long, their sum in ``usage``. ``bodies`` records what it was sent."""

    def __init__(self, models: tuple[str, ...]) -> None:
        self.bodies: list[dict] = []
        cards = [{"id": m, "object": "model", "max_model_len": 2048} for m in models]
        app = Starlette(routes=[Route("/health", lambda r: Response(status_code=200)),
                                Route("/metrics", lambda r: PlainTextResponse("")),
                                Route("/v1/models", lambda r: JSONResponse({"object": "list", "data": cards})),
                                Route("/v1/completions", self._complete, methods=["POST"])])
        self._http = ThreadedServer(app, "the length engine")
        self.url = self._http.url

    async def _complete(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        length, reason = body["prompt"].split()
        tokens, cap = int(length), body.get("max_tokens")
        if cap is not None and cap < tokens:
            tokens, reason = cap, "length"
        n = body.get("n") or 1
        return JSONResponse({"id": "cmpl-length", "object": "text_completion", "created": 0, "model": body["model"],
                             "choices": [{"index": i, "text": "x" * tokens, "finish_reason": reason} for i in range(n)],
                             "usage": {"prompt_tokens": 2, "completion_tokens": n * tokens,
                                       "total_tokens": 2 + n * tokens}})

    def stop(self) -> None:
        self._http.stop()


@pytest.fixture
def engine():
    e = LengthEngine((NAME,))
    yield e
    e.stop()


def _app(tmp_path: Path, entries: str, serves: dict[str, list[str]]) -> FastAPI:
    """The gateway app with three client keys over the catalogue ``entries``; ``serves``: each engine's URL and the
    names it serves (as ``serve --models`` passes the attached entries' engines)."""
    keys = tmp_path / "keys"
    keys.write_text("\n".join(KEYS) + "\n")
    models = tmp_path / "models.yaml"
    models.write_text(entries)
    settings = GatewaySettings(models_file=models, api_key_file=keys, fallback_tokens=100, health_interval_s=0.5)
    return create_app(settings, list(serves), serves=serves)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_150_answers_cut_at_max_tokens_1_from_one_key_do_not_move_the_profile(engine, tmp_path):
    """The attack as it was: one key sends 150 requests with ``max_tokens: 1``. Before, the profile's mean went from
    19.5 to 1.5 tokens and the next honest request was predicted at 1 token; now the cut answers are refused and the
    honest request is predicted at the honest mean."""
    app = _app(tmp_path, f'- {{name: {NAME}, engine_urls: ["{engine.url}"], predictor: profile}}\n', {engine.url: [NAME]})
    with TestClient(app) as client:
        def ask(key: str, prompt: str, max_tokens: int):
            r = client.post("/v1/completions", headers=_auth(key),
                            json={"model": NAME, "prompt": prompt, "max_tokens": max_tokens})
            assert r.status_code == 200, r.text
            return r

        for i, length in enumerate(HONEST * 2):  # two honest keys, each answer the model's own
            ask(KEYS[i % 2], f"{length} stop", 256)
        before = client.get("/health").json()["models"][NAME]["predictor"]
        assert (before["answers"], before["mean_tokens"], before["refused"]) == (16, 19.5, 0)
        for _ in range(150):
            ask(KEYS[2], f"{HONEST[3]} stop", 1)
        after = client.get("/health").json()["models"][NAME]["predictor"]
        honest = ask(KEYS[0], f"{HONEST[0]} stop", 256)
    assert after == {**before, "refused": 150}  # every cut answer refused, the profile as the honest answers left it
    assert honest.headers["x-lengthwise-prediction"] == "profile"
    assert min(HONEST) <= int(honest.headers["x-lengthwise-pred-len"]) <= max(HONEST)
    assert int(honest.headers["x-lengthwise-pred-len"]) == round(sum(HONEST) / len(HONEST))
    # the engine hears which key sent each request, by its label and never the key, for its own learners' caps
    clients = [b["vllm_xargs"].get("client") for b in engine.bodies]
    assert clients[:2] == ["key-0", "key-1"] and set(clients[16:166]) == {"key-2"}
    assert not any(key in json.dumps(b) for b in engine.bodies for key in KEYS)


# (request fields, the answer's own length and finish reason): what the sidecar's feedback and the profile must agree on
CASES = [
    ({}, "20 stop"), ({}, "20 tool_calls"), ({"max_tokens": 5}, "20 stop"), ({}, "20 abort"), ({}, "20 content_filter"),
    ({}, "20 error"), ({}, "20 something-new"), ({"stop": ["."]}, "20 stop"), ({"stop_token_ids": [13]}, "20 stop"),
    ({"ignore_eos": True}, "20 stop"), ({"min_tokens": 10}, "20 stop"), ({"logit_bias": {"13": 5}}, "20 stop"),
    ({"allowed_token_ids": [1, 2]}, "20 stop"), ({"bad_words": ["x"]}, "20 stop"), ({"n": 2}, "20 stop"),
    ({"response_format": {"type": "json_object"}}, "20 stop"), ({"structured_outputs": {"regex": "a+"}}, "20 stop"),
    ({"vllm_xargs": {"my_processor": 1}}, "20 stop"), ({"vllm_xargs": {"pred_len": 1, "client": "key-9"}}, "20 stop"),
    ({"stop": [], "logit_bias": {}, "response_format": {"type": "text"}}, "20 stop"),
]


def test_the_profile_learns_exactly_the_answers_the_sidecar_takes_as_the_models_own(engine, tmp_path):
    """One table, both learners: the profile learns an answer exactly when the gateway reports it to the sidecar and
    the sidecar takes it as uncensored (monitoring/online.py's rule, with the finish reason the sidecar was sent)."""
    sidecar, other = RecordingSidecar(), LengthEngine(("sidecar-predicted",))
    app = _app(tmp_path, f"""
- {{name: {NAME}, engine_urls: ["{engine.url}"], predictor: profile}}
- {{name: sidecar-predicted, engine_urls: ["{other.url}"], predictor_url: "{sidecar.url}"}}
""", {engine.url: [NAME], other.url: ["sidecar-predicted"]})
    verdicts = []
    try:
        with TestClient(app) as client:
            gw = app.state.gateway
            poster = gw.model_predictors.route("sidecar-predicted").feedback
            for fields, prompt in CASES:
                before = gw.model_predictors.profile.state(NAME)
                sidecar.calls.clear()
                for name in (NAME, "sidecar-predicted"):
                    r = client.post("/v1/completions", headers=_auth(KEYS[0]),
                                    json={"model": name, "prompt": prompt, "max_tokens": 64, **fields})
                    assert r.status_code == 200, r.text
                wait_for(lambda: not poster.pending, timeout=10, what="the feedback posted")
                posted = sidecar.paths("/v1/feedback")
                reason = posted[0][2].get("finish_reason") if posted else None
                sidecar_takes = bool(posted) and not Feedback("m", "7", 0, 0, 20.0, None, 20, reason).censored
                after = gw.model_predictors.profile.state(NAME)
                learnt = after["answers"] == before["answers"] + 1
                assert learnt != (after["refused"] == before["refused"] + 1), (fields, prompt)
                verdicts.append(learnt)
                assert learnt == sidecar_takes, (fields, prompt, posted)
    finally:
        sidecar.stop()
        other.stop()
    assert verdicts.count(True) == 5 and verdicts.count(False) == len(CASES) - 5  # both sides of the table are tried
