"""Online prediction error: window arithmetic (the same metrics as the offline evaluation), the alarm,
buffering through an MLflow outage, and the whole path sidecar feedback -> MLflow run -> `registry report`."""

from __future__ import annotations

import logging
import uuid

import numpy as np
import pytest
from mlflow import MlflowClient

from monitoring import online
from predictor import monitoring_runs as runs
from predictor.buckets import BucketScheme
from predictor.tracking import ensure_experiment
from registry import store
from serving.launch.process import free_port
from tests.sidecar_proc import start_sidecar, wait_for
from training.evaluate import Predictions, compute_metrics

SCHEME = BucketScheme.equal_width(200, 2048)


def _feedbacks(n: int, seed: int = 0, version: str = "1",
               name: str = "lp-unit") -> tuple[list[online.Feedback], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    actual = rng.integers(0, 2000, n)
    expected = np.clip(actual + rng.normal(0, 250, n), 0, 2047)
    fbs = [online.Feedback(name, version, int(SCHEME.assign(e)[0]), int(SCHEME.assign(a)[0]), float(e), float(e) * 1.3, int(a))
           for e, a in zip(expected, actual)]
    return fbs, expected, actual


def test_window_metrics_match_offline_definitions():
    fbs, expected, actual = _feedbacks(100)
    agg = online.WindowAggregator(window_size=100, window_seconds=3600, padding=0.15)
    closed = [w for fb in fbs for w in agg.add(fb)]
    assert len(closed) == 1 and closed[0].n == 100
    got = closed[0].metrics()
    probs = np.eye(SCHEME.n)[SCHEME.assign(expected)]
    ref = compute_metrics(Predictions(probs=probs, point=expected), actual, SCHEME, padding=0.15)
    for k in ("accuracy", "accuracy_within_1", "mae_tokens", "bias_tokens", "under_prediction_rate"):
        assert got[k] == pytest.approx(ref[k]), k
    assert got["quantile_overrun_rate"] == pytest.approx(float((actual > expected * 1.3).mean()))


def test_windows_close_by_count_and_by_time():
    fbs, _, _ = _feedbacks(25)
    agg = online.WindowAggregator(window_size=10, window_seconds=3600)
    closed = [w for fb in fbs for w in agg.add(fb)]
    assert [w.n for w in closed] == [10, 10] and agg.totals[("lp-unit", "1")].n == 25
    assert agg.flush_due() == []  # the open 5 are young
    agg.window_seconds = 1e-9
    assert [w.n for w in agg.flush_due()] == [5]
    assert online.merge_windows([w.metrics() for w in closed])["n"] == 20


def test_alarm_when_online_accuracy_drops_below_offline(caplog):
    agg = online.WindowAggregator(window_size=20, window_seconds=3600, alarm_margin=0.1)
    agg.set_offline_accuracy("lp-unit", "1", 0.9)
    wrong = online.Feedback("lp-unit", "1", bucket=0, true_bucket=5, expected_tokens=100.0, quantile_tokens=None,
                            actual_tokens=1000)
    with caplog.at_level(logging.WARNING, logger="monitoring.online"):
        closed = [w for _ in range(20) for w in agg.add(wrong)]
    assert closed[0].alarm and closed[0].metrics()["accuracy_alarm"] == 1.0
    assert "online accuracy alarm" in caplog.text
    right = online.Feedback("lp-unit", "1", bucket=5, true_bucket=5, expected_tokens=1000.0, quantile_tokens=None,
                            actual_tokens=1000)
    closed = [w for _ in range(20) for w in agg.add(right)]
    assert len(closed) == 1 and not closed[0].alarm


def test_each_served_model_has_its_own_part_of_the_window_and_its_own_alarm(caplog):
    """One predictor answering for two served models: it fits the base and fails the adapter that drifted. The total
    stays above the alarm line; the adapter's part raises its own alarm, logged, merged and reported per model."""
    from registry.report import model_lines

    agg = online.WindowAggregator(window_size=120, window_seconds=3600, alarm_margin=0.1)
    agg.set_offline_accuracy("lp-unit", "1", 0.8)
    right = online.Feedback("lp-unit", "1", bucket=5, true_bucket=5, expected_tokens=1000.0, quantile_tokens=None,
                            actual_tokens=1000, served_model="base")
    wrong = online.Feedback("lp-unit", "1", bucket=0, true_bucket=5, expected_tokens=100.0, quantile_tokens=None,
                            actual_tokens=1000, served_model="org/terse:v2")
    with caplog.at_level(logging.WARNING, logger="monitoring.online"):
        closed = [w for i in range(120) for w in agg.add(wrong if i % 6 == 0 else right)]  # 20 of 120 wrong
    (w,) = closed
    assert w.accuracy == pytest.approx(100 / 120) and not w.alarm  # the total stays above 0.8 - 0.1
    m = w.metrics()
    assert m["model.base.accuracy"] == 1.0 and m["model.base.accuracy_alarm"] == 0.0 and m["model.base.n"] == 100
    assert m["model.org/terse_v2.accuracy"] == 0.0 and m["model.org/terse_v2.accuracy_alarm"] == 1.0
    assert "online accuracy alarm for the served model org/terse:v2" in caplog.text
    assert online.served_models([m]) == ["base", "org/terse_v2"]
    total = online.merge_windows([m, m])
    assert total["model.org/terse_v2.n"] == 40 and total["model.org/terse_v2.alarm_windows"] == 2
    assert "online accuracy alarm: lp-unit" not in caplog.text
    assert total["model.base.accuracy"] == 1.0
    drift = online.drift_state([{**m, "step": 0, "timestamp": 1}])
    assert drift["models"]["org/terse_v2"] == {"alarm": True, "window_accuracy": 0.0, "window_n": 20.0}
    lines = model_lines(total, drift, 0.8)
    assert lines[0].startswith("served model base: 200 feedbacks, top-1 1.000") and "ALARM" not in lines[0]
    assert "ALARM" in lines[1] and "(2 windows in alarm)" in lines[1]
    # the served model comes with the request: past MAX_SERVED_MODELS names a window keeps no more parts
    agg = online.WindowAggregator(window_size=10_000, window_seconds=3600)
    for i in range(online.MAX_SERVED_MODELS + 5):
        agg.add(online.Feedback("lp-unit", "1", 5, 5, 1000.0, None, 1000, served_model=f"m{i}"))
    assert len(agg.totals[("lp-unit", "1")].models) == online.MAX_SERVED_MODELS


def test_one_client_key_fills_at_most_its_share_of_a_window():
    """Wrong answers from one key cannot raise the alarm alone: at a share no larger than the alarm's margin, they move a
    window's accuracy by less than the margin; the window closes on everyone's feedback, and the totals count all."""
    over = []
    agg = online.WindowAggregator(window_size=20, window_seconds=3600, alarm_margin=0.1, key_share=0.1,
                                  on_over_share=lambda: over.append(1))
    agg.set_offline_accuracy("lp-unit", "1", 0.9)
    wrong = online.Feedback("lp-unit", "1", bucket=0, true_bucket=5, expected_tokens=100.0, quantile_tokens=None,
                            actual_tokens=1000, client="key-0")
    closed = [w for _ in range(30) for w in agg.add(wrong)]
    assert closed == [] and len(over) == 28 and agg.totals[("lp-unit", "1")].n == 30
    right = [online.Feedback("lp-unit", "1", bucket=5, true_bucket=5, expected_tokens=1000.0, quantile_tokens=None,
                             actual_tokens=1000, client=f"key-{1 + i % 9}") for i in range(18)]
    closed = [w for fb in right for w in agg.add(fb)]
    assert len(closed) == 1 and closed[0].n == 20 and set(closed[0].clients.values()) == {2}
    assert not closed[0].alarm and closed[0].accuracy == pytest.approx(0.9)
    # without a client (one key, or none) nothing is capped: the same 20 wrong answers alarm
    plain = online.WindowAggregator(window_size=20, window_seconds=3600, alarm_margin=0.1, key_share=0.1)
    plain.set_offline_accuracy("lp-unit", "1", 0.9)
    closed = [w for _ in range(20) for w in plain.add(online.Feedback(**{**wrong.__dict__, "client": None}))]
    assert len(closed) == 1 and closed[0].alarm


@pytest.mark.fault("MLflow down while online windows close",
                   saw="nothing (writes never block)",
                   lost="windows past the buffer bound (1 of 4 here), counted; the rest logged once MLflow is back")
def test_windows_buffered_while_mlflow_is_down_then_logged(home, monkeypatch):
    """A real outage: the tracking URI points at a closed port; windows wait in the buffer and are written once it is back."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    name = f"lp-outage-{uuid.uuid4().hex[:8]}"
    logger = runs.MlflowWindowLogger(max_buffered=3, retry_min_s=0.2, retry_max_s=0.4)
    try:
        agg = online.WindowAggregator(window_size=5, window_seconds=3600)
        fbs, _, _ = _feedbacks(20, version="7", name=name)
        for fb in fbs:
            logger.submit(agg.add(fb))  # never blocks, even though every write fails
        wait_for(lambda: logger.failures >= 1, what="a failed write")
        assert logger.buffered == 3 and logger.dropped == 1 and logger.logged == 0
        monkeypatch.delenv("MLFLOW_TRACKING_URI")  # the store is back (the embedded one)
        wait_for(lambda: logger.buffered == 0, timeout=30, what="the buffer to drain")
    finally:
        logger.close()
    run_id, rows = runs.window_history(name, "7")
    assert run_id and [r["n"] for r in rows] == [5, 5, 5] and [r["step"] for r in rows] == [0, 1, 2]
    tags = MlflowClient().get_run(run_id).data.tags
    assert tags[runs.TAG_NAME] == name and tags[runs.TAG_VERSION] == "7"


def test_sidecar_feedback_reaches_mlflow_and_the_report(trained, tmp_path, capsys):
    name, version = trained["registered_name"], trained["registered_version"]
    store.configure()
    client = MlflowClient()
    exp = ensure_experiment(runs.MONITORING_EXPERIMENT)
    before = runs.find_monitoring_run(client, exp, name, version)  # other tests may have fed this version back
    n_before = len(client.get_metric_history(before.info.run_id, "online_n")) if before else 0
    sc = start_sidecar(tmp_path, "--model", f"models:/{name}/{version}", "--window-size", "5", "--window-seconds", "3600",
                       "--alarm-margin", "0.0")
    try:
        prompts = [f"Question {i}: explain topic number {i} in a few sentences." for i in range(12)]
        preds = sc.post("/v1/predict", json={"prompts": prompts}).json()["predictions"]
        for p, actual in zip(preds, [50, 150, 250, 350, 450, 550, 650, 750, 850, 950, 1050, 1150]):
            assert sc.post("/v1/feedback", json={"request_id": p["prediction_id"], "actual_tokens": actual}).status_code == 200
        run = wait_for(lambda: runs.find_monitoring_run(client, exp, name, version), what="the monitoring run")
        wait_for(lambda: len(client.get_metric_history(run.info.run_id, "online_accuracy")) >= n_before + 2, what="two windows")
        metrics = client.get_run(run.info.run_id).data.metrics
        for k in ("online_n", "online_accuracy", "online_accuracy_within_1", "online_mae_tokens", "online_bias_tokens",
                  "online_under_prediction_rate", "online_accuracy_alarm", "online_offline_accuracy"):
            assert k in metrics, k
        assert metrics["online_offline_accuracy"] == pytest.approx(trained["accuracy"], abs=1e-5)
        assert sc.metric("lengthwise_online_feedback_n", model_version=version) == 12
    finally:
        sc.stop()  # shutdown flushes the open window (the last 2 feedbacks)
    history = sorted(client.get_metric_history(run.info.run_id, "online_n"), key=lambda m: m.step)
    assert [m.value for m in history[n_before:]] == [5.0, 5.0, 2.0]
    assert [m.step for m in history] == list(range(len(history)))  # a restart continues the step count

    from serving.cli import main

    capsys.readouterr()
    assert main(["registry", "report", "--name", name, "--version", version]) == 0
    out = capsys.readouterr().out
    assert f"version {version}" in out and "top-1" in out and "offline" in out and "feedbacks" in out
    assert main(["registry", "report", "--name", name, "--version", "999"]) == 2
    assert "error" in capsys.readouterr().err
