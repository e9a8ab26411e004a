"""The sidecar's bearer token: in-process over the real app (which endpoints need it, the 401's body and counters,
--protect-health), on the command line (--token-file and LENGTHWISE_SIDECAR_TOKEN, never printed), and end to end:
a real sidecar process with a token, asked and told by the gateway's own predictor and feedback clients."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from predictor.sidecar.app import create_app
from predictor.sidecar.cache import ResolvedModel, parse_uri
from predictor.sidecar.cli import build_parser, resolve_token
from predictor.sidecar.settings import SidecarSettings
from serving.gateway.gateway import Call
from tests.conftest import metric_values
from tests.sidecar_proc import start_sidecar, wait_for

TOKEN = "s3cret-sidecar-token-0123456789"
NAME = "lp-auth-test"


@pytest.fixture(scope="module")
def package(trained) -> Path:
    return Path(trained["work_dir"]) / "package"


def open_client(package: Path, tmp: Path, **settings) -> TestClient:
    resolved = ResolvedModel(package, NAME, "1", str(package))
    s = SidecarSettings(model=str(package), feedback_db=str(tmp / "fb.db"), reload_interval=0, **settings)
    client = TestClient(create_app(s, parse_uri(str(package)), resolved))
    client.__enter__()
    wait_for(lambda: client.get("/ready", headers=_auth()).status_code == 200, timeout=120, what="the model to load")
    return client


def _auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def metric(client: TestClient, name: str, **labels: str) -> float | None:
    return next(metric_values(client.get("/metrics", headers=_auth()).text, name, labels), None)


@pytest.fixture(scope="module")
def guarded(package, tmp_path_factory):
    client = open_client(package, tmp_path_factory.mktemp("auth"), token=TOKEN)
    yield client
    client.__exit__(None, None, None)


@pytest.mark.parametrize("headers", [{}, _auth("wrong-token"), {"Authorization": TOKEN}, {"Authorization": "Basic " + TOKEN},
                                     {"Authorization": f"Bearer {TOKEN}x"}])
def test_predict_and_feedback_need_the_token(guarded, headers):
    before = metric(guarded, "lengthwise_sidecar_unauthorized_total", endpoint="/v1/predict") or 0.0
    r = guarded.post("/v1/predict", json={"prompt": "hello"}, headers=headers)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert set(r.json()) == {"detail"} and "Authorization: Bearer" in r.json()["detail"]
    assert TOKEN not in r.text
    assert metric(guarded, "lengthwise_sidecar_unauthorized_total", endpoint="/v1/predict") == before + 1
    rejected = metric(guarded, "lengthwise_sidecar_feedback_rejected_total", reason="unauthorized") or 0.0
    fb = guarded.post("/v1/feedback", json={"request_id": "x", "actual_tokens": 3}, headers=headers)
    assert fb.status_code == 401 and set(fb.json()) == {"detail"}
    assert metric(guarded, "lengthwise_sidecar_feedback_rejected_total", reason="unauthorized") == rejected + 1


def test_the_right_token_is_served_and_probes_stay_open(guarded):
    r = guarded.post("/v1/predict", json={"prompt": "hello", "request_id": "auth-ok"}, headers=_auth())
    assert r.status_code == 200, r.text
    fb = guarded.post("/v1/feedback", json={"request_id": "auth-ok", "actual_tokens": 7}, headers=_auth())
    assert fb.status_code == 200 and fb.json()["accepted"] is True
    for path in ("/health", "/ready", "/metrics"):
        assert guarded.get(path).status_code == 200, path  # load balancers and Prometheus carry no token
    assert metric(guarded, "lengthwise_sidecar_unauthorized_total", endpoint="/health") in (None, 0.0)


def test_protect_health_closes_the_probes_too(package, tmp_path):
    client = open_client(package, tmp_path, token=TOKEN, protect_health=True)
    try:
        for path in ("/health", "/ready", "/metrics"):
            r = client.get(path)
            assert r.status_code == 401 and "detail" in r.json(), path
            assert client.get(path, headers=_auth()).status_code == 200, path
        assert metric(client, "lengthwise_sidecar_unauthorized_total", endpoint="/metrics") == 1
    finally:
        client.__exit__(None, None, None)


def test_without_a_token_the_sidecar_is_open(package, tmp_path):
    client = open_client(package, tmp_path)
    try:
        assert client.post("/v1/predict", json={"prompt": "hello"}).status_code == 200
    finally:
        client.__exit__(None, None, None)


@pytest.mark.unit
def test_the_token_comes_from_the_flag_the_file_or_the_environment(tmp_path, monkeypatch):
    p = build_parser()
    monkeypatch.delenv("LENGTHWISE_SIDECAR_TOKEN", raising=False)
    assert resolve_token(p.parse_args([]), p) is None
    assert resolve_token(p.parse_args(["--token", "abc"]), p) == "abc"
    f = tmp_path / "token"
    f.write_text("  from-a-file\n")
    assert resolve_token(p.parse_args(["--token-file", str(f)]), p) == "from-a-file"
    monkeypatch.setenv("LENGTHWISE_SIDECAR_TOKEN", "from-env")
    assert resolve_token(p.parse_args([]), p) == "from-env"
    assert resolve_token(p.parse_args(["--token", "abc"]), p) == "abc"  # the flag wins over the environment
    assert "SecretStr" in repr(SidecarSettings(token="abc")) and "abc" not in repr(SidecarSettings(token="abc"))


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "message"), [
    (["--token-file", "/nonexistent/token"], "--token-file: cannot read /nonexistent/token"),
    (["--token", "a", "--token-file", "TOKENFILE"], "give --token or --token-file, not both"),
    (["--token", "  "], "--token is empty"),
    (["--protect-health"], "--protect-health needs a token"),
])
def test_a_bad_token_setting_exits_2_with_one_line(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("LENGTHWISE_SIDECAR_TOKEN", raising=False)
    (tmp_path / "token").write_text("abc\n")
    argv = [str(tmp_path / "token") if a == "TOKENFILE" else a for a in argv]
    p = build_parser()
    with pytest.raises(SystemExit) as exc:
        resolve_token(p.parse_args(argv), p)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err


@pytest.mark.unit
def test_help_documents_the_token():
    words = " ".join(build_parser().format_help().split())
    for flag in ("--token TOKEN", "--token-file PATH", "--protect-health", "LENGTHWISE_SIDECAR_TOKEN", "--max-actual-tokens"):
        assert flag in words, flag


def test_the_gateways_clients_reach_a_real_sidecar_with_a_token(package, make_gateway, tmp_path, monkeypatch):
    """A sidecar process whose token comes from a file: the gateway's predictor and feedback clients with the token get
    a prediction and an accepted feedback; without it the request runs on the fallback, counted as rejected; the token
    is in no log line."""
    (tmp_path / "token").write_text(TOKEN + "\n")
    monkeypatch.delenv("LENGTHWISE_SIDECAR_TOKEN", raising=False)
    sc = start_sidecar(tmp_path, "--model", str(package), "--reload-interval", "0", "--feedback-db", str(tmp_path / "fb.db"),
                       "--token-file", str(tmp_path / "token"), "--log-level", "debug")
    try:
        assert sc.post("/v1/predict", json={"prompt": "hi"}).status_code == 401
        gw = make_gateway(predictor_url=sc.url, predictor_timeout_ms=10_000, predictor_token=TOKEN)
        bare = make_gateway(predictor_url=sc.url, predictor_timeout_ms=10_000)
        body = json.dumps({"model": "m", "prompt": "Tell me a story about a dragon", "max_tokens": 300}).encode()

        async def main() -> tuple:
            pred = await gw.predict(Call("completion"), gw.validate("completion", body), {})
            gw.feedback.submit(pred, 42, 1, "stop")
            await asyncio.wait(set(gw.feedback.pending), timeout=30)
            refused = await bare.predict(Call("completion"), bare.validate("completion", body), {})
            for client in (gw.feedback.client, gw.predictor.client, bare.predictor.client):
                await client.aclose()  # their connections belong to this loop
            return pred, refused

        pred, refused = asyncio.run(main())
        assert pred.source == "sidecar" and pred.prediction_id
        assert gw.metrics.feedback.labels("sent")._value.get() == 1
        assert refused.source == "fallback" and refused.reason == "rejected"
        metrics = sc.get("/metrics", headers=_auth()).text
        assert next(metric_values(metrics, "lengthwise_sidecar_feedback_total", {"source": "served"})) == 1
        assert next(metric_values(metrics, "lengthwise_sidecar_unauthorized_total", {"endpoint": "/v1/predict"})) == 2
    finally:
        log = sc.stop()
    assert TOKEN not in log
