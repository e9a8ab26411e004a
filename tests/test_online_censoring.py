"""Censored feedback in the online error windows: a capped answer (finish_reason "length") is a lower bound on the true
length, so it counts in a metric only where that metric's outcome is already decided; and the drift alarm as the
logged windows leave it."""

from __future__ import annotations

import numpy as np
import pytest

from monitoring import online
from predictor.buckets import BucketScheme

pytestmark = pytest.mark.unit

SCHEME = BucketScheme.equal_width(100, 500)  # buckets [0,100) ... [400, 500+): the last is open
N = SCHEME.n


def fb(expected: float, actual: int, reason: str | None = None, quantile: float | None = None) -> online.Feedback:
    return online.Feedback("lp", "1", int(SCHEME.assign(expected)[0]), int(SCHEME.assign(actual)[0]), expected, quantile,
                           actual, reason, N)


def window(*fbs: online.Feedback, padding: float = 0.15) -> online.WindowStats:
    w = online.WindowStats("lp", "1")
    for f in fbs:
        w.add(f, padding)
    return w


def test_a_stream_of_capped_answers_shows_no_positive_bias_and_its_under_predictions():
    """The run that once read bias +179..+240 tokens and 0% under-prediction: answers capped at 64 tokens whose true
    length is far beyond, predicted at 250-450 tokens. Counted as truths they all look over-predicted."""
    rng = np.random.default_rng(0)
    cap = 64
    capped = [fb(float(e), cap, "length", quantile=float(e) * 1.5) for e in rng.uniform(250, 440, 200)]
    naive = window(*[online.Feedback(f.model_name, f.model_version, f.bucket, f.true_bucket, f.expected_tokens,
                                     f.quantile_tokens, f.actual_tokens) for f in capped]).metrics()
    assert naive["bias_tokens"] > 150 and naive["under_prediction_rate"] == 0.0  # what reading them as truths said
    m = window(*capped).metrics()
    assert m["n"] == 200 and m["censored"] == 200
    assert "bias_tokens" not in m and "mae_tokens" not in m and m["error_n"] == 0  # undecided: no error at all
    assert "accuracy" not in m and "under_prediction_rate" not in m  # nothing is known about these yet
    # the same prompts capped at 512 tokens, beyond every prediction: known under-predictions, never a positive bias
    beyond = window(*[fb(f.expected_tokens, 512, "length", f.quantile_tokens) for f in capped]).metrics()
    assert beyond["bias_tokens"] < 0 and beyond["under_prediction_rate"] == 1.0 and beyond["under_n"] == 200
    overrun = sum(512 > f.quantile_tokens for f in capped)  # the others' quantile may still be above the true length
    assert 0 < overrun < 200 and beyond["quantile_n"] == overrun and beyond["quantile_overrun_rate"] == 1.0


def test_mixed_window_counts_each_censored_sample_only_where_decided():
    w = window(
        fb(150, 160),                  # exact, right bucket, small over
        fb(150, 350),                  # exact, wrong, under
        fb(150, 350, "length"),        # censored, already past bucket 1 and the padding: known wrong, under, error <= -200
        fb(350, 120, "length"),        # censored below the prediction: undecided everywhere
        fb(450, 470, "length"),        # censored in the open last bucket, predicted there: known right
        fb(250, 260, "abort"),         # aborted in the predicted bucket: undecided
        fb(150, 260, "stop"),          # 'stop' is exact
    )
    m = w.metrics()
    assert m["n"] == 7 and m["censored"] == 4
    assert m["accuracy_n"] == 5 and m["accuracy"] == pytest.approx(2 / 5)  # exact 3 (1 right) + known wrong + known right
    # within-1: exact 3 (150/160 yes, 150/350 no, 150/260 yes); 150->350 censored: bucket 1 vs >= 3, known no;
    # 450->470: yes; 350->120 and 250->260: undecided
    assert m["within_1_n"] == 5 and m["accuracy_within_1"] == pytest.approx(3 / 5)
    # error: the exact 3, and the censored ones whose expected length is already below the count, at their smallest
    # error (150->350, 450->470, 250->260); 350->120 is undecided
    errs = [150 - 160, 150 - 350, 150 - 260, 150 - 350, 450 - 470, 250 - 260]
    assert m["error_n"] == 6 and m["bias_tokens"] == pytest.approx(np.mean(errs))
    assert m["mae_tokens"] == pytest.approx(np.mean(np.abs(errs)))
    # under (padding 0.15): exact 3 (no, yes, yes); censored 150->350 yes; the others undecided (470 < 450*1.15)
    assert m["under_n"] == 4 and m["under_prediction_rate"] == pytest.approx(3 / 4)


def test_unknown_bucket_count_decides_only_known_wrong():
    right_if_open = online.Feedback("lp", "1", 4, 4, 450.0, None, 470, "length", None)
    m = window(right_if_open).metrics()
    assert "accuracy" not in m  # without the bucket count the last bucket is not known to be open
    wrong = online.Feedback("lp", "1", 0, 3, 50.0, None, 350, "length", None)
    assert window(wrong).metrics()["accuracy"] == 0.0


def test_alarm_counts_decided_feedback_only():
    agg = online.WindowAggregator(window_size=40, window_seconds=3600, alarm_margin=0.1, min_alarm_n=20)
    agg.set_offline_accuracy("lp", "1", 0.9)
    closed = [c for _ in range(40) for c in agg.add(fb(350, 64, "length"))]  # capped low: nothing decided
    assert len(closed) == 1 and not closed[0].alarm and closed[0].accuracy is None
    closed = [c for _ in range(40) for c in agg.add(fb(50, 400, "length"))]  # outgrew every prediction: known wrong
    assert closed[0].alarm and closed[0].accuracy == 0.0


def test_merged_windows_weight_each_rate_by_what_it_counted():
    a = window(*[fb(150, 160)] * 10).metrics()  # accuracy 1 on 10
    b = window(*[fb(150, 350)] * 2, *[fb(350, 64, "length")] * 30).metrics()  # accuracy 0 on 2 decided of 32
    merged = online.merge_windows([a, b])
    assert merged["n"] == 42 and merged["censored"] == 30
    assert merged["accuracy"] == pytest.approx(10 / 12)  # not weighted by n (that would say 10/42)
    old = {k: v for k, v in a.items() if not k.endswith("_n") or k == "n"}  # a window logged before denominators
    assert online.merge_windows([old])["accuracy"] == 1.0


def test_drift_state_from_logged_windows():
    rows = [{"step": 0, "timestamp": 1000, "accuracy": 0.8, "accuracy_alarm": 0.0, "offline_accuracy": 0.8,
             "alarm_margin": 0.1},
            {"step": 1, "timestamp": 2000, "accuracy": 0.5, "accuracy_alarm": 1.0, "offline_accuracy": 0.8,
             "alarm_margin": 0.1},
            {"step": 2, "timestamp": 3000, "accuracy": 0.4, "accuracy_alarm": 1.0, "offline_accuracy": 0.8,
             "alarm_margin": 0.1}]
    d = online.drift_state(rows)
    assert d == {"alarm": True, "window_accuracy": 0.4, "offline_accuracy": 0.8, "margin": 0.1, "since": 2000, "models": {}}
    assert online.drift_state(rows[:1])["alarm"] is False and online.drift_state(rows[:1])["since"] is None
    assert online.drift_state([])["alarm"] is False
