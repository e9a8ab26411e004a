"""``lengthwise bench loop`` at CI scale: the feedback loop closed on real processes (predictor-sidecar, lengthwise
serve, one vLLM engine over SmolLM2, MLflow in a tmp LENGTHWISE_HOME, retrain in process).

The champion is made for the occasion: it learned another model's lengths by a rule (short prompts get 5 tokens,
long ones 40) on buckets 16, 32 and an open last one up to 48, so a SmolLM2 answer capped at 48 tokens lands in the
last bucket, whose outcome is decided: every feedback counts. SmolLM2 runs past 48 tokens on almost every prompt, so
the champion's online top-1 falls far below its offline accuracy, the drift alarm goes up, and a challenger trained
on SmolLM2's own lengths must replace it, with the sidecar reloading it while the gateway keeps serving.
"""

from __future__ import annotations

import io
import json

import pytest

from tests.conftest import SHAREGPT
from tests.datafiles import need_data

NAME = "loop-test"
CONTEXT = 1024  # short prompts only: prefill stays cheap on two cores


@pytest.fixture()
def champion(home, data, tmp_path) -> str:
    from registry import store
    from training.config import TrainConfig
    from training.data import load_examples
    from training.pipeline import run

    rows = tmp_path / "other-model.jsonl"
    with rows.open("w") as f:
        for i, e in enumerate(load_examples(str(need_data(SHAREGPT)), "sharegpt", first_turn_only=True)[:240]):
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": t.role, "content": t.text} for t in e.turns],
                                "response_tokens": 40 if len(e.latest.split()) >= 40 else 5, "model": "gpt-3.5-turbo",
                                "sampling": None, "max_tokens": None, "source": "a rule standing in for ChatGPT"}) + "\n")
    run(TrainConfig(data=str(rows), fmt="jsonl", edges="16,32", max_tokens=48, max_samples=None, epochs=2,
                    max_prompt_tokens=32, batch_size=16, lr=3e-3, experiment="tests", register=NAME, alias=None,
                    promote=True, work_dir=str(tmp_path / "champion"), baselines=False))
    version = store.alias_version(NAME, store.CHAMPION)
    assert version is not None
    return version


@pytest.mark.unit
@pytest.mark.parametrize("action", ["promoted", "kept"])
def test_the_loops_six_steps_with_each_step_stood_in_for(action, tmp_path, monkeypatch):
    """The default tier's counterpart of the real loop (slow): the orchestration of its six steps with each step stood
    in for: phase 1, its feedback and windows, the retrain with the settings the loop gives it, the reload it waits for
    (only after a promotion), phase 2 (only then), and the report."""
    import argparse

    from rich.console import Console

    from serving.bench import loop
    from serving.bench.replay import Job
    from training import retrain

    calls: list = []
    jobs = [Job(i, 0.0, (("user", f"q{i}"),), 10, 40, 40) for i in range(4)]
    monkeypatch.setattr(loop, "resolve_model", lambda path, cache: tmp_path / "model")
    monkeypatch.setattr(loop, "plan_prompts", lambda *a: (jobs[:2], jobs[2:], frozenset({"g0"})))
    monkeypatch.setattr(loop, "start", lambda a, model_dir, logs, children, con: loop.Procs("http://sc", "http://gw",
                                                                                        {"served": "m"}, logs))
    versions = iter(["1", "1", "1", "1"])
    monkeypatch.setattr(loop, "health", lambda url: {"model_version": next(versions, "2"), "drift": {"1": {"alarm": True}}})

    def replay_phase(name, js, a, procs, model_dir, con):
        calls.append(("replay", name, len(js)))
        return loop.Phase(name, 0.0, rows=[f"{name}-row"])

    monkeypatch.setattr(loop, "replay_phase", replay_phase)
    monkeypatch.setattr(loop, "collect_feedback", lambda ph, timeout_s: calls.append(("feedback", ph.name)))
    monkeypatch.setattr(loop, "wait_windows", lambda name, vs, rows, since, t: calls.append(("windows", sorted(vs), rows))
                        or {v: [] for v in vs})
    monkeypatch.setattr(loop, "wait_version", lambda url, v, t: calls.append(("reload", v)) or 1.5)
    monkeypatch.setattr(loop, "phase_report", lambda ph: {"name": ph.name})

    def retrain_once(settings):
        calls.append(("retrain", settings.served_model, settings.base_exclude_groups, settings.served_max_tokens))
        return retrain.Outcome(action, "stood in", "1", "2" if action == "promoted" else None)

    monkeypatch.setattr(retrain, "retrain_once", retrain_once)
    a = argparse.Namespace(model_dir=None, phase1=2, phase2=2, max_tokens=48, max_model_len=CONTEXT, seed=0, rate=4.0,
                           window_seconds=1.0, trigger="always", holdout=0.2, min_feedback=1, base_data=None,
                           base_served_lengths=None, epochs=1, max_prompt_tokens=32, reload_interval=1.0, func=None)
    report = loop.loop(a, NAME, "champion", tmp_path / "sharegpt.json", tmp_path, None, Console(file=io.StringIO()))
    promoted = action == "promoted"
    want = [("replay", "phase1", 2), ("feedback", "phase1"), ("windows", ["1"], ["phase1-row"]),
            ("retrain", str(tmp_path / "model"), frozenset({"g0"}), 48)]
    if promoted:
        want += [("reload", "2"), ("replay", "phase2", 2), ("feedback", "phase2"),
                 ("windows", ["1", "2"], ["phase1-row", "phase2-row"])]
    assert calls == want
    assert report["versions"] == ({"before": "1", "after": "2"} if promoted else {"before": "1"})
    assert list(report["phases"]) == (["phase1", "phase2"] if promoted else ["phase1"])
    assert report["retrain"]["action"] == action and (report["reload_s"] == 1.5) == promoted


@pytest.mark.slow
def test_the_loop_retrains_on_served_feedback_and_the_sidecar_reloads_the_new_version(champion, home, smollm2, tmp_path,
                                                                                       capsys):
    from mlflow import MlflowClient

    from monitoring.feedback_store import FeedbackStore
    from serving.cli import main

    # windows close by count, with no wait for their age; 64 rows to train on, so that the challenger's pipeline
    # (a random split by conversation) has rows for train, val and test
    out = tmp_path / "loop.json"
    rc = main(["bench", "loop", "--predictor", f"models:/{NAME}@champion", "--model-dir", str(smollm2),
               "--work-dir", str(tmp_path / "work"), "--phase1", "80", "--phase2", "40", "--max-tokens", "48",
               "--rate", "4", "--window-size", "40", "--holdout", "0.2", "--window-seconds", "300", "--reload-interval", "1",
               "--min-feedback", "10", "--epochs", "2", "--max-prompt-tokens", "32", "--max-model-len", str(CONTEXT),
               "--json", str(out)])
    assert rc == 0, capsys.readouterr().err[-3000:]
    report = json.loads(out.read_text())
    assert report["predictor_fit"]["verdict"] == "different"  # served with --allow-predictor-for-other-model
    ph1 = report["phases"]["phase1"]
    assert ph1["summary"]["requests"]["completed"] == 80 and ph1["feedback_rows"] == 80

    # every answer's feedback is a training row with the engine's finish reason, predicted by the champion
    rows = FeedbackStore().read(model_name=NAME)
    first = [r for r in rows if r.prediction_id in {q["request_id"] for q in ph1["requests"]}]
    assert len(first) == 80 and {r.model_version for r in first} == {champion}
    assert all(r.finish_reason in ("stop", "length") and r.censored == (r.finish_reason == "length") for r in first)
    assert all(r.turns for r in first)

    # the windows were logged and raised the alarm, so retrain (trigger alarm) ran and promoted a challenger
    assert report["drift_after_phase1"]["alarm"] is True
    assert sum(w["n"] for w in report["windows"][champion]) == 80
    r = report["retrain"]
    assert r["action"] == "promoted", r
    new = r["challenger"]
    assert new != champion and report["versions"] == {"before": champion, "after": new}
    tags = MlflowClient().get_model_version(NAME, new).tags
    assert tags["lengthwise.parent_version"] == champion and tags["lengthwise.retrain.trigger"] == "alarm"
    assert json.loads(tags["lengthwise.retrain.counts"])["train"] == 64
    assert tags["lengthwise.target_model"].startswith("SmolLM2-135M-Instruct@")

    # the sidecar hot-reloaded it, and every phase-2 prediction came from it
    assert report["reload_s"] is not None and report["health_end"]["model_version"] == new
    ph2 = report["phases"]["phase2"]
    assert ph2["summary"]["requests"]["completed"] == 40 and ph2["versions"] == [new]
    assert {q["version"] for q in ph2["requests"]} == {new}
    assert not {q["request_id"] for q in ph2["requests"]} & {q["request_id"] for q in ph1["requests"]}
    assert all(q["pred_len"] is not None and q["output_tokens"] for q in ph2["requests"])
    for ph, n in ((ph1, 80), (ph2, 40)):  # both versions scored; every answer's bucket is decided at these edges
        (sc,) = ph["scores"].values()
        assert sc["n"] == n and sc["accuracy_n"] == n and "kendall_tau" in sc
    assert out.with_suffix(".png").stat().st_size > 10_000


@pytest.mark.unit
def test_censored_tau_counts_only_pairs_whose_order_is_known():
    import numpy as np

    from training.evaluate import censored_tau

    # a: 10 (finished), 30 (finished), 20 capped (>= 20), 5 capped (>= 5)
    actual, censored = np.array([10, 30, 20, 5]), np.array([False, False, True, True])
    # known: 10 < 30 and 10 < (>= 20); a capped answer is never known to be the shorter one: the other four are unknown
    tau, pairs = censored_tau(np.array([1.0, 2.0, 3.0, 0.0]), actual, censored)
    assert pairs == 2 and tau == 1.0
    tau, pairs = censored_tau(np.array([3.0, 2.0, 1.0, 0.0]), actual, censored)
    assert pairs == 2 and tau == -1.0
    assert censored_tau(np.array([1.0, 1.0]), np.array([5, 6]), np.array([True, True])) == (None, 0)


def test_bad_input_exits_2_with_one_line(home, capsys, tmp_path):
    from serving.cli import main

    for argv, words in ((["--phase1", "0"], "--phase1 must be at least 1"),
                        (["--rate", "-1"], "--rate must be positive"),
                        (["--holdout", "1"], "--holdout must be between 0 and 1"),
                        (["--predictor", "/no/such/dir"], "models:/NAME@ALIAS"),
                        (["--predictor", "models:/no-such-model@champion"], "no such alias"),
                        (["--base-data", "x.json"], "go together"),
                        (["--max-tokens", "4000"], "no room for a prompt"),
                        (["--model-dir", str(tmp_path)], "no config.json")):
        rc = main(["bench", "loop", *argv])
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert rc == 2 and len(err) == 1 and err[0].startswith("lengthwise bench loop: error:") and words in err[0], err
