"""The sidecar's feedback as training data and as a drift alarm, in-process (FastAPI TestClient over the real app and
the real trained package): feedback rows in a real SQLite store (prompt turns, or only their hash with
--no-store-prompts), a finish reason that makes a label censored, a locked store that costs the client nothing, the
target model in every answer, and the drift alarm in /health and Prometheus."""

from __future__ import annotations

import errno
import hashlib
import json
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from monitoring.feedback_store import FeedbackStore
from predictor.sidecar.app import create_app
from predictor.sidecar.cache import ResolvedModel, parse_uri
from predictor.sidecar.loading import NO_TARGET
from predictor.sidecar.settings import SidecarSettings
from tests.conftest import metric_values
from tests.sidecar_proc import wait_for

NAME = "lp-feedback-test"
TOKEN = "feedback-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def package(trained) -> Path:
    return Path(trained["work_dir"]) / "package"


def open_client(package: Path, db: Path, version: str = "1", offline_accuracy: float = 0.5, **settings) -> TestClient:
    """A started app (lifespan running) whose model is loaded; the caller closes it."""
    resolved = ResolvedModel(package, NAME, version, str(package), tags={"accuracy": str(offline_accuracy)})
    s = SidecarSettings(model=str(package), feedback_db=str(db), reload_interval=0, window_seconds=3600, **settings)
    client = TestClient(create_app(s, parse_uri(str(package)), resolved))
    client.__enter__()
    wait_for(lambda: client.get("/ready").status_code == 200, timeout=120, what="the model to load")  # /ready is open
    return client


def state_of(client: TestClient):
    """The app's SidecarState, under however many middlewares (the token's, the body limit's)."""
    app = client.app
    while not hasattr(app, "state"):
        app = app.app
    return app.state.sidecar


def metric(client: TestClient, name: str, **labels: str) -> float | None:
    return next(metric_values(client.get("/metrics").text, name, labels), None)


@pytest.fixture(scope="module")
def sidecar(package, tmp_path_factory):
    db = tmp_path_factory.mktemp("fb") / "feedback.db"
    client = open_client(package, db)
    yield client, FeedbackStore(db)
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def guarded(package, tmp_path_factory):
    """A sidecar with a token (its callers are trusted, so it counts predictions sent inline) and a low
    --max-actual-tokens."""
    db = tmp_path_factory.mktemp("fb-guarded") / "feedback.db"
    client = open_client(package, db, token=TOKEN, max_actual_tokens=4096)
    client.headers.update(AUTH)
    yield client, FeedbackStore(db)
    client.__exit__(None, None, None)


def predict(client: TestClient, body: dict) -> list[dict]:
    r = client.post("/v1/predict", json=body)
    assert r.status_code == 200, r.text
    return r.json()["predictions"]


def test_target_in_health_ready_and_every_prediction(sidecar):
    client, _ = sidecar
    app_state = client.app.app.state.sidecar
    expected = app_state.model.target
    if getattr(app_state.model.predictor, "target", None):
        assert isinstance(expected, dict)
    else:
        assert expected == NO_TARGET
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["target"] == expected and health["model_version"] == "1"
    assert client.get("/ready").json()["target"] == expected
    assert all(p["target"] == expected for p in predict(client, {"prompts": ["a", "b"]}))


def test_served_feedback_becomes_a_row_with_prompt_distribution_and_finish_reason(sidecar):
    client, store = sidecar
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers in Europe."}]
    (p,) = predict(client, {"messages": messages, "request_id": "req-rivers"})
    t0 = time.time()
    r = client.post("/v1/feedback", json={"request_id": "req-rivers", "actual_tokens": 37, "finish_reason": "stop"})
    assert r.status_code == 200 and r.json()["stored"] is True and r.json()["censored"] is False
    wait_for(lambda: store.read(model_name=NAME, since=t0 - 1), what="the row")
    (row,) = [x for x in store.read(model_name=NAME) if x.prediction_id == "req-rivers"]
    turns = [("system", "Be brief."), ("user", "Name three rivers in Europe.")]
    assert row.turns == turns and row.prompt_sha256 == hashlib.sha256(
        json.dumps([list(t) for t in turns], ensure_ascii=False, separators=(",", ":")).encode()).hexdigest()
    assert row.probs == pytest.approx(p["probs"]) and row.edges == p["edges"] and row.bucket == p["bucket"]
    assert row.expected_tokens == pytest.approx(p["expected_tokens"])
    assert row.quantile_tokens == pytest.approx(p["quantile_tokens"])
    assert (row.actual_tokens, row.finish_reason, row.censored) == (37, "stop", False)
    assert (row.model_name, row.model_version) == (NAME, "1") and row.predicted_at <= row.time
    assert row.target == (p["target"] if isinstance(p["target"], dict) else None)
    assert metric(client, "lengthwise_sidecar_feedback_store_rows_total", outcome="written") >= 1


def test_a_capped_answer_is_a_censored_label(sidecar):
    client, store = sidecar
    c0 = metric(client, "lengthwise_online_feedback_censored", model_version="1") or 0.0
    predict(client, {"prompt": "Write a long story about a lighthouse keeper.", "request_id": "req-capped"})
    r = client.post("/v1/feedback", json={"request_id": "req-capped", "actual_tokens": 16, "finish_reason": "length"})
    assert r.status_code == 200 and r.json()["censored"] is True
    assert metric(client, "lengthwise_online_feedback_censored", model_version="1") == c0 + 1
    wait_for(lambda: any(x.prediction_id == "req-capped" for x in store.read(model_name=NAME)), what="the row")
    (row,) = [x for x in store.read(model_name=NAME) if x.prediction_id == "req-capped"]
    assert row.censored and row.finish_reason == "length" and store.count(model_name=NAME)["censored"] >= 1


def test_an_unknown_finish_reason_is_a_422_naming_the_accepted_ones(sidecar):
    client, _ = sidecar
    predict(client, {"prompt": "hi", "request_id": "req-odd"})
    r = client.post("/v1/feedback", json={"request_id": "req-odd", "actual_tokens": 3, "finish_reason": "tired"})
    assert r.status_code == 422
    assert "finish_reason" in r.json()["detail"] and "'length'" in r.json()["detail"]


def test_inline_feedback_is_scored_but_not_stored(guarded):
    """With a token, a prediction sent inline (another replica's, or one from before a restart) counts."""
    client, store = guarded
    skipped = metric(client, "lengthwise_sidecar_feedback_store_rows_total", outcome="skipped") or 0.0
    r = client.post("/v1/feedback", json={"request_id": "elsewhere", "actual_tokens": 10, "finish_reason": "stop",
                                          "prediction": {"expected_tokens": 40.0}}, headers=AUTH)
    assert r.status_code == 200 and r.json()["accepted"] and r.json()["source"] == "inline" and r.json()["stored"] is False
    assert metric(client, "lengthwise_sidecar_feedback_store_rows_total", outcome="skipped") == skipped + 1
    assert not any(x.prediction_id == "elsewhere" for x in store.read())


def _stored(client: TestClient, store: FeedbackStore, prompt: str, rid: str, tokens: int, what: str) -> None:
    """A prediction for ``prompt`` as ``rid``, its feedback accepted, and then its row in the store."""
    predict(client, {"prompt": prompt, "request_id": rid})
    assert client.post("/v1/feedback", json={"request_id": rid, "actual_tokens": tokens}).status_code == 200
    wait_for(lambda: any(x.prediction_id == rid for x in store.read()), what=what)


@pytest.mark.fault("the feedback store locked by another process",
                   saw="feedback accepted (200) at once; /health 200",
                   lost="the rows written while locked, counted by reason; writing resumes")
def test_a_locked_store_is_counted_never_the_clients_error(sidecar):
    client, store = sidecar
    # the store is made at its first write: one row first, so the test stands alone (make faults runs it first)
    _stored(client, store, "Explain gravity.", "req-before-lock", 60, what="the store's first row")
    failed0 = metric(client, "lengthwise_sidecar_feedback_store_errors_total", reason="locked") or 0.0
    holder = sqlite3.connect(store.path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        predict(client, {"prompt": "Explain photosynthesis.", "request_id": "req-locked"})
        t0 = time.perf_counter()
        r = client.post("/v1/feedback", json={"request_id": "req-locked", "actual_tokens": 120, "finish_reason": "stop"})
        assert r.status_code == 200 and r.json()["accepted"] and time.perf_counter() - t0 < 0.9  # the lock waits 1 s
        wait_for(lambda: (metric(client, "lengthwise_sidecar_feedback_store_errors_total", reason="locked") or 0) > failed0,
                 timeout=30, what="the locked write to be counted")
        assert client.get("/health").status_code == 200
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    _stored(client, store, "Explain osmosis.", "req-after", 80, what="writing to resume")
    assert not any(x.prediction_id == "req-locked" for x in store.read())  # dropped, and counted as failed


def test_no_store_prompts_keeps_only_the_hash(package, tmp_path):
    client = open_client(package, tmp_path / "fb.db", store_prompts=False)
    try:
        predict(client, {"prompt": "A private question about my bank account.", "request_id": "secret"})
        assert client.post("/v1/feedback", json={"request_id": "secret", "actual_tokens": 50}).json()["stored"]
        store = FeedbackStore(tmp_path / "fb.db")
        wait_for(lambda: store.read(), what="the row")
        (row,) = store.read()
        assert row.turns is None and row.prompt_sha256 == hashlib.sha256(
            json.dumps([["user", "A private question about my bank account."]], separators=(",", ":")).encode()).hexdigest()
        assert not store.stores_prompts()
        assert b"bank account" not in (tmp_path / "fb.db").read_bytes() + (tmp_path / "fb.db-wal").read_bytes()
    finally:
        client.__exit__(None, None, None)


def test_drift_alarm_in_health_and_prometheus(package, tmp_path):
    """Offline accuracy 0.99 and answers far from every prediction: the first closed window raises the alarm."""
    client = open_client(package, tmp_path / "fb.db", version="drift-1", offline_accuracy=0.99, window_size=20,
                         alarm_margin=0.1, token=TOKEN)  # called by the gateway: the model it names counts apart
    client.headers.update(AUTH)
    try:
        assert client.get("/health").json()["drift"] == {}
        # the requests name the served model they are for (a gateway serving a catalogue says so): its part of the window
        preds = predict(client, {"prompts": [f"Say hello number {i}." for i in range(20)], "model": "smol-terse"})
        for p in preds:
            far = 0 if p["bucket"] > 0 else 30_000  # a bucket the prediction did not name (under --max-actual-tokens)
            assert client.post("/v1/feedback", json={"request_id": p["prediction_id"], "actual_tokens": far}).status_code == 200
        drift = client.get("/health").json()["drift"]["drift-1"]
        assert drift["alarm"] is True and drift["window_accuracy"] == 0.0 and drift["offline_accuracy"] == 0.99
        assert drift["margin"] == 0.1 and drift["since"] is not None and drift["window_n"] == 20
        assert drift["models"] == {"smol-terse": {"alarm": True, "window_accuracy": 0.0, "window_n": 20}}
        assert metric(client, "lengthwise_predictor_drift_alarm", model=NAME, version="drift-1") == 1.0
        terse = {"model_version": "drift-1", "served_model": "smol-terse"}
        assert metric(client, "lengthwise_online_model_accuracy_alarm", **terse) == 1.0
        assert metric(client, "lengthwise_online_model_accuracy", **terse) == 0.0
        for p in predict(client, {"prompts": [f"Say hello number {i}." for i in range(20)], "model": "smol"}):
            body = {"request_id": p["prediction_id"], "actual_tokens": p["range"][0]}  # now answered as predicted
            assert client.post("/v1/feedback", json=body).status_code == 200
        drift = client.get("/health").json()["drift"]["drift-1"]
        assert drift["alarm"] is False and drift["window_accuracy"] == 1.0 and drift["since"] is None
        assert drift["models"] == {"smol": {"alarm": False, "window_accuracy": 1.0, "window_n": 20}}
        assert metric(client, "lengthwise_predictor_drift_alarm", model=NAME, version="drift-1") == 0.0
        assert metric(client, "lengthwise_online_model_feedback_n", model_version="drift-1", served_model="smol") == 20
        assert metric(client, "lengthwise_online_model_feedback_n", **terse) == 20
    finally:
        client.__exit__(None, None, None)


def test_a_served_model_counts_apart_only_when_it_is_known_good():
    """A request's ``model`` gets its own part of the online windows (and Prometheus series) only from a caller the
    sidecar trusts (its token: the gateway names a model of its catalogue) or when a conditioned predictor accepted it;
    an anonymous caller's names count in the total only."""
    from types import SimpleNamespace

    from predictor.sidecar.app import _served_model

    one = SimpleNamespace(predictor=SimpleNamespace(conditioned_models=[]))
    conditioned = SimpleNamespace(predictor=SimpleNamespace(conditioned_models=["smol", "smol-terse"]))
    anonymous, gateway = SimpleNamespace(trusted=False), SimpleNamespace(trusted=True)
    assert _served_model(anonymous, one, "any-name") is None
    assert _served_model(gateway, one, "smol-terse") == "smol-terse"
    assert _served_model(anonymous, conditioned, "smol") == "smol"
    assert _served_model(gateway, one, None) is None


# --- forged, repeated and impossible feedback changes nothing, and is counted ---------------------------------------
def online_n(client: TestClient, version: str = "1") -> float:
    return metric(client, "lengthwise_online_feedback_n", model_version=version) or 0.0


def rejected(client: TestClient, reason: str) -> float:
    return metric(client, "lengthwise_sidecar_feedback_rejected_total", reason=reason) or 0.0


def test_feedback_on_an_id_never_served_is_refused(sidecar):
    """Without a token anyone can post: twenty made-up ids with made-up predictions attached move no online metric."""
    client, store = sidecar
    predict(client, {"prompt": "Say hi.", "request_id": "real-one"})
    assert client.post("/v1/feedback", json={"request_id": "real-one", "actual_tokens": 5}).status_code == 200
    n0, acc0, unknown0 = online_n(client), metric(client, "lengthwise_online_accuracy", model_version="1"), \
        rejected(client, "unknown_id")
    for i in range(20):
        r = client.post("/v1/feedback", json={"request_id": f"forged-{i}", "actual_tokens": 30_000,
                                              "prediction": {"expected_tokens": 1.0, "model_version": "1"}})
        assert r.status_code == 404 and "never served" in r.json()["detail"] and set(r.json()) == {"detail"}
    assert online_n(client) == n0 and metric(client, "lengthwise_online_accuracy", model_version="1") == acc0
    assert rejected(client, "unknown_id") == unknown0 + 20
    assert not any(x.prediction_id.startswith("forged-") for x in store.read())


def test_made_up_model_versions_make_no_label_series(guarded):
    """Even from a trusted caller, an inline prediction must name a version this sidecar has served: 200 made-up
    versions make no Prometheus series and no online window (so no MLflow monitoring run)."""
    client, _ = guarded
    before = rejected(client, "unknown_version")
    for i in range(200):
        r = client.post("/v1/feedback", json={"request_id": f"fake-{i}", "actual_tokens": 10,
                                              "prediction": {"expected_tokens": 40.0, "model_version": f"fake-{i}"}})
        assert r.status_code == 422 and f"'fake-{i}'" in r.json()["detail"] and "serves" in r.json()["detail"]
    r = client.post("/v1/feedback", json={"request_id": "fake-name", "actual_tokens": 10,
                                          "prediction": {"expected_tokens": 40.0, "model_name": "someone-else"}})
    assert r.status_code == 422
    assert rejected(client, "unknown_version") == before + 201
    text = client.get("/metrics").text
    assert "fake-" not in text and "someone-else" not in text
    state = state_of(client)
    state.publish(state.aggregator.flush_due(force=True))
    assert {v for _, v in state.aggregator.totals} <= {"1"} and "someone-else" not in {n for n, _ in state.aggregator.totals}


def test_the_same_feedback_twice_counts_once(sidecar, guarded):
    client, store = sidecar
    predict(client, {"prompt": "Name a colour.", "request_id": "twice"})
    n0, dup0 = online_n(client), rejected(client, "duplicate")
    first = client.post("/v1/feedback", json={"request_id": "twice", "actual_tokens": 4})
    again = client.post("/v1/feedback", json={"request_id": "twice", "actual_tokens": 4000})
    assert first.status_code == 200 and first.json()["accepted"] and not first.json()["duplicate"]
    assert again.status_code == 200 and again.json()["accepted"] is False and again.json()["duplicate"] is True
    assert again.json()["stored"] is False
    assert online_n(client) == n0 + 1 and rejected(client, "duplicate") == dup0 + 1
    wait_for(lambda: any(x.prediction_id == "twice" for x in store.read()), what="the row")
    assert [x.actual_tokens for x in store.read() if x.prediction_id == "twice"] == [4]
    # inline (a trusted caller's) feedback is remembered too: a retry of it is not counted twice
    gclient, _ = guarded
    n0, dup0 = online_n(gclient), rejected(gclient, "duplicate")
    body = {"request_id": "inline-twice", "actual_tokens": 10, "prediction": {"expected_tokens": 40.0}}
    assert gclient.post("/v1/feedback", json=body).json()["accepted"] is True
    assert gclient.post("/v1/feedback", json=body).json()["duplicate"] is True
    assert online_n(gclient) == n0 + 1 and rejected(gclient, "duplicate") == dup0 + 1


def test_actual_tokens_past_the_bound_is_a_422(sidecar, guarded):
    """The default bound (32768) and --max-actual-tokens: past it nothing is counted, and the id stays open for a
    corrected feedback."""
    for (client, _), bound in ((sidecar, 32768), (guarded, 4096)):
        predict(client, {"prompt": "Count to three.", "request_id": f"huge-{bound}"})
        n0, mae0, out0 = online_n(client), metric(client, "lengthwise_online_mae_tokens", model_version="1"), \
            rejected(client, "out_of_range")
        for actual in (bound + 1, 10_000_000):
            r = client.post("/v1/feedback", json={"request_id": f"huge-{bound}", "actual_tokens": actual})
            assert r.status_code == 422 and str(bound) in r.json()["detail"] and "--max-actual-tokens" in r.json()["detail"]
        assert online_n(client) == n0 and metric(client, "lengthwise_online_mae_tokens", model_version="1") == mae0
        assert rejected(client, "out_of_range") == out0 + 2
        ok = client.post("/v1/feedback", json={"request_id": f"huge-{bound}", "actual_tokens": bound})
        assert ok.status_code == 200 and ok.json()["accepted"] and online_n(client) == n0 + 1
    client, _ = guarded
    out0 = rejected(client, "out_of_range")
    for inline, words in (({"expected_tokens": 1, "bucket": 999}, "out of range"), ({"expected_tokens": 1e8}, "exceeds")):
        r = client.post("/v1/feedback", json={"request_id": "bad-inline", "actual_tokens": 10, "prediction": inline})
        assert r.status_code == 422 and words in r.json()["detail"]
    assert rejected(client, "out_of_range") == out0 + 2


def test_label_series_are_kept_for_the_last_versions_only(guarded):
    """Hot reloads over a long life: the online series of versions long gone are dropped, not kept forever."""
    from dataclasses import replace

    from predictor.sidecar.state import MAX_VERSIONS

    client, _ = guarded
    state = state_of(client)
    first = state.model
    try:
        for i in range(MAX_VERSIONS + 3):
            state.swap(replace(first, resolved=replace(first.resolved, version=f"reload-{i}")))
            (p,) = predict(client, {"prompt": "Hi.", "request_id": f"reload-{i}"})
            assert client.post("/v1/feedback", json={"request_id": p["prediction_id"], "actual_tokens": 3}).status_code == 200
        versions = set(metric_labels(client.get("/metrics").text, "lengthwise_online_feedback_n", "model_version"))
        assert len(versions) <= MAX_VERSIONS and f"reload-{MAX_VERSIONS + 2}" in versions and "reload-0" not in versions
        assert len(state.schemes) <= MAX_VERSIONS
    finally:
        state.swap(first)


def metric_labels(text: str, name: str, label: str) -> list[str]:
    import re

    return re.findall(rf'^{name}{{[^}}]*{label}="([^"]*)"', text, flags=re.MULTILINE)


def test_online_error_counts_in_the_prompts_slice(sidecar):
    """A first turn's feedback counts in the first_turn slice of the online windows, a later turn's in later_turns."""
    client, _ = sidecar
    total = lambda: state_of(client).aggregator.totals[(NAME, "1")]
    before = {k: w.n for k, w in total().slices.items()} if (NAME, "1") in state_of(client).aggregator.totals else {}
    first = [{"role": "user", "content": "Write a limerick about a cat."}]
    later = first + [{"role": "assistant", "content": "There once was a cat..."}, {"role": "user", "content": "Another."}]
    predict(client, {"messages": first, "request_id": "slice-first"})
    predict(client, {"messages": later, "request_id": "slice-later"})
    for rid in ("slice-first", "slice-later"):
        r = client.post("/v1/feedback", json={"request_id": rid, "actual_tokens": 40, "finish_reason": "stop"})
        assert r.status_code == 200, r.text
    slices = total().slices
    assert slices["first_turn"].n == before.get("first_turn", 0) + 1
    assert slices["later_turns"].n == before.get("later_turns", 0) + 1
    assert "first_turn_accuracy_n" in total().metrics()


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs of its own: a real file system that fills and that can be remounted read-only."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], check=False, capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.mark.fault("the feedback store's disk full, then read-only",
                   saw="feedback accepted (200) at once; /health 200",
                   lost="the rows written meanwhile, counted by reason (disk_full, read_only); writing resumes once "
                        "there is space; the rows already stored are kept")
def test_a_full_or_read_only_disk_is_counted_never_the_clients_error(package, small_disk):
    store = FeedbackStore(small_disk / "feedback.db")

    def feedback(client: TestClient, rid: str) -> None:
        predict(client, {"prompt": f"Explain {rid}, with an example. " * 20, "request_id": rid})
        t0 = time.perf_counter()
        r = client.post("/v1/feedback", json={"request_id": rid, "actual_tokens": 90, "finish_reason": "stop"})
        assert r.status_code == 200 and r.json()["accepted"] and time.perf_counter() - t0 < 0.9
        assert client.get("/health").status_code == 200

    def errors(client: TestClient, reason: str) -> float:
        return metric(client, "lengthwise_sidecar_feedback_store_errors_total", reason=reason) or 0.0

    client = open_client(package, store.path)
    try:
        feedback(client, "before")
        wait_for(lambda: [x.prediction_id for x in store.read()] == ["before"], what="the first row")
        filler = small_disk / "filler"
        with open(filler, "wb", buffering=0) as f:  # every free block taken, as a log that filled the disk would
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        for i in range(30):  # each row appends to the write-ahead log until a page finds no block
            feedback(client, f"full-{i}")
        wait_for(lambda: errors(client, "disk_full") > 0, timeout=30, what="a write on the full disk to be counted")
        filler.unlink()
        feedback(client, "freed")
        wait_for(lambda: "freed" in [x.prediction_id for x in store.read()], what="writing to resume")
    finally:
        client.__exit__(None, None, None)
    kept = [x.prediction_id for x in store.read()]
    assert kept[0] == "before" and len(kept) < 32  # the rows of the full disk were dropped, nothing older
    # read-only, as a pod's readOnlyRootFilesystem or a file system the kernel remounted after errors
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    client = open_client(package, store.path)
    try:
        feedback(client, "read-only")
        wait_for(lambda: errors(client, "read_only") > 0, timeout=30, what="the write on the read-only disk to be counted")
    finally:
        client.__exit__(None, None, None)
    assert [x.prediction_id for x in store.read()] == kept
