"""The prediction sidecar as a real process over real HTTP, serving the real registered model: the contract,
micro-batching, bad input, hot reload, offline restart, CLI errors and a schema-driven fuzz run."""

from __future__ import annotations

import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from predictor.runtime import OnnxLengthPredictor
from predictor.tracking import ensure_experiment
from registry import store
from serving.launch.process import free_port
from tests.datafiles import need_data
from tests.sidecar_proc import SIDECAR, start_sidecar, wait_for

NAME = "length-predictor"
ALIAS = "sidecar-test"  # our own alias, so moving it never disturbs @champion for other tests


@pytest.fixture(scope="module")
def package(trained) -> Path:
    return Path(trained["work_dir"]) / "package"


@pytest.fixture(scope="module")
def sidecar(trained, tmp_path_factory):
    store.configure()
    store.set_alias(NAME, ALIAS, trained["registered_version"])
    sc = start_sidecar(tmp_path_factory.mktemp("sidecar"), "--model", f"models:/{NAME}@{ALIAS}", "--reload-interval", "0.5",
                       "--max-batch", "16", "--window-size", "1000")
    yield sc
    sc.stop()


def _predict(sc, body: dict) -> dict:
    r = sc.post("/v1/predict", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_predict_contract(sidecar, trained, package):
    edges = trained["buckets"]["edges"]
    prompts = ["Write a haiku about autumn.", "Explain, step by step and in detail, how TCP congestion control works."]
    out = _predict(sidecar, {"prompts": prompts})
    assert len(out["predictions"]) == 2 and out["model_version"] == trained["registered_version"]
    local = OnnxLengthPredictor(package).predict(prompts)
    for i, p in enumerate(out["predictions"]):
        assert isinstance(p["bucket"], int) and p["range"] == [edges[p["bucket"]],
                                                               (edges + [trained["buckets"]["max_tokens"]])[p["bucket"] + 1]]
        assert len(p["probs"]) == len(edges) and sum(p["probs"]) == pytest.approx(1.0, abs=1e-6)
        assert p["edges"] == edges[1:]  # the bucket tops but the last, as the gateway sends them on in pred_edges
        assert p["model_version"] == trained["registered_version"] and p["prediction_id"] and p["latency_ms"] > 0
        assert p["truncated"] is False and p["quantile"] == 0.9
        np.testing.assert_allclose(p["probs"], local.probs[i], atol=1e-5)  # same encoding and model as training's export
        assert p["expected_tokens"] == pytest.approx(local.expected[i], rel=1e-5)
        assert p["quantile_tokens"] == pytest.approx(local.quantile[i], rel=1e-5)
    one = _predict(sidecar, {"prompt": prompts[0], "quantile": 0.5, "request_id": "req-1"})["predictions"]
    assert len(one) == 1 and one[0]["prediction_id"] == "req-1" and \
        one[0]["probs"] == pytest.approx(out["predictions"][0]["probs"])
    assert one[0]["quantile_tokens"] <= out["predictions"][0]["quantile_tokens"]
    many = _predict(sidecar, {"prompts": prompts, "request_id": "req-2"})["predictions"]
    assert [p["prediction_id"] for p in many] == ["req-2/0", "req-2/1"]


def test_messages_and_truncation_match_training(sidecar, package):
    """A conversation is encoded exactly as in training (latest turn kept); an overlong prompt says truncated."""
    turns = [("user", "Tell me about Rome. " * 40), ("assistant", "Rome is old. " * 80),
             ("user", "Now list ten facts about Paris.")]
    msgs = [{"role": r, "content": t} for r, t in turns]
    msgs[-1] = {"role": "user", "content": [{"type": "text", "text": turns[-1][1]}]}  # content parts are accepted too
    p = _predict(sidecar, {"messages": msgs})["predictions"]
    local = OnnxLengthPredictor(package)
    ref = local.predict([turns])
    assert len(p) == 1 and p[0]["truncated"] is True and bool(ref.truncated[0])
    np.testing.assert_allclose(p[0]["probs"], ref.probs[0], atol=1e-5)
    assert p[0]["prompt_tokens"] == local.input_format.max_tokens
    long = _predict(sidecar, {"prompt": "word " * 5000})["predictions"][0]
    assert long["truncated"] is True and long["prompt_tokens"] == local.input_format.max_tokens


def test_health_ready_openapi_metrics(sidecar, trained):
    health = sidecar.get("/health").json()
    assert health["status"] == "ok" and health["model_version"] == trained["registered_version"]
    assert health["target"] and isinstance(health["drift"], dict)  # details: tests/test_sidecar_feedback.py
    ready = sidecar.get("/ready").json()
    assert ready["model_version"] == trained["registered_version"] and ready["from_cache_only"] is False
    doc = sidecar.get("/openapi.json").json()
    assert {"/v1/predict", "/v1/feedback", "/health", "/ready", "/metrics"} <= set(doc["paths"])
    _predict(sidecar, {"prompt": "hello"})
    assert sidecar.metric("lengthwise_sidecar_requests_total", endpoint="/v1/predict", status="200") >= 1
    assert sidecar.metric("lengthwise_sidecar_request_latency_seconds_count", endpoint="/v1/predict") >= 1
    assert sidecar.metric("lengthwise_sidecar_model_info", name=NAME, version=trained["registered_version"]) == 1
    assert sidecar.metric("lengthwise_sidecar_model_version") == float(trained["registered_version"])
    assert sidecar.metric("lengthwise_sidecar_batch_size_count") >= 1


def test_concurrent_requests_share_batches(sidecar, data):
    from training.data import load_examples

    prompts = [e.latest for e in load_examples(need_data("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"),
                                               "sharegpt", first_turn_only=True)[:96]]
    s0, n0 = sidecar.metric("lengthwise_sidecar_batch_size_sum"), sidecar.metric("lengthwise_sidecar_batch_size_count")
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: sidecar.post("/v1/predict", json={"prompt": p}), prompts))
    assert all(r.status_code == 200 for r in outs)
    s1, n1 = sidecar.metric("lengthwise_sidecar_batch_size_sum"), sidecar.metric("lengthwise_sidecar_batch_size_count")
    assert s1 - s0 == len(prompts)
    assert (s1 - s0) / (n1 - n0) > 1.5, "concurrent requests were not micro-batched"
    assert sidecar.metric("lengthwise_sidecar_batch_size_bucket", le="16.0") == n1  # never above --max-batch


def test_predictions_the_encoder_cannot_make_in_time_come_from_the_fast_tier(sidecar, data):
    """The gateway says how long it waits (x-lengthwise-timeout-ms). With 1 ms, less than the spill margin, no encoder
    answer can arrive in time, so every prompt goes straight to the package's fast tier (train-predictor ships one):
    200s marked overflow, answered by TF-IDF, counted; the encoder runs none of them. (Dropping them unrun, 504, is what
    a sidecar without a fast tier does: tests/test_slice_routing.py.)"""
    from collections import Counter

    from training.data import load_examples

    prompts = [e.latest for e in load_examples(need_data("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"),
                                               "sharegpt", first_turn_only=True)[:96]]
    s0 = sidecar.metric("lengthwise_sidecar_fast_tier_prompts_total") or 0.0
    p0 = sidecar.metric("lengthwise_sidecar_predictions_total")
    b0 = sidecar.metric("lengthwise_sidecar_batch_size_sum")
    with ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(lambda p: sidecar.post("/v1/predict", json={"prompt": p},
                                                    headers={"x-lengthwise-timeout-ms": "1"}), prompts))
    assert Counter(r.status_code for r in outs) == {200: 96}
    preds = [r.json()["predictions"][0] for r in outs]
    assert all(p["overflow"] and p["predictor"] == "tfidf-logreg" for p in preds)
    assert sidecar.metric("lengthwise_sidecar_fast_tier_prompts_total") - s0 == 96
    assert sidecar.metric("lengthwise_sidecar_predictions_total") - p0 == 96
    assert sidecar.metric("lengthwise_sidecar_batch_size_sum") == b0  # the encoder ran none of them
    plain = _predict(sidecar, {"prompt": prompts[0]})["predictions"][0]  # without the header: as ever
    assert not plain["overflow"]
    r = sidecar.post("/v1/predict", json={"prompt": "hi"}, headers={"x-lengthwise-timeout-ms": "0"})
    assert r.status_code == 422 and "x-lengthwise-timeout-ms" in r.json()["detail"], r.text


BAD = {
    "empty prompt": (b'{"prompt": ""}', 422, "prompt"),
    "blank prompt": (b'{"prompt": "   "}', 422, "prompt"),
    "wrong type": (b'{"prompt": 5}', 422, "prompt"),
    "empty list": (b'{"prompts": []}', 422, "prompts"),
    "empty item": (b'{"prompts": ["ok", ""]}', 422, "prompts.1"),
    "too many prompts": (('{"prompts": [' + ",".join(['"x"'] * 65) + "]}").encode(), 422, "at most 64"),
    "two inputs": (b'{"prompt": "a", "prompts": ["b"]}', 422, "exactly one"),
    "no input": (b'{"quantile": 0.5}', 422, "exactly one"),
    "bad quantile": (b'{"prompt": "a", "quantile": 1.5}', 422, "quantile"),
    "not an object": (b'["a"]', 422, "body"),
    "no text in messages": (b'{"messages": [{"role": "user", "content": ""}]}', 422, "no text"),
    "invalid JSON": (b'{"prompt": "a"', 400, "invalid JSON"),
    "not UTF-8": ('{"prompt": "caf\u00e9"}'.encode("latin-1"), 400, "UTF-8"),
    "oversized": (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, "exceeds"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_4xx_with_a_reason(sidecar, case):
    body, status, words = BAD[case]
    r = sidecar.post("/v1/predict", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert words in r.json()["detail"]


def test_lone_surrogate_is_rejected_not_crashed(sidecar):
    """A JSON escape of half a UTF-16 pair is valid JSON but no text: a 422 that says so, never a tokenizer crash."""
    r = sidecar.post("/v1/predict", content=b'{"prompt": "bad \\ud800 text"}', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "unicode" in r.json()["detail"]
    assert sidecar.post("/v1/predict", json={"prompt": "fine \u00e9 \U0001f600"}).status_code == 200


def test_feedback(sidecar, trained):
    p = _predict(sidecar, {"prompt": "Write a long essay about the history of Europe."})["predictions"][0]
    r = sidecar.post("/v1/feedback", json={"request_id": p["prediction_id"], "actual_tokens": 512})
    assert r.status_code == 200, r.text
    fb = r.json()
    assert fb["accepted"] and fb["source"] == "served" and fb["predicted_bucket"] == p["bucket"]
    assert fb["actual_bucket"] == int(np.searchsorted(trained["buckets"]["edges"], 512, side="right") - 1)
    assert fb["error_tokens"] == pytest.approx(p["expected_tokens"] - 512)
    assert sidecar.post("/v1/feedback", json={"request_id": p["prediction_id"], "actual_tokens": 512}).json()["accepted"] is False
    unknown = sidecar.post("/v1/feedback", json={"request_id": "never-served", "actual_tokens": 10})
    assert unknown.status_code == 404 and "never served" in unknown.json()["detail"]
    inline = sidecar.post("/v1/feedback", json={"request_id": "never-served", "actual_tokens": 10,
                                                "prediction": {"expected_tokens": 300.0}})
    assert inline.status_code == 404 and "token" in inline.json()["detail"]  # an open sidecar takes no prediction on trust
    assert sidecar.post("/v1/feedback", json={"request_id": "x", "actual_tokens": -1}).status_code == 422
    assert sidecar.metric("lengthwise_online_feedback_n", model_version=trained["registered_version"]) >= 1
    assert sidecar.metric("lengthwise_online_mae_tokens", model_version=trained["registered_version"]) is not None


def _register_copy(package: Path, trained, tmp: Path, break_it: bool = False) -> str:
    if break_it:
        broken = tmp / "broken"
        shutil.copytree(package, broken)
        (broken / "model.onnx").write_bytes(b"this is not an onnx graph")
        package = broken
    with mlflow.start_run(experiment_id=ensure_experiment("tests")):
        return store.register_package(package, NAME, trained["model"], trained["eval_split"], trained["buckets"]["edges"]).version


@pytest.mark.fault("a corrupt model artifact behind the alias at hot reload",
                   saw="predictions from the old version; /health degraded, naming the failed version; no error "
                       "during the later good swap",
                   lost="nothing")
def test_hot_reload(sidecar, trained, package, tmp_path):
    """Alias -> broken version: the load fails and the old model keeps serving. Alias -> good version: swapped in while
    requests keep flowing, none failing."""
    old = trained["registered_version"]
    broken = _register_copy(package, trained, tmp_path, break_it=True)
    store.set_alias(NAME, ALIAS, broken)
    wait_for(lambda: (sidecar.metric("lengthwise_sidecar_model_reloads_total", result="failed") or 0) >= 1,
             what="a failed reload")
    assert _predict(sidecar, {"prompt": "hi"})["model_version"] == old
    health = sidecar.get("/health").json()  # still serving, and says why it is not on the alias's version
    assert health["status"] == "degraded" and f"version {broken} failed" in health["reasons"][0], health

    new = _register_copy(package, trained, tmp_path)
    seen, errors, stop = [], [], threading.Event()

    def load():
        while not stop.is_set():
            r = sidecar.post("/v1/predict", json={"prompts": ["a question", "another question"]})
            if r.status_code != 200:
                errors.append(r.text)
            else:
                seen.append(r.json()["model_version"])

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        store.set_alias(NAME, ALIAS, new)
        wait_for(lambda: _predict(sidecar, {"prompt": "hi"})["model_version"] == new, what=f"version {new} to be served")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and set(seen) <= {old, new}
    assert sidecar.get("/ready").json()["model_version"] == new
    assert sidecar.get("/health").json()["status"] == "ok"  # a good reload clears the failed one's reason
    assert sidecar.metric("lengthwise_sidecar_model_info", name=NAME, version=new) == 1
    assert sidecar.metric("lengthwise_sidecar_model_info", name=NAME, version=old) is None
    from predictor.sidecar.cache import cache_root

    assert (cache_root() / NAME / new / "model.onnx").is_file()
    store.set_alias(NAME, ALIAS, old)
    wait_for(lambda: _predict(sidecar, {"prompt": "hi"})["model_version"] == old, what="the swap back")


@pytest.mark.fault("the alias moved to a version that is then deleted", saw="predictions from the loaded version; "
                    "/health degraded, saying the alias cannot be resolved", lost="nothing")
def test_an_alias_whose_version_is_deleted_keeps_the_loaded_version_serving(sidecar, trained, package, tmp_path):
    old = trained["registered_version"]
    doomed = _register_copy(package, trained, tmp_path)
    store.set_alias(NAME, ALIAS, doomed)
    wait_for(lambda: _predict(sidecar, {"prompt": "hi"})["model_version"] == doomed, what=f"version {doomed} to be served")
    mlflow.MlflowClient().delete_model_version(NAME, doomed)
    wait_for(lambda: sidecar.get("/health").json()["status"] == "degraded", what="/health to say the alias is gone")
    assert "cannot resolve" in sidecar.get("/health").json()["reasons"][0]
    assert _predict(sidecar, {"prompt": "still predicting?"})["model_version"] == doomed
    store.set_alias(NAME, ALIAS, old)
    wait_for(lambda: _predict(sidecar, {"prompt": "hi"})["model_version"] == old, what="the alias's new version")
    assert sidecar.get("/health").json()["status"] == "ok"


@pytest.mark.fault("MLflow down at sidecar start (the alias resolved before) and while serving",
                   saw="predictions from the cached version; feedback accepted",
                   lost="nothing: the closed window waits in a bounded buffer")
def test_offline_restart_serves_the_cached_model(sidecar, trained, tmp_path):
    """Registry down (MLFLOW_TRACKING_URI at a closed port) but the alias was resolved before: start from the cache."""
    assert sidecar.get("/ready").status_code == 200  # the module's sidecar has cached the package and the alias
    dead = f"http://127.0.0.1:{free_port()}"
    sc = start_sidecar(tmp_path, "--model", f"models:/{NAME}@{ALIAS}", "--reload-interval", "0.5", "--window-size", "1",
                       env={"MLFLOW_TRACKING_URI": dead})
    try:
        ready = sc.get("/ready").json()
        assert ready["from_cache_only"] is True and ready["model_version"] == trained["registered_version"]
        out = _predict(sc, {"prompt": "Offline and still predicting?"})
        assert out["model_version"] == trained["registered_version"]
        # feedback while MLflow is down: the closed window waits in the buffer, serving goes on
        fb = sc.post("/v1/feedback", json={"request_id": out["predictions"][0]["prediction_id"], "actual_tokens": 100})
        assert fb.status_code == 200 and fb.json()["accepted"]
        wait_for(lambda: sc.metric("lengthwise_online_windows_buffered") == 1, what="a buffered window")
        assert _predict(sc, {"prompt": "Still serving?"})["model_version"] == trained["registered_version"]
        assert sc.get("/health").status_code == 200
    finally:
        log = sc.stop()
    assert "unreachable" in log


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([SIDECAR, *args], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})},
                          check=False)


@pytest.mark.parametrize("case", ["unknown model", "not a uri", "bad port", "negative batch", "registry down, nothing cached"])
def test_cli_bad_args_exit_2_with_one_line(trained, case):
    args, env = {
        "unknown model": (["--model", "models:/no-such-model@champion", "--port", str(free_port())], None),
        "not a uri": (["--model", "/no/such/dir", "--port", str(free_port())], None),
        "bad port": (["--port", "70000"], None),
        "negative batch": (["--max-batch", "0"], None),
        "registry down, nothing cached": (["--model", "models:/never-cached@champion", "--port", str(free_port())],
                                          {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}"}),
    }[case]
    r = _cli(*args, env=env)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("predictor-sidecar: error:"), r.stderr
    assert "Traceback" not in r.stderr


def test_port_in_use_exits_2(sidecar):
    port = sidecar.url.rsplit(":", 1)[1]
    r = _cli("--port", port)
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr


def test_help_teaches():
    r = _cli("--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "--reload-interval" in r.stdout


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_fuzz_openapi(sidecar, mode):
    """Schema-driven fuzzing of every operation from /openapi.json (valid and invalid inputs): no 5xx, and every
    response matches its documented status code, content type and schema."""
    # 413 (body over the size limit) is a rejection too
    config = schemathesis.Config.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": [400, 404, 413, 422]}}})
    schema = schemathesis.openapi.from_url(f"{sidecar.url}/openapi.json", config=config)

    from schemathesis.specs.openapi.checks import positive_data_acceptance

    @given(case=schema.as_strategy(schemathesis.GenerationMode(mode)))
    @settings(max_examples=40, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        # all checks but one: a schema-valid conversation whose messages hold no text is refused (422, with the
        # reason) on purpose; "at least one message has text" is not expressible in the schema
        case.call_and_validate(excluded_checks=[positive_data_acceptance])

    fuzz()


def test_bench_sidecar_json_contract(trained, tmp_path):
    """A short real run (separate sidecar and client processes): the JSON has p50/p99/throughput per level."""
    import json
    import sys

    out = tmp_path / "bench.json"
    r = subprocess.run([str(Path(sys.executable).parent / "lengthwise"), "bench", "sidecar", "--model",
                        f"models:/{NAME}/{trained['registered_version']}", "--levels", "1,8", "--duration", "1.5",
                        "--warmup", "0.3", "--prompts", "200", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["levels"]) == {"1", "8"} and report["model_version"] == trained["registered_version"]
    for level in report["levels"].values():
        assert level["requests"] > 0 and level["errors"] == 0
        assert 0 < level["p50_ms"] <= level["p99_ms"] and level["throughput_rps"] > 0
        assert level["cpu_s_per_prediction"] > 0
    assert out.with_suffix(".png").stat().st_size > 0 and "p99 ms" in r.stdout
    bad = subprocess.run([str(Path(sys.executable).parent / "lengthwise"), "bench", "sidecar", "--levels", "1,x"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("lengthwise bench sidecar: error:")


def test_cache_follows_the_registry_it_was_resolved_from(trained, package, shared_mlflow_server, monkeypatch):
    """Version N of a name on a real MLflow server is another model than version N in the embedded store: the
    cache notices (by run id) and downloads the server's copy instead of serving the stale one."""
    import json

    from predictor.sidecar.cache import REGISTRY_FILE, resolve

    local = resolve(f"models:/{NAME}/1")  # the embedded store's version 1
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_mlflow_server)
    store.configure()
    with mlflow.start_run(experiment_id=ensure_experiment("server-cache")):
        reg = store.register_package(package, NAME, trained["model"], trained["eval_split"], trained["buckets"]["edges"])
    assert reg.version == "1"
    remote = resolve(f"models:/{NAME}/1")
    assert remote.path == local.path and not remote.from_cache_only
    assert json.loads((remote.path / REGISTRY_FILE).read_text())["run_id"] == \
        mlflow.MlflowClient().get_model_version(NAME, "1").run_id
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    store.configure()


def test_an_answer_so_far_is_refused_by_a_prompt_only_version_and_read_by_a_remaining_length_one(sidecar, package,
                                                                                               tmp_path):
    """``answer_so_far``: a version trained on prompts alone says so (422, nothing predicted); one trained on answers so
    far (meta.json's remaining_length) reads the prompt and the answer as training built them (predictor.partial) and
    says after how many tokens its distribution starts."""
    import json

    from predictor.partial import with_answer

    body = {"prompt": "List ten facts about Paris.", "answer_so_far": {"text": "1. Paris is the capital of France.",
                                                                       "tokens": 12}}
    r = sidecar.post("/v1/predict", json=body)
    assert r.status_code == 422 and "predicts from the prompt alone" in r.json()["detail"]
    r = sidecar.post("/v1/predict", json={"prompts": ["a", "b"], "answer_so_far": body["answer_so_far"]})
    assert r.status_code == 422 and "answer_so_far belongs to one request" in r.text
    marked = tmp_path / "remaining"
    shutil.copytree(package, marked)
    meta = json.loads((marked / "meta.json").read_text())
    (marked / "meta.json").write_text(json.dumps({**meta, "remaining_length": True}))
    sc = start_sidecar(tmp_path, "--model", str(marked), "--reload-interval", "0")
    try:
        p = _predict(sc, body)["predictions"][0]
        local = OnnxLengthPredictor(marked).predict([with_answer([("user", body["prompt"])],
                                                                 body["answer_so_far"]["text"], 12)])
        assert p["generated_tokens"] == 12 and p["probs"] == pytest.approx(list(local.probs[0]), abs=1e-5)
        plain = _predict(sc, {"prompt": body["prompt"]})["predictions"][0]
        assert plain.get("generated_tokens") is None and plain["probs"] != pytest.approx(p["probs"], abs=1e-5)
        # several answers in one call: each as its own call would answer it, in order
        other = {"messages": [{"role": "user", "content": "Say yes."}], "answer_so_far": {"text": "Yes", "tokens": 1}}
        many = sc.post("/v1/predict/remaining", json={"items": [body, other]})
        assert many.status_code == 200, many.text
        first, second = many.json()["results"]
        assert first["probs"] == pytest.approx(p["probs"], abs=1e-5) and first["generated_tokens"] == 12
        assert second["probs"] == pytest.approx(_predict(sc, other)["predictions"][0]["probs"], abs=1e-5)
        bad = sc.post("/v1/predict/remaining", json={"items": [{"prompt": "no answer"}]})
        assert bad.status_code == 422 and "answer_so_far" in bad.text
    finally:
        sc.stop()
