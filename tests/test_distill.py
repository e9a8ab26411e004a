"""The distilled student (training/distill.py, ``train-predictor --distill-to``): its targets, the verdict that decides
what ships, and a real short run whose student ships, is smaller and cheaper, and is tagged as such in the registry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlflow
import numpy as np
import onnx
import pytest

from predictor.model import layers_kept
from tests.cli_inproc import run_main
from tests.datafiles import need_data
from training.cli import main
from training.distill import judge, student_targets

SHAREGPT = "prompts/sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"


@pytest.mark.unit
def test_a_student_keeps_evenly_spaced_layers_first_and_last_and_refuses_what_the_teacher_cannot_give():
    assert layers_kept(6, 2) == [0, 5] and layers_kept(6, 3) == [0, 2, 5] and layers_kept(6, 1) == [5]
    assert all(len(layers_kept(6, k)) == k for k in range(1, 6))
    for bad in (0, 6, 7):
        with pytest.raises(ValueError, match="between 1 and 5 layers"):
            layers_kept(6, bad)


@pytest.mark.unit
def test_student_targets_mix_the_teachers_probabilities_into_the_exact_columns_and_keep_censored_mass():
    probs = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    hard = student_targets(np.array([0, 2]), probs, 0.25)
    assert hard.shape == (2, 6) and np.allclose(hard.sum(1), 1.0)
    assert np.allclose(hard[0, :3], [0.75 + 0.125, 0.075, 0.05]) and np.allclose(hard[:, 3:], 0.0)
    cut = np.array([[0, 0, 0, 0, 1.0, 0], [0, 0, 1.0, 0, 0, 0]])  # the first prompt's answer was cut in bucket 1
    mixed = student_targets(cut, probs, 0.5)
    assert np.allclose(mixed[0], [0.25, 0.15, 0.1, 0, 0.5, 0]) and np.allclose(mixed.sum(1), 1.0)
    assert np.allclose(student_targets(np.array([1, 1]), probs, 1.0)[:, :3], probs)  # alpha 1: the teacher alone
    with pytest.raises(ValueError, match="do not match"):
        student_targets(np.zeros((2, 4)), probs, 0.5)
    with pytest.raises(ValueError, match="within"):
        student_targets(np.array([0, 1]), probs, 1.5)


@pytest.mark.unit
def test_the_student_ships_only_within_the_agreed_loss_on_both_top1_and_tau():
    teacher = {"accuracy": 0.50, "kendall_tau": 0.40}
    assert judge(teacher, {"accuracy": 0.495, "kendall_tau": 0.385}, 0.01, 0.02).ships == "student"
    assert judge(teacher, {"accuracy": 0.55, "kendall_tau": 0.45}, 0.01, 0.02).ships == "student"
    v = judge(teacher, {"accuracy": 0.48, "kendall_tau": 0.41}, 0.01, 0.02)
    assert v.ships == "teacher" and "top-1 -0.020" in v.reason and "tau" not in v.reason
    v = judge(teacher, {"accuracy": 0.50, "kendall_tau": 0.37}, 0.01, 0.02)
    assert v.ships == "teacher" and "tau -0.030" in v.reason


def _args(data: Path, work: Path, *extra: str) -> list[str]:
    return ["--data", str(need_data(SHAREGPT)), "--format", "sharegpt", "--first-turn-only",
            "--tokenizer", str(need_data("tokenizers/gpt2/tokenizer.json")), "--max-samples", "1200", "--epochs", "1",
            "--max-prompt-tokens", "64", "--batch-size", "32", "--lr", "3e-3", "--experiment", "tests-distill",
            "--register", "distill-test", "--work-dir", str(work), "--output-json", str(work / "metrics.json"),
            "--route-slices", "off", "--no-baselines", *extra]


def _train(data: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "training.cli", *_args(data, work, *extra)], capture_output=True,
                          text=True, timeout=1500, check=False)


def test_a_tiny_teachers_student_ships_with_its_layers_and_tag(home, data, tmp_path):
    """The default tier's counterpart of the test below (slow: the real six-layer encoder): a three-layer backbone
    distilled to two, on the same path (train the teacher, distil, score both, ship, register with the variant tag)."""
    from tests.tiny_package import tiny_base

    base = tiny_base(tmp_path / "base", need_data("tokenizers/gpt2/tokenizer.json"), layers=3)
    r = _train(data, tmp_path, "--base-model", str(base), "--max-samples", "300", "--distill-to", "2",
               "--distill-max-top1-drop", "1", "--distill-max-tau-drop", "2", "--experiment", "tests-distill-tiny",
               "--register", "distill-tiny")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "metrics.json").read_text())
    d = report["distillation"]
    assert d["ships"] == "student" and d["student_meta"]["initialised_from_layers"] == [0, 2]
    meta = json.loads((tmp_path / "package" / "meta.json").read_text())
    assert meta["student"]["layers"] == 2 and meta["student"]["teacher_layers"] == 3
    assert report["accuracy"] == pytest.approx(d["student"]["accuracy"], abs=1e-9)  # the report scores what ships
    from registry import store

    store.configure()
    version = mlflow.MlflowClient().get_model_version("distill-tiny", str(report["registered_version"]))
    assert version.tags["lengthwise.variant"] == "student2-fp32"


@pytest.mark.slow
def test_a_short_run_ships_a_two_layer_student_that_is_smaller_cheaper_and_tagged(home, data, tmp_path):
    """Tolerances wide open (the test is about the mechanics; what a student loses is measured by the benchmark): the
    student ships, its graph has two encoder layers' worth of attention, it costs less CPU per prediction than its
    teacher measured the same way, and the registry's variant tag says it is a student."""
    r = _train(data, tmp_path, "--distill-to", "2", "--distill-max-top1-drop", "1", "--distill-max-tau-drop", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((tmp_path / "metrics.json").read_text())
    d = report["distillation"]
    assert d["ships"] == "student" and d["student_meta"]["initialised_from_layers"] == [0, 5]
    for role in ("teacher", "student"):
        assert 0 <= d[role]["accuracy"] <= 1 and -1 <= d[role]["kendall_tau"] <= 1 and d[role]["cpu_ms_per_prediction"] > 0
    assert d["student"]["cpu_ms_per_prediction"] < d["teacher"]["cpu_ms_per_prediction"]
    package = tmp_path / "package"
    meta = json.loads((package / "meta.json").read_text())
    assert meta["student"]["layers"] == 2 and meta["student"]["teacher_layers"] == 6

    def softmaxes(path: Path) -> int:
        return sum(n.op_type == "Softmax" for n in onnx.load(str(path)).graph.node)

    assert softmaxes(package / "model.onnx") + 4 == softmaxes(tmp_path / "teacher-package" / "model.onnx")
    assert report["accuracy"] == pytest.approx(d["student"]["accuracy"], abs=1e-9)  # the report scores what ships
    from registry import store

    store.configure()
    client = mlflow.MlflowClient()
    version = client.get_model_version("distill-test", str(report["registered_version"]))
    assert version.tags["lengthwise.variant"] == "student2-fp32"


def test_a_student_the_backbone_cannot_give_exits_2_with_one_line_before_training(data, tmp_path):
    for bad, words in ((["--distill-to", "6"], "between 1 and 5 layers"), (["--distill-to", "0"], "must be 1 or more"),
                       (["--distill-to", "2", "--distill-alpha", "1.5"], "between 0 and 1")):
        r = run_main(main, _args(data, tmp_path, *bad))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "error" in ln]
        assert r.returncode == 2 and len(lines) == 1 and words in lines[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr
