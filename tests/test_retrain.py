"""``lengthwise retrain``: feedback rows in the sidecar's store become a challenger, judged on the newest rows held out.

The served model here answers by a rule the champion never learned (long prompts get long answers), so a challenger
trained on its feedback must beat the champion on traffic it never saw; the champion is a copy of the session's
trained predictor under its own name, so promoting does not move the champion other tests use.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from monitoring.feedback_store import FeedbackRow, FeedbackStore
from predictor.buckets import BucketScheme
from serving.launch.process import free_port
from tests.datafiles import need_data
from training.retrain import RetrainError, Settings, decided, retrain_once, split_window

NAME = "retrain-test"


def _row(i: int, turns, actual: int, censored: bool = False, t: float | None = None, name: str = NAME) -> FeedbackRow:
    return FeedbackRow(f"p{i}", time.time() - 1000 + i if t is None else t, 0.0, name, "1", None,
                       None if turns is None else [tuple(x) for x in turns], f"h{i}", [1.0], [], 0, 100.0, None, actual,
                       "length" if censored else "stop", censored)


@pytest.mark.unit
def test_a_capped_answer_judges_only_where_its_bucket_is_known():
    scheme = BucketScheme.from_edges([0, 200, 400], 512)
    assert decided(_row(0, [], 150), scheme)  # stopped by itself
    assert not decided(_row(1, [], 256, censored=True), scheme)  # capped at 256: [200, 400) or [400, 512]
    assert decided(_row(2, [], 450, censored=True), scheme)  # capped in the open last bucket: known


@pytest.mark.unit
def test_the_newest_rows_are_held_out():
    scheme = BucketScheme.from_edges([0, 200, 400], 512)
    rows = [_row(i, [], 100, t=float(100 - i)) for i in range(10)] + [_row(99, [], 300, censored=True, t=50.0)]
    rows.append(_row(98, [], 300, censored=True, t=99.5))  # inside the held-out span: judges the ranking only
    win = split_window(rows, scheme, 0.2)
    assert len(win.holdout) == 3 and win.undecided == 1 and sum(r.censored for r in win.holdout) == 1
    assert len(win.train) == 9 and any(r.censored for r in win.train)  # the older cut answer trains, as a lower bound
    assert max(r.time for r in win.train) < min(r.time for r in win.holdout)


def _served_length(prompt: str) -> int:
    """The served model's rule: long prompts get long answers (the champion learned ChatGPT's lengths instead)."""
    return 520 if len(prompt.split()) >= 25 else 60


@pytest.fixture()
def champion(trained, home) -> str:
    from registry import store

    reg = store.register_package(Path(trained["work_dir"]) / "package", NAME, trained["model"], trained["eval_split"],
                                 trained["buckets"]["edges"])
    store.set_alias(NAME, store.CHAMPION, reg.version)
    return reg.version


@pytest.fixture()
def feedback(data, tmp_path) -> Path:
    from training.data import load_examples

    examples = load_examples(str(need_data("prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz")), "sharegpt",
                             first_turn_only=True)[:420]
    rows = [_row(i, [(t.role, t.text) for t in e.turns], _served_length(e.latest)) for i, e in enumerate(examples[:400])]
    # long answers cut at 300 of [200, 400), older than the rest: they train as "at least 300", not as 300
    long = [e for e in examples[400:] if _served_length(e.latest) > 300]
    rows += [_row(1000 + i, [(t.role, t.text) for t in e.turns], 300, censored=True, t=time.time() - 2000 + i)
             for i, e in enumerate(long)]
    # and the newest: cut answers held out
    rows += [_row(2000 + i, [(t.role, t.text) for t in e.turns], 300, censored=True) for i, e in enumerate(long)]
    path = tmp_path / "feedback.db"
    store = FeedbackStore(path)
    conn = store.connect()
    FeedbackStore.append(conn, rows, max_rows=10_000, max_age_s=86400.0)
    conn.close()
    return path


def test_one_short_retrain_registers_a_challenger_and_moves_the_alias_only_to_a_better_one(champion, feedback, trained,
                                                                                            tmp_path):
    """The default tier's counterpart of the test below (slow: eight epochs, twice): one epoch on the same feedback, the
    same steps: the window, the served cap inferred, a challenger trained, judged on the held-out rows, registered with
    its lineage, and the alias moved only if it beat the champion."""
    from mlflow import MlflowClient

    from registry import store

    s = Settings(name=NAME, trigger="always", store=str(feedback), min_feedback=100, epochs=1, max_prompt_tokens=32,
                 work_dir=str(tmp_path / "work"), served_model="SmolLM2-135M-Instruct")
    out = retrain_once(s)
    c = out.counts
    assert out.edges[-1] == 300 and c["censored_undecided"] == 0 and c["train"] + c["holdout"] == c["rows"]
    champ, chall = out.holdout["champion"], out.holdout["challenger"]
    assert chall["n"] == c["holdout"] and champ["tau_pairs"] == chall["tau_pairs"] > 0
    from training.retrain import better

    same_buckets = list(trained["buckets"]["edges"]) == list(out.edges)
    assert out.action == ("promoted" if better(chall, champ, same_buckets) else "kept") and out.challenger is not None
    assert store.alias_version(NAME, store.CHAMPION) == (out.challenger if out.action == "promoted" else champion)
    tags = MlflowClient().get_model_version(NAME, out.challenger).tags
    assert tags["lengthwise.parent_version"] == champion and tags["lengthwise.target_model"] == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_retrain_trains_on_feedback_and_promotes_only_a_better_challenger(champion, feedback, tmp_path):
    from mlflow import MlflowClient

    from registry import store

    s = Settings(name=NAME, trigger="always", store=str(feedback), min_feedback=100, epochs=8, max_prompt_tokens=64,
                 work_dir=str(tmp_path / "work"), served_model="SmolLM2-135M-Instruct")
    out = retrain_once(s)
    c = out.counts
    # answers were cut at 300 (the inferred served cap): the challenger's buckets stop there, so every cut answer's
    # bucket is known, and all of them train or judge
    assert out.edges[-1] == 300 and len(out.edges) == 9 and c["censored_undecided"] == 0
    assert c["rows"] == 400 + 2 * c["censored_train"] and c["train"] + c["holdout"] == c["rows"]
    assert c["holdout"] == round(0.2 * c["rows"])
    assert c["censored_train"] > 0 and c["censored_holdout"] == c["censored_train"]
    champ, chall = out.holdout["champion"], out.holdout["challenger"]
    assert chall["n"] == c["holdout"] and champ["tau_pairs"] == chall["tau_pairs"] > 0
    # the challenger learned the served model's rule from its feedback (long prompts, long answers); the champion
    # predicts ChatGPT's lengths: on different buckets the ranking decides
    assert chall["kendall_tau"] > champ["kendall_tau"] + 0.1, out.holdout
    assert out.action == "promoted" and store.alias_version(NAME, store.CHAMPION) == out.challenger != champion
    tags = MlflowClient().get_model_version(NAME, out.challenger).tags
    assert tags["lengthwise.parent_version"] == champion
    assert json.loads(tags["lengthwise.retrain.counts"])["train"] == out.counts["train"]
    assert ".." in tags["lengthwise.retrain.window"] and tags["lengthwise.retrain.trigger"] == "always"
    assert tags["lengthwise.target_model"] == "SmolLM2-135M-Instruct"

    # a second pass on the same feedback: the new champion is judged against its own retrain and is not worse by
    # construction, so the guard may keep it; either way the alias only moves to a version that beat it
    again = retrain_once(s)
    assert again.champion == out.challenger
    if again.action == "kept":
        assert store.alias_version(NAME, store.CHAMPION) == out.challenger
        assert (again.holdout["challenger"]["accuracy"], again.holdout["challenger"]["kendall_tau"]) <= (
            again.holdout["champion"]["accuracy"], again.holdout["champion"]["kendall_tau"])


def test_without_a_drift_alarm_nothing_is_retrained(champion, feedback):
    out = retrain_once(Settings(name=NAME, trigger="alarm", store=str(feedback), min_feedback=100, served_model="M"))
    assert out.action == "skipped" and "no online windows" in out.reason


def test_prompts_not_kept_refuse_and_bad_input_exits_2(champion, tmp_path, capsys):
    from serving.cli import main

    path = tmp_path / "hashes.db"
    conn = FeedbackStore(path).connect()
    FeedbackStore.append(conn, [_row(i, None, 50) for i in range(5)], max_rows=100, max_age_s=86400.0)
    conn.close()
    with pytest.raises(RetrainError, match="--no-store-prompts"):
        retrain_once(Settings(name=NAME, trigger="always", store=str(path), min_feedback=1, served_model="M"))
    for argv, words in ((["--store", str(path), "--min-feedback", "1"], "--no-store-prompts"),
                        (["--store", str(tmp_path / "none.db")], "no feedback store"),
                        (["--holdout", "1.5"], "--holdout must be between 0 and 1"),
                        (["--name", "no-such-model"], "no @champion version")):
        rc = main(["retrain", "--once", "--trigger", "always", "--served-model", "M", "--name", NAME, *argv])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert rc == 2 and len(err) == 1 and err[0].startswith("lengthwise retrain: error:") and words in err[0], err
    rc = main(["retrain", "--once"])  # the served model is what the labels are lengths of: never guessed
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and "--served-model" in err[0], err


@pytest.mark.fault("MLflow down when retrain runs",
                   saw="--once: exit 2 and one line naming the server; as a loop: the pass skipped with that line, the next "
                       "one tried after --interval", lost="nothing (the feedback stays in its store)")
def test_an_unreachable_registry_is_one_line_once_and_a_skipped_pass_in_a_loop(tmp_path, capsys, monkeypatch):
    from serving.cli import main

    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead)
    rc = main(["retrain", "--once", "--trigger", "always", "--served-model", "M", "--name", NAME])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("lengthwise retrain: error:") and dead in err[0], err
    sleeps: list[float] = []

    def interval(seconds: float) -> None:  # the loop's wait: counted, and the second one ends the test
        sleeps.append(seconds)
        if len(sleeps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("training.retrain.time.sleep", interval)
    rc = main(["retrain", "--interval", "7", "--trigger", "always", "--served-model", "M", "--name", NAME])
    out = capsys.readouterr().err
    assert rc == 130 and sleeps == [7.0, 7.0] and out.count("retrain: skipped: the registry failed") == 2, out


def test_too_little_feedback_is_a_skip_not_an_error(champion, tmp_path):
    path = tmp_path / "few.db"
    conn = FeedbackStore(path).connect()
    FeedbackStore.append(conn, [_row(i, [("user", "hi")], 50) for i in range(3)], max_rows=100, max_age_s=86400.0)
    conn.close()
    out = retrain_once(Settings(name=NAME, trigger="always", store=str(path), min_feedback=10, served_model="M"))
    assert out.action == "skipped" and "3 feedback rows" in out.reason
    assert np.isfinite(out.counts["rows"])


@pytest.mark.unit
def test_held_out_ranking_counts_the_cut_answers():
    """A predictor that calls the cut answers short ranks them wrong, though no decided row shows it."""
    import numpy as np

    from predictor.buckets import BucketScheme
    from training.retrain import holdout_metrics

    scheme = BucketScheme.from_edges([0, 200, 400], 512).with_centers(np.array([100, 300, 450]))
    rows = [_row(0, [("user", "a")], 50), _row(1, [("user", "b")], 150), _row(2, [("user", "c")], 256, censored=True)]

    class Fixed:
        def __init__(self, expected):
            self.expected, self.scheme = expected, scheme

        def predict(self, turns):
            from types import SimpleNamespace

            probs = np.eye(3)[scheme.assign(self.expected)]
            return SimpleNamespace(probs=probs, expected=np.array(self.expected, float))

    short = holdout_metrics(Fixed([60.0, 120.0, 30.0]), rows)  # the cut answer predicted shortest
    right = holdout_metrics(Fixed([60.0, 120.0, 300.0]), rows)
    assert short["n"] == right["n"] == 2 and short["accuracy"] == right["accuracy"] == 1.0  # decided rows alike
    assert short["tau_pairs"] == 3 and short["kendall_tau"] == pytest.approx(-1 / 3) and right["kendall_tau"] == 1.0


@pytest.mark.unit
def test_the_challengers_buckets_stop_at_the_served_cap():
    from training.retrain import UNDER_CAP_BUCKETS, better, served_scheme

    champ = BucketScheme.from_edges([200, 400, 600], 2048)
    rows = [_row(i, [], 256, censored=True) for i in range(5)] + [_row(9, [], 40)]
    fine = served_scheme(champ, rows)  # the cut answers (at 256) land in the open last bucket
    assert fine.edges == (0, 32, 64, 96, 128, 160, 192, 224, 256) and fine.n == UNDER_CAP_BUCKETS + 1
    assert fine.decided([256], [True])[0] and served_scheme(champ, rows, cap=300).edges[-1] == 300
    assert served_scheme(champ, rows, cap=5000) == champ  # every edge under the cap: the champion's buckets
    assert served_scheme(champ, [_row(9, [], 40)]) == champ  # nothing capped: the champion's buckets
    # across buckets the ranking decides, not top-1 (two buckets are easier to hit than ten)
    two = {"accuracy": 0.8, "kendall_tau": -0.1, "mae_tokens": 60.0}
    ten = {"accuracy": 0.4, "kendall_tau": 0.3, "mae_tokens": 90.0}
    assert better(two, ten) and not better(two, ten, same_buckets=False) and better(ten, two, same_buckets=False)
