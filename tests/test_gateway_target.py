"""The gateway checks that its predictor was made for the model it serves (serving/gateway/target.py).

Real parts: ``lengthwise serve`` runs as a real process against a sidecar over real HTTP: the real ``predictor-sidecar``
serving a tiny exported package for the end-to-end case, and for the matrix of verdicts a small uvicorn app that
answers ``/ready``, ``/health`` and ``/v1/predict`` as the sidecar does with a target the test sets (and can stop and
start); the in-process gateway talks to that same server. No engine is needed: a mismatch stops the command before it
attaches to engines, and the other verdicts are read from its log before it gives up on an engine that is not there.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fastapi import FastAPI, HTTPException

from predictor.target import make_target, model_id
from serving.gateway.gateway import Call, Gateway
from serving.gateway.settings import GatewaySettings
from serving.gateway.target import TargetCheck, judge
from serving.launch.process import free_port
from tests.datafiles import need_data
from tests.threaded_server import ThreadedServer

OVERRIDE = "--allow-predictor-for-other-model"


class StandInSidecar:
    """A real HTTP server with the sidecar's ``/ready``, ``/health`` and ``/v1/predict``; ``target`` and ``loaded``
    say what it reports (``target`` None: a version with no recorded target; ``missing``: an older sidecar)."""

    def __init__(self, port: int | None = None) -> None:
        self.target: dict | None | str = None
        self.loaded = True
        app = FastAPI()

        @app.get("/ready")
        def ready():
            if not self.loaded:
                raise HTTPException(503, "no model loaded yet")
            return {"status": "ready", "model_name": "length-predictor", "model_version": "7", "model_uri": "x",
                    "from_cache_only": False}

        @app.get("/health")
        def health():
            return {"status": "ok"} if self.target == "missing" else {"status": "ok", "target": self.target}

        @app.post("/v1/predict")
        def predict():
            return {"predictions": [{"bucket": 1, "range": [64, 256], "expected_tokens": 120.0, "quantile_tokens": 200.0,
                                     "prediction_id": "p", "model_name": "length-predictor", "model_version": "7"}]}

        self._http = ThreadedServer(app, "the stand-in sidecar", port=port)
        self.url = self._http.url

    def stop(self) -> None:
        self._http.stop()


@pytest.fixture(scope="module")
def sidecar():
    sc = StandInSidecar()
    yield sc
    sc.stop()


@pytest.fixture(scope="module")
def served(data, tmp_path_factory) -> tuple[Path, str]:
    """A local model directory (config, tokenizer) as ``--model``, and its identity."""
    d = tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 50257}))
    shutil.copyfile(need_data("tokenizers/gpt2/tokenizer.json"), d / "tokenizer.json")
    return d, model_id(d, d.name)


def target_for(model: str | None) -> dict:
    return make_target(model, "served model's own output tokens", "relabel of sharegpt by the served model",
                       {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}, 1024)


OTHER = "SmolLM2-360M-Instruct@0123456789ab"


# --- the verdict ----------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_the_verdict_from_what_the_sidecar_reports():
    me = "SmolLM2-135M-Instruct@0123456789ab"
    assert judge(me, {"target": target_for(me)}).state == "match"
    assert judge(me, {"target": target_for(OTHER)}).state == "mismatch"
    assert judge(me, {"target": target_for("SmolLM2-135M-Instruct@ba9876543210")}).state == "mismatch"  # other files
    by_name = judge("HuggingFaceTB/SmolLM2-135M-Instruct", {"target": target_for(me)})
    assert (by_name.state, by_name.by_name) == ("match", True)
    assert judge(me, {"target": target_for("ChatGPT")}).state == "mismatch"  # dataset answers are another model's
    for body in ({"target": None}, {"status": "ok"}, {"target": "unknown: no model loaded yet"}, {"target": target_for(None)}):
        assert judge(me, body).state == "unknown", body
    assert judge(None, {"target": target_for(OTHER)}).state == "unchecked"  # no --model to compare with


# --- lengthwise serve at start --------------------------------------------------------------------------------------
def _serve(*args: str) -> subprocess.CompletedProcess:
    """``lengthwise serve`` attached to an engine that is not there: after the predictor check it gives up in 1 s."""
    return subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--engine-url", f"http://127.0.0.1:{free_port()}",
                           "--engine-start-timeout", "1", "--port", "0", *args], capture_output=True, text=True,
                          timeout=120, check=False, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})


def test_a_predictor_for_another_model_stops_the_gateway_with_one_line(sidecar, served):
    model_dir, me = served
    sidecar.target, sidecar.loaded = target_for(OTHER), True
    r = _serve("--model", str(model_dir), "--predictor-url", sidecar.url)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("lengthwise serve: error: the predictor at " + sidecar.url)
    for words in (OTHER, me, "length-predictor version 7", "lengthwise relabel", OVERRIDE):
        assert words in lines[0], words
    assert "no engine answered" not in r.stderr  # refused before the engines were even asked


@pytest.mark.parametrize(("case", "log_words"), [
    ("match", "predictor target match: the predictor (length-predictor version 7) predicts lengths of"),
    ("override", f"predictor for another model: the predictor (length-predictor version 7) predicts lengths of {OTHER}"),
    ("unknown", "predictor target unknown: the predictor records no target model"),
    ("older sidecar", "predictor target unknown: the sidecar does not report"),
    ("loading", "predictor target loading: the sidecar at"),
])
def test_other_verdicts_are_logged_at_start_and_the_gateway_goes_on(sidecar, served, case, log_words):
    model_dir, me = served
    sidecar.loaded = case != "loading"
    sidecar.target = {"match": target_for(me), "override": target_for(OTHER), "unknown": None,
                      "older sidecar": "missing", "loading": None}[case]
    r = _serve("--model", str(model_dir), "--predictor-url", sidecar.url, *([OVERRIDE] if case == "override" else []))
    assert r.returncode == 2 and "no engine answered /health within 1 s" in r.stderr, r.stderr  # it went on to the engines
    assert log_words in r.stderr, r.stderr
    if case != "match":
        assert "WARNING serving.gateway: predictor" in r.stderr
    sidecar.loaded = True


def test_an_unreachable_sidecar_is_a_warning_as_before(served):
    r = _serve("--model", str(served[0]), "--predictor-url", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 2 and "no engine answered" in r.stderr, r.stderr
    assert "predictor target unreachable" in r.stderr and "checked again later" in r.stderr


# --- the running gateway ---------------------------------------------------------------------------------------------
def _gateway(sidecar: StandInSidecar, model_dir: Path, **settings) -> Gateway:
    return Gateway(GatewaySettings(engine_urls=[f"http://127.0.0.1:{free_port()}"], model=str(model_dir),
                                   predictor_url=sidecar.url, predictor_timeout_ms=5000, **settings))


def _request(gw: Gateway):
    return gw.validate("completion", json.dumps({"model": "m", "prompt": "Tell me a story", "max_tokens": 500}).encode())


def test_with_the_override_the_mismatch_is_counted_and_shown(sidecar, served):
    from fastapi.testclient import TestClient

    from serving.gateway.app import create_app
    from serving.gateway.target import check

    model_dir, me = served
    sidecar.target = target_for(OTHER)
    settings = GatewaySettings(engine_urls=[f"http://127.0.0.1:{free_port()}"], model=str(model_dir),
                               predictor_url=sidecar.url, predictor_timeout_ms=5000, allow_predictor_for_other_model=True)

    async def verdict() -> TargetCheck:
        import httpx

        async with httpx.AsyncClient() as client:
            return await check(sidecar.url, me, client)

    app = create_app(settings, predictor_target=asyncio.run(verdict()))
    with TestClient(app) as client:
        h = client.get("/health").json()["predictor_target"]
        assert (h["state"], h["served_model"], h["predictor_model"], h["override"]) == ("mismatch", me, OTHER, True)
        assert h["target"]["max_tokens"] == 1024 and h["predictor_version"] == "length-predictor version 7"
        gw = app.state.gateway
        for _ in range(2):
            pred = client.portal.call(gw.predict, Call("completion"), _request(gw), {})  # on the app's event loop
            assert pred.source == "sidecar" and pred.tokens == 120  # used, as the operator asked
        metrics = client.get("/metrics").text
    assert "lengthwise_gateway_predictor_target_mismatch 1.0" in metrics
    assert "lengthwise_gateway_predictions_for_other_model_total 2.0" in metrics


def test_a_mismatch_found_after_start_stops_the_predictions_until_it_is_fixed(sidecar, served):
    """The sidecar's alias moved to a predictor for another model while the gateway ran: without the override its
    predictions are not used (fallback, reason other_model) until the sidecar serves one for this model again."""
    model_dir, me = served
    sidecar.target = target_for(me)

    async def run() -> None:
        gw = _gateway(sidecar, model_dir, predictor_check_interval_s=0.05)
        await gw.start()
        try:
            await _until(lambda: gw.target.current.state == "match")
            assert (await gw.predict(Call("completion"), _request(gw), {})).source == "sidecar"
            sidecar.target = target_for(OTHER)
            await _until(lambda: gw.target.current.state == "mismatch")
            pred = await gw.predict(Call("completion"), _request(gw), {})
            assert (pred.source, pred.reason) == ("fallback", "other_model")
            assert gw.health()["predictor_target"]["override"] is False
            assert gw.metrics.predictor_target_mismatch._value.get() == 1
            sidecar.target = target_for(me)
            await _until(lambda: gw.target.current.state == "match")
            assert (await gw.predict(Call("completion"), _request(gw), {})).source == "sidecar"
            assert gw.metrics.predictor_target_mismatch._value.get() == 0
            assert gw.metrics.other_model_predictions._value.get() == 0
        finally:
            await gw.aclose()

    asyncio.run(run())


def test_a_sidecar_down_at_start_is_judged_when_it_answers(served):
    """Unreachable at start: as before, the gateway serves (on the fallback); once the sidecar answers, its predictor
    is judged, and one for another model is then not used."""
    model_dir = served[0]
    port = free_port()

    async def run() -> None:
        gw = Gateway(GatewaySettings(engine_urls=[f"http://127.0.0.1:{free_port()}"], model=str(model_dir),
                                     predictor_url=f"http://127.0.0.1:{port}", predictor_check_interval_s=0.05))
        await gw.start()
        try:
            await _until(lambda: gw.target.current.state == "unreachable")
            assert not gw.target.refuses and gw.health()["predictor_target"]["state"] == "unreachable"
            sc = await asyncio.to_thread(StandInSidecar, port)
            try:
                sc.target = target_for(OTHER)
                await _until(lambda: gw.target.current.state == "mismatch")
                assert gw.target.refuses
            finally:
                await asyncio.to_thread(sc.stop)
        finally:
            await gw.aclose()

    asyncio.run(run())


async def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


# --- the real sidecar -----------------------------------------------------------------------------------------------
def test_the_real_sidecar_serving_a_package_for_another_model_stops_the_gateway(data, served, tmp_path):
    """End to end: a package exported with its target, served by ``predictor-sidecar``, judged by ``lengthwise serve``."""
    from tests.sidecar_proc import start_sidecar
    from tests.tiny_package import tiny_packages

    model_dir, me = served
    pkgs = tiny_packages(tmp_path, need_data("tokenizers/gpt2/tokenizer.json"), {"other": target_for(OTHER),
                                                                               "mine": target_for(me)})
    env = {"LENGTHWISE_HOME": str(tmp_path / "home")}
    sc = start_sidecar(tmp_path, "--model", str(pkgs["other"]), env=env)
    try:
        r = _serve("--model", str(model_dir), "--predictor-url", sc.url)
    finally:
        sc.stop()
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and OTHER in lines[0] and me in lines[0], r.stderr
    sc = start_sidecar(tmp_path, "--model", str(pkgs["mine"]), env=env)
    try:
        r = _serve("--model", str(model_dir), "--predictor-url", sc.url)
    finally:
        sc.stop()
    assert r.returncode == 2 and "no engine answered" in r.stderr and f"predicts lengths of {me}" in r.stderr, r.stderr
