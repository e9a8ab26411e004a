"""`lengthwise registry report` from windows logged to a real (embedded) MLflow store: the censored column, totals
weighted by what each window counted, and the drift alarm line (on since its first alarming window, or off)."""

from __future__ import annotations

import uuid

import pytest
from mlflow import MlflowClient
from rich.console import Console

from monitoring import online
from predictor.monitoring_runs import MlflowWindowLogger
from registry import report, store
from tests.sidecar_proc import wait_for


def _version(tmp_path, accuracy: float) -> tuple[str, str]:
    """A real registered version (its source: an empty directory) with an offline accuracy tag."""
    store.configure()
    client = MlflowClient()
    name = f"lp-report-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(name)
    (tmp_path / "pkg").mkdir()
    mv = client.create_model_version(name, str(tmp_path / "pkg"), tags={"accuracy": str(accuracy)})
    return name, str(mv.version)


def _log(name: str, version: str, windows: list[list[online.Feedback]], offline: float) -> None:
    logger = MlflowWindowLogger(retry_min_s=0.1)
    try:
        for fbs in windows:
            w = online.WindowStats(name, version, offline_accuracy=offline, alarm_margin=0.1, min_alarm_n=5)
            for fb in fbs:
                w.add(fb, 0.15)
            logger.submit([w])
        wait_for(lambda: logger.logged == len(windows), timeout=60, what="the windows to be logged")
    finally:
        logger.close()


def _fb(name: str, version: str, bucket: int, true_bucket: int, reason: str | None = None) -> online.Feedback:
    return online.Feedback(name, version, bucket, true_bucket, 100.0 * bucket + 50, None, 100 * true_bucket + 50, reason, 5)


def test_report_shows_censored_feedback_and_the_drift_alarm(home, tmp_path):
    name, version = _version(tmp_path, 0.8)
    right = [_fb(name, version, 1, 1)] * 10
    wrong = [_fb(name, version, 1, 3)] * 8 + [_fb(name, version, 1, 3, "length")] * 2  # capped past the prediction
    _log(name, version, [right, wrong, wrong + [_fb(name, version, 3, 0, "length")] * 5], offline=0.8)
    console = Console(record=True, width=200)
    out = report.print_report(name, version, None, console=console)
    text = console.export_text()
    assert [w["censored"] for w in out["windows"]] == [0, 2, 7] and out["total"]["censored"] == 9
    assert out["total"]["accuracy"] == pytest.approx(10 / 30)  # the 5 undecided capped answers count nowhere
    assert out["drift"]["alarm"] is True and out["drift"]["since"] == out["windows"][1]["timestamp"]
    assert out["drift"]["margin"] == pytest.approx(0.1) and out["drift"]["offline_accuracy"] == pytest.approx(0.8)
    assert "censored" in text and f"drift alarm: ON for {name} version {version} since" in text
    assert "alarm below 0.700" in text

    _log(name, version, [right], offline=0.8)  # back on track
    console = Console(record=True, width=200)
    out = report.print_report(name, version, None, console=console)
    assert out["drift"]["alarm"] is False and f"drift alarm: off for {name} version {version}" in console.export_text()


def test_online_error_is_reported_per_slice_beside_its_offline_figure(home, tmp_path):
    import dataclasses

    name, version = _version(tmp_path, 0.5)
    MlflowClient().set_model_version_tag(name, version, "first_turn.accuracy", "0.400000")
    first = [dataclasses.replace(_fb(name, version, 1, 1), first_turn=True)] * 3 + \
        [dataclasses.replace(_fb(name, version, 1, 2), first_turn=True)] * 3
    later = [dataclasses.replace(_fb(name, version, 2, 2), first_turn=False)] * 4
    unknown = [_fb(name, version, 0, 4)] * 2  # no prompt known: counts overall, in no slice
    _log(name, version, [first + later, first[:3] + unknown], offline=0.5)
    console = Console(record=True, width=200)
    out = report.print_report(name, version, None, console=console)
    w0 = out["windows"][0]
    assert w0["first_turn_n"] == 6 and w0["first_turn_accuracy"] == pytest.approx(0.5) and w0["later_turns_accuracy"] == 1
    assert w0["first_turn_mae_tokens"] == pytest.approx(50.0) and w0["later_turns_error_n"] == 4
    total = out["total"]
    assert total["first_turn_n"] == 9 and total["first_turn_accuracy"] == pytest.approx(6 / 9)  # weighted by what counted
    assert total["later_turns_n"] == 4 and total["n"] == 15
    text = console.export_text()
    assert "first turn: 9 feedbacks, top-1 0.667 (offline 0.400)" in text and "later turns: 4 feedbacks, top-1 1.000" in text
