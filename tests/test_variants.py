"""Serving variants of a predictor package: the fused graph (and its parity), int8 of it, the input-budget cap,
``train-predictor --optimize``'s packaging, the registry's variant tag, and ``lengthwise bench predictor-variants``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest

from predictor.optimize import encoder_shape, fuse
from predictor.runtime import (
    FUSED_FILE,
    FUSED_INT8_FILE,
    MODEL_FILE,
    PRECISIONS,
    OnnxLengthPredictor,
    add_fused_variant,
    logit_parity,
    model_file,
)
from serving.bench.predictor.sidecar import sharegpt_prompts
from tests.datafiles import need_data
from tests.tiny_package import tiny_packages

LENGTHWISE = str(Path(sys.executable).parent / "lengthwise")


@pytest.fixture(scope="module")
def tiny(data, tmp_path_factory) -> Path:
    """A one-layer BERT package (2 heads, hidden 16) exported as train-predictor exports, prompts cut at 32 tokens."""
    work = tmp_path_factory.mktemp("tiny-variants")
    return tiny_packages(work, need_data("tokenizers/gpt2/tokenizer.json"), {"pkg": None})["pkg"]


@pytest.fixture(scope="module")
def minilm(data, tmp_path_factory) -> Path:
    """The real encoder (all-MiniLM-L6-v2: 6 layers, 12 heads, hidden 384) with an untrained head, exported as a
    package: the graph the fusion must match is the one every trained package has."""
    from predictor.buckets import BucketScheme
    from predictor.model import build_classifier, default_backbone_path
    from training.export import export_package, input_format_for, load_backbone_tokenizer

    base = default_backbone_path()
    scheme = BucketScheme.equal_width(200, 1000)
    model = build_classifier(base, scheme.n, lora=None)
    fmt = input_format_for(load_backbone_tokenizer(base), 64, None)
    return export_package(model, tmp_path_factory.mktemp("minilm") / "pkg", base, scheme, fmt, {"backbone": "minilm"})


def _copy(pkg: Path, dst: Path) -> Path:
    shutil.copytree(pkg, dst, ignore=shutil.ignore_patterns("model.*int8*", FUSED_FILE))
    return dst


def test_encoder_shape_is_read_from_the_graph(tiny, minilm):
    t = encoder_shape(onnx.load(str(tiny / MODEL_FILE)))
    assert (t.num_heads, t.hidden_size, t.layers) == (2, 16, 1)
    m = encoder_shape(onnx.load(str(minilm / MODEL_FILE)))
    assert (m.num_heads, m.hidden_size, m.layers) == (12, 384, 6)


def test_every_attention_block_of_the_real_encoder_fuses_and_logits_agree(minilm, tmp_path):
    """Today's export parity, for the fused graph: max |logit diff| against the fp32 ONNX model and the same bucket on
    real ShareGPT prompts (padded batches of mixed lengths, some cut at the budget)."""
    report = fuse(minilm / MODEL_FILE, tmp_path / FUSED_FILE)
    assert report.complete and report.fused["Attention"] == 6
    assert report.fused["SkipLayerNormalization"] == 12 and report.fused.get("BiasGelu", 0) + report.fused.get("Gelu", 0) == 6
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / FUSED_FILE)).graph.node)
    assert ops["Softmax"] == 0 and ops["IsNaN"] == 0 and ops["MatMul"] <= 6 * 3  # what is left: output, FFN in/out
    pkg = _copy(minilm, tmp_path / "pkg")
    ref = OnnxLengthPredictor(pkg)
    fused = OnnxLengthPredictor(pkg, precision="fused")
    ids = [e.ids for e in ref.encode(sharegpt_prompts(64))]
    assert len({len(x) for x in ids}) > 5 and max(len(x) for x in ids) == 64
    parity = logit_parity(ref, fused, ids)
    assert parity["parity_max_abs_diff"] < 1e-4 and parity["bucket_agreement"] == 1.0
    q = logit_parity(ref, OnnxLengthPredictor(pkg, precision="fused-int8"), ids)
    assert 0 < q["parity_max_abs_diff"] < 2.0  # int8 weights move the logits, a little
    ops = Counter(n.op_type for n in onnx.load(str(pkg / FUSED_INT8_FILE)).graph.node)
    assert ops["QAttention"] == 6 and ops["Attention"] == 0


def test_each_precision_is_made_once_then_reused(tiny, tmp_path):
    pkg = _copy(tiny, tmp_path / "pkg")
    made = {}
    for precision in PRECISIONS:
        path = model_file(pkg, precision)
        made[precision] = (path, path.stat().st_mtime_ns)
        OnnxLengthPredictor(pkg, precision=precision).predict(["Say yes."])
    assert made["fp32"][0] == pkg / MODEL_FILE and made["fused"][0] == pkg / FUSED_FILE
    for precision, (path, mtime) in made.items():
        assert model_file(pkg, precision) == path and path.stat().st_mtime_ns == mtime
    with pytest.raises(ValueError, match="precision"):
        model_file(pkg, "fused-int4")


def test_a_read_only_package_keeps_its_variants_in_the_cache(tiny, tmp_path, monkeypatch):
    import os

    pkg = _copy(tiny, tmp_path / "ro")
    monkeypatch.setenv("LENGTHWISE_HOME", str(tmp_path / "home"))
    pkg.chmod(0o555)
    real_access = os.access
    if os.geteuid() == 0:  # root may write anywhere: the permission check is told what a service account would see
        monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == pkg else real_access(p, mode))
    try:
        path = model_file(pkg, "fused-int8")
        assert path.is_relative_to(tmp_path / "home" / "cache" / "fused-int8")
        assert model_file(pkg, "fused").is_relative_to(tmp_path / "home" / "cache" / "fused")
        assert model_file(pkg, "fused-int8") == path  # found again, not made again
        assert not (pkg / FUSED_FILE).exists() and not (pkg / FUSED_INT8_FILE).exists()
        assert OnnxLengthPredictor(pkg, precision="fused-int8").predict(["Say yes."]).probs.shape == (1, 3)
    finally:
        pkg.chmod(0o755)


def test_the_input_budget_cap_cuts_prompts_and_never_raises_them(tiny):
    long = ["word " * 400]
    full = OnnxLengthPredictor(tiny)
    cut = OnnxLengthPredictor(tiny, max_prompt_tokens=12)
    assert full.trained_max_tokens == cut.trained_max_tokens == 32
    assert len(full.encode(long)[0].ids) == 32 and len(cut.encode(long)[0].ids) == 12
    assert cut.predict(long).truncated.all()
    assert OnnxLengthPredictor(tiny, max_prompt_tokens=500).input_format.max_tokens == 32
    room = len(full.input_format.prefix_ids) + len(full.input_format.suffix_ids)
    with pytest.raises(ValueError, match="special tokens"):
        OnnxLengthPredictor(tiny, max_prompt_tokens=room)


def test_add_fused_variant_ships_the_graph_and_records_it(tiny, tmp_path, home):
    """What train-predictor --optimize does to the package: the fused graph beside model.onnx, meta.json's variant and
    parity, and the registry's lengthwise.variant tag."""
    from registry.store import TAG_VARIANT, package_variant

    pkg = _copy(tiny, tmp_path / "pkg")
    assert package_variant(pkg) == "fp32"
    ids = [e.ids for e in OnnxLengthPredictor(pkg).encode(sharegpt_prompts(16))]
    record = add_fused_variant(pkg, ids)
    meta = json.loads((pkg / "meta.json").read_text())
    assert meta["variant"] == "fused" and meta["fused"] == record and (pkg / FUSED_FILE).is_file()
    assert record["complete"] and record["parity_max_abs_diff"] < 1e-4 and record["bucket_agreement"] == 1.0
    assert record["parity_prompts"] == 16 and package_variant(pkg) == "fused"
    import mlflow
    from mlflow import MlflowClient

    from predictor.tracking import ensure_experiment
    from registry.store import register_package

    mlflow.set_experiment(experiment_id=ensure_experiment("variants"))
    tags = {}
    for name, package in (("fused", pkg), ("plain", tiny)):
        with mlflow.start_run():
            reg = register_package(package, f"variant-{name}", {"accuracy": 0.5}, "split", [0, 64, 256])
        tags[name] = MlflowClient().get_model_version(reg.name, reg.version).tags[TAG_VARIANT]
    assert tags == {"fused": "fused", "plain": "fp32"} and TAG_VARIANT == "lengthwise.variant"


def test_train_predictor_has_an_optimize_flag():
    from training.cli import build_parser, config_from_args

    base = ["--data", "x.json"]
    assert config_from_args(build_parser().parse_args([*base, "--optimize"])).optimize is True
    assert config_from_args(build_parser().parse_args(base)).optimize is False


def test_bench_predictor_variants_smoke(tiny, tmp_path):
    out = tmp_path / "variants.json"
    r = subprocess.run([LENGTHWISE, "bench", "predictor-variants", "--package", str(tiny), "--budgets", "16,32",
                        "--layouts", "1x1,1x2", "--max-samples", "300", "--first-turn-only", "--speed-prompts", "32",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {(x["precision"], x["budget"], x["layout"]): x for x in report["rows"]}
    assert set(rows) == {(p, b, lay) for p in PRECISIONS for b in (16, 32) for lay in ("1x1", "1x2")}
    assert report["trained_budget"] == 32 and report["test_rows"] >= 2 and report["split_matches_package"] is False
    for row in rows.values():
        q = row["quality"]["all"]
        assert 0 <= q["accuracy"] <= q["accuracy_within_1"] <= 1 and -1 <= q["kendall_tau"] <= 1
        assert 0 <= q["pairwise_accuracy"] <= 1
        assert row["batch1"]["predictions"] == 32 and row["batch1"]["p50_ms"] <= row["batch1"]["p99_ms"]
        assert row["batch1"]["cpu_ms_per_prediction"] > 0 and row["batch32"]["predictions_per_s"] > 0
        assert row["batch32"]["workers"] == int(row["layout"].split("x")[1])
    ref = rows[("fp32", 32, "1x1")]
    assert ref["parity"] == {"parity_max_abs_diff": 0.0, "bucket_agreement": 1.0}
    # each row's gap to the full model, with its interval; the full model's own is none
    assert ref["vs_full"]["top1"] == [0.0, 0.0, 0.0] and ref["vs_full"]["tau"] == [0.0, 0.0, 0.0]
    for row in rows.values():
        q, full = row["quality"]["all"], ref["quality"]["all"]
        assert row["vs_full"]["top1"][0] == pytest.approx(q["accuracy"] - full["accuracy"])
        assert row["vs_full"]["tau"][0] == pytest.approx(q["kendall_tau"] - full["kendall_tau"])
        assert all(g[1] <= g[2] for g in (row["vs_full"]["top1"], row["vs_full"]["tau"]))
    assert rows[("fused", 32, "1x1")]["parity"]["parity_max_abs_diff"] < 1e-4
    assert rows[("fp32", 16, "1x1")]["mean_prompt_tokens"] < ref["mean_prompt_tokens"]
    # the same graph and budget score the same whatever the layout
    assert rows[("int8", 16, "1x1")]["quality"] == rows[("int8", 16, "1x2")]["quality"]
    assert "pairwise" in r.stdout and "[95%]" in r.stdout and out.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("args, message", [
    (["--precisions", "fp16"], "--precisions"),
    (["--budgets", "64"], "trained budget of 32"),
    (["--budgets", "x"], "--budgets"),
    (["--layouts", "2by1"], "--layouts"),
    (["--speed-prompts", "0"], "--speed-prompts"),
    (["--data", "/nonexistent.json"], "does not exist"),
])
def test_bench_predictor_variants_bad_input_is_one_line(tiny, args, message):
    r = subprocess.run([LENGTHWISE, "bench", "predictor-variants", "--package", str(tiny), *args],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert r.stderr.startswith("lengthwise bench predictor-variants: error:") and len(r.stderr.strip().splitlines()) == 1


def test_a_missing_package_is_one_line(tmp_path):
    r = subprocess.run([LENGTHWISE, "bench", "predictor-variants", "--package", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "not a model package" in r.stderr


def test_parity_reports_disagreement(tiny, tmp_path):
    """The parity check can fail: a package whose head weights were changed disagrees with the original."""
    pkg = _copy(tiny, tmp_path / "other")
    model = onnx.load(str(pkg / MODEL_FILE))
    head = next(t for t in model.graph.initializer if t.name == "head.weight")
    arr = onnx.numpy_helper.to_array(head)
    head.CopyFrom(onnx.numpy_helper.from_array(-arr * 50, "head.weight"))
    onnx.save(model, str(pkg / MODEL_FILE))
    ids = [e.ids for e in OnnxLengthPredictor(tiny).encode(sharegpt_prompts(16))]
    parity = logit_parity(OnnxLengthPredictor(tiny), OnnxLengthPredictor(pkg), ids)
    assert parity["parity_max_abs_diff"] > 1e-2 and np.isfinite(parity["parity_max_abs_diff"])


def test_bench_predictor_variants_tfidf_row_skips_the_encoder_and_is_served_over_http(tiny, tmp_path):
    """The TF-IDF route is fitted on the package's training split, scored on the same rows as the encoder and served by
    a real sidecar from a routed copy of the package; the package itself is left without routes."""
    out = tmp_path / "variants.json"
    r = subprocess.run([LENGTHWISE, "bench", "predictor-variants", "--package", str(tiny), "--precisions", "fp32",
                        "--budgets", "32", "--layouts", "1x1", "--max-samples", "300", "--first-turn-only",
                        "--speed-prompts", "16", "--tfidf", "--sidecar-levels", "1", "--sidecar-duration", "1",
                        "--json", str(out)], capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["precision"]: x for x in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp32", "tfidf-logreg"}
    tf, enc = rows["tfidf-logreg"], rows["fp32"]
    assert tf["budget"] is None and tf["fit"]["first_turn"]["n_train"] > 20 and tf["fit"]["first_turn"]["C"] is not None
    # its own probabilities, not the encoder's (the routed copy answers every test prompt from TF-IDF)
    assert tf["quality"]["all"]["mae_tokens"] != enc["quality"]["all"]["mae_tokens"]
    assert 0 <= tf["quality"]["all"]["pairwise_accuracy"] <= 1 and tf["batch1"]["predictions"] == 16
    assert tf["sidecar"]["1"]["requests"] > 0 and tf["sidecar"]["1"]["errors"] == 0
    assert "tfidf-logreg" in r.stdout and "routes" not in json.loads((tiny / "meta.json").read_text())
