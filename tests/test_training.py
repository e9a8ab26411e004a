"""The short real training run of conftest.trained: quality vs the baselines, ONNX parity, artifacts."""

from pathlib import Path

import numpy as np
import pytest

from predictor.runtime import OnnxLengthPredictor


def test_beats_global_median_on_held_out_split(trained):
    ours, median = trained["model"], trained["baselines"]["global-median"]
    assert trained["n_test"] >= 200
    assert ours["kendall_tau"] > median["kendall_tau"] + 0.15
    assert ours["mae_tokens"] < median["mae_tokens"]
    # within-one accuracy is not asserted: a constant central prediction scores high on it by construction


def test_report_contract(trained):
    for key in ("accuracy", "accuracy_within_1", "mae_tokens", "bias_tokens", "kendall_tau", "baselines",
                "model_uri", "onnx_parity_max_abs_diff"):
        assert key in trained
    assert set(trained["baselines"]) == {"global-median", "prompt-length-bin", "tfidf-logreg"}
    assert set(trained["accuracy_at_widths"]["lengthwise"]) == {"100", "200", "400"}
    assert trained["model_uri"].startswith("models:/length-predictor/")
    assert len(trained["epoch_seconds"]) == trained["epochs_run"] >= 1
    # first turns only: no later-turn slice; every slice names the predictor to ship there
    assert set(trained["slices"]) == {"first_turn", "all"} == set(trained["recommended"])
    assert trained["slices"]["first_turn"]["lengthwise"]["n"] == trained["n_test"]
    assert set(trained["slices"]["all"]) == {"lengthwise", *trained["baselines"]}
    assert 0.5 < trained["model"]["pairwise_accuracy"] <= 1.0


def test_dataset_answers_are_the_recorded_target(trained):
    from registry import store

    want = {"model": "dataset answers (sharegpt)", "label_tokenizer": "tokenizer.json", "sampling": None,
            "max_tokens": 2048, "source": "dataset answers"}
    assert OnnxLengthPredictor(Path(trained["work_dir"]) / "package").target == want
    assert store.version_target("length-predictor", trained["registered_version"])["model"] == want["model"]


def test_onnx_parity_and_plots(trained):
    assert trained["onnx_parity_max_abs_diff"] < 1e-3
    work = Path(trained["work_dir"])
    for name in ("confusion_matrix.png", "reliability.png", "error_by_prompt_length.png"):
        assert (work / "plots" / name).stat().st_size > 5000


def test_runtime_predict_shapes_and_consistency(trained):
    p = OnnxLengthPredictor(Path(trained["work_dir"]) / "package")
    prompts = ["Write a detailed 2000 word essay on the history of Rome.", "Say yes or no.",
               [("user", "hi"), ("assistant", "hello"), ("user", "translate 'cat' to French")]]
    out = p.predict(prompts, quantile=0.9)
    buckets, probs, expected, quantile = out
    assert probs.shape == (3, p.scheme.n)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-6)
    assert (quantile >= 0).all() and (expected > 0).all()
    np.testing.assert_array_equal(buckets, probs.argmax(1))
    # batch composition must not change a prompt's prediction (padding is masked)
    alone = p.predict([prompts[1]]).probs[0]
    np.testing.assert_allclose(alone, probs[1], atol=1e-5)


def test_int8_precision_quantizes_once_and_agrees_with_fp32(trained, data, tmp_path):
    import shutil

    from predictor.runtime import INT8_FILE

    pkg = tmp_path / "package"
    shutil.copytree(Path(trained["work_dir"]) / "package", pkg)
    fp32 = OnnxLengthPredictor(pkg)
    q = OnnxLengthPredictor(pkg, precision="int8")
    made = (pkg / INT8_FILE).stat()
    assert made.st_size < (pkg / "model.onnx").stat().st_size / 2  # int8 weights: a quarter of the bytes, roughly
    OnnxLengthPredictor(pkg, precision="int8")
    assert (pkg / INT8_FILE).stat().st_mtime_ns == made.st_mtime_ns  # quantized once, then reused
    prompts = ["Write a detailed 2000 word essay on the history of Rome.", "Say yes or no.", "List three colours.",
               "Explain quantum computing to a child in one paragraph.", "Translate 'good morning' into Spanish."] * 4
    a, b = fp32.predict(prompts), q.predict(prompts)
    np.testing.assert_allclose(b.probs.sum(1), 1.0, rtol=1e-6)
    assert np.abs(a.probs - b.probs).max() < 0.25 and (a.buckets == b.buckets).mean() >= 0.6
    with pytest.raises(ValueError, match="precision"):
        OnnxLengthPredictor(pkg, precision="int4")
