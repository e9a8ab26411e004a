"""One predictor for several served models (predictor/conditioning.py): the sidecar answers for the model a request
names by reading its name before the request, refuses a request without one or for a model it never learned (422,
naming the models it knows), and a predictor for one model ignores the name; the gateway sends each request's model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from predictor.conditioning import META_KEY, condition_turns, conditioned_text
from predictor.runtime import OnnxLengthPredictor
from predictor.sidecar.app import create_app
from predictor.sidecar.cache import ResolvedModel, parse_uri
from predictor.sidecar.settings import SidecarSettings
from tests.datafiles import need_data
from tests.sidecar_proc import wait_for
from tests.tiny_package import tiny_packages

MODELS = ["smol", "smol-terse"]


@pytest.fixture(scope="module")
def packages(data, tmp_path_factory) -> dict[str, Path]:
    """A tiny package, and the same one conditioned on two models (its meta.json lists them)."""
    work = tmp_path_factory.mktemp("tiny-models")
    plain = tiny_packages(work, need_data("tokenizers/gpt2/tokenizer.json"), {"plain": None})["plain"]
    cond = work / "conditioned"
    shutil.copytree(plain, cond)
    meta = json.loads((cond / "meta.json").read_text())
    (cond / "meta.json").write_text(json.dumps({**meta, META_KEY: MODELS}))
    return {"plain": plain, "conditioned": cond}


def _client(package: Path, tmp: Path) -> TestClient:
    s = SidecarSettings(model=str(package), feedback_db=str(tmp / "fb.db"), reload_interval=0)
    client = TestClient(create_app(s, parse_uri(str(package)), ResolvedModel(package, "lp-models", "1", str(package))))
    client.__enter__()
    wait_for(lambda: client.get("/ready").status_code == 200, timeout=120, what="the model to load")
    return client


@pytest.mark.unit
def test_the_model_goes_before_the_request_it_is_for():
    assert conditioned_text("smol", "Hi") == "[smol] Hi"
    turns = [("user", "Hi"), ("assistant", "Hello!"), ("user", "Tell me more")]
    assert condition_turns(turns, "smol") == [("user", "Hi"), ("assistant", "Hello!"), ("user", "[smol] Tell me more")]


def test_a_conditioned_predictor_answers_for_the_model_named_and_refuses_others(packages, tmp_path):
    assert OnnxLengthPredictor(packages["conditioned"]).conditioned_models == MODELS
    assert OnnxLengthPredictor(packages["plain"]).conditioned_models is None
    reference = OnnxLengthPredictor(packages["conditioned"])
    client = _client(packages["conditioned"], tmp_path)
    try:
        prompt = "Write a limerick about a cat who learns to code."
        got = {}
        for model in MODELS:
            r = client.post("/v1/predict", json={"prompt": prompt, "model": model})
            assert r.status_code == 200, r.text
            got[model] = r.json()["predictions"][0]["probs"]
            want = reference.predict([[("user", conditioned_text(model, prompt))]])
            assert got[model] == pytest.approx(list(want.probs[0]), abs=1e-5)
        assert got["smol"] != pytest.approx(got["smol-terse"], abs=1e-6)  # the name is read: two models, two answers
        for body, said in [({"prompt": prompt}, "send the request's 'model' (one of smol, smol-terse)"),
                           ({"prompt": prompt, "model": "gpt-9"}, "not trained on 'gpt-9'")]:
            r = client.post("/v1/predict", json=body)
            assert r.status_code == 422 and said in r.json()["detail"], r.text
    finally:
        client.__exit__(None, None, None)


def test_a_predictor_for_one_model_ignores_the_name(packages, tmp_path):
    client = _client(packages["plain"], tmp_path)
    try:
        a = client.post("/v1/predict", json={"prompt": "Hello there", "model": "anything"})
        b = client.post("/v1/predict", json={"prompt": "Hello there"})
        assert a.status_code == b.status_code == 200
        assert a.json()["predictions"][0]["probs"] == b.json()["predictions"][0]["probs"]
    finally:
        client.__exit__(None, None, None)


def test_the_gateway_sends_each_requests_model_to_the_sidecar():
    import asyncio

    from serving.gateway.metrics import GatewayMetrics
    from serving.gateway.prediction import Predictor
    from serving.gateway.requests import validate
    from tests.recording_sidecar import RecordingSidecar

    sidecar = RecordingSidecar()

    async def go() -> None:
        p = Predictor(sidecar.url, 2000, 100, GatewayMetrics())
        for model in ("smol", "smol-terse"):
            req = validate("chat", {"model": model, "messages": [{"role": "user", "content": "Hi"}]}, set(MODELS))
            assert (await p.predict(req, f"rid-{model}")).source == "sidecar"
        await p.aclose()

    try:
        asyncio.run(go())
    finally:
        sidecar.stop()
    bodies = [body for _, _, body in sidecar.paths("/v1/predict")]
    assert [(b["model"], b["request_id"]) for b in bodies] == [("smol", "rid-smol"), ("smol-terse", "rid-smol-terse")]


@pytest.mark.unit
def test_the_model_cache_keeps_the_newest_versions_and_what_aliases_point_at(tmp_path, monkeypatch):
    """Each promoted version is a whole package in the sidecar's cache; older ones go, but never one an alias last
    pointed at (the registry-down fallback) nor the one being served."""
    from predictor.sidecar.cache import cache_root, prune, remember_alias

    monkeypatch.setenv("LENGTHWISE_HOME", str(tmp_path))
    for v in ("1", "2", "3", "9", "10", "11"):
        d = cache_root() / "lp" / v
        d.mkdir(parents=True)
        for f in ("model.onnx", "tokenizer.json", "meta.json"):
            (d / f).write_text("x")
    (cache_root() / "lp" / ".download-tmp").mkdir()  # another process's download in flight: not a version
    remember_alias("lp", "champion", "2")
    assert prune("lp", keep=2, protect=("3",)) == ["9", "1"]  # numbers, not strings: 11 and 10 are the newest
    assert sorted(p.name for p in (cache_root() / "lp").iterdir()) == [".download-tmp", "10", "11", "2", "3",
                                                                         "aliases.json"]
    assert prune("lp", keep=2) == ["3"] and prune("nothing-cached", keep=1) == []


def test_each_catalogue_name_is_checked_against_what_its_sidecar_serves(packages, home, tmp_path):
    """A real sidecar serving the conditioned predictor, three catalogue names: one it learnt, one it did not (it would
    refuse its every request) and one pinned to a registry URI it does not serve. ``serve --models`` refuses at start
    in one line naming the entry; a gateway given the verdicts asks the sidecar only for the name it answers."""
    import asyncio

    import httpx

    from serving.cli import main
    from serving.gateway.gateway import Call, Gateway
    from serving.gateway.model_predictors import check_entries, identities
    from serving.gateway.settings import GatewaySettings
    from serving.launch.process import free_port
    from tests.cli_inproc import run_main
    from tests.sidecar_proc import start_sidecar

    urls = [f"http://127.0.0.1:{free_port()}" for _ in range(3)]
    sc = start_sidecar(tmp_path, "--model", str(packages["conditioned"]), "--reload-interval", "0")
    try:
        assert sc.get("/ready").json()["conditioned_on_models"] == MODELS
        f = tmp_path / "m.yaml"
        f.write_text(f'- {{name: smol, engine_urls: ["{urls[0]}"]}}\n- {{name: gpt-9, engine_urls: ["{urls[1]}"]}}\n'
                     f'- {{name: pinned, engine_urls: ["{urls[2]}"], predictor: "models:/lp@champion"}}\n')
        settings = GatewaySettings(models_file=f, predictor_url=sc.url)
        cat = settings.catalogue

        async def verdicts() -> dict:
            async with httpx.AsyncClient(timeout=10) as client:
                return await check_entries(cat, settings, identities(cat, settings), client)

        found = asyncio.run(verdicts())
        assert {n: v.state for n, v in found.items()} == {"smol": "match", "gpt-9": "mismatch", "pinned": "mismatch"}
        assert "does not include 'gpt-9'" in found["gpt-9"].detail
        assert found["pinned"].detail == (f"the sidecar serves {packages['conditioned']}, not the models:/lp@champion the "
                                          "catalogue names for 'pinned'")

        r = run_main(main, ["serve", "--models", str(f), "--predictor-url", sc.url])
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith("lengthwise serve: error: catalogue entry 'gpt-9': the predictor at " + sc.url)

        async def predictions() -> dict:
            gw = Gateway(settings, engine_urls=urls, model_targets=found)
            out = {}
            for name in ("smol", "gpt-9", "pinned"):
                req = gw.validate("chat", json.dumps({"model": name, "messages": [{"role": "user", "content": "Hi"}]})
                                  .encode())
                out[name] = (await gw.predict(Call("chat"), req, {})).label
            body = gw.health()
            await gw.aclose()
            return out, body

        got, body = asyncio.run(predictions())
        assert got == {"smol": "sidecar", "gpt-9": "fallback:other_model", "pinned": "fallback:other_model"}
        assert body["models"]["gpt-9"]["predictor"]["target"]["state"] == "mismatch"
        assert any("gpt-9, pinned" in reason for reason in body["reasons"]), body["reasons"]
    finally:
        sc.stop()
