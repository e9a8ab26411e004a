"""A predictor's target model: the identity it is computed from, the package that carries it (a real ONNX export read
back by onnxruntime), the registry version that records it (real MLflow, SQLite store in a tmp dir) and
``lengthwise registry list``, which shows it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from predictor.target import (
    adapter_id,
    check_target,
    compare_models,
    describe,
    make_target,
    model_id,
    served_model_id,
    split_id,
)
from predictor.tracking import ensure_experiment
from tests.datafiles import need_data

TARGET = make_target("SmolLM2-135M-Instruct@0123456789ab", "served model's own output tokens",
                     "relabel of sharegpt by the served model", {"temperature": 0.7, "top_p": 0.9,
                                                                   "repetition_penalty": 1.1}, 1024)


# --- the identity -------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_relabel_and_the_gateway_compute_one_identity(tmp_path):
    from serving.relabel.run import model_id as relabel_model_id

    d = tmp_path / "SmolLM2-135M-Instruct"
    d.mkdir()
    (d / "config.json").write_text('{"a": 1}')
    assert relabel_model_id is model_id  # moved, not copied
    assert served_model_id(str(d)) == model_id(d, "SmolLM2-135M-Instruct")
    assert served_model_id(str(d) + "/") == served_model_id(str(d))
    assert served_model_id(str(d), "dummy") == model_id(d, "SmolLM2-135M-Instruct", "dummy") != served_model_id(str(d))
    assert served_model_id("/models/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct"
    assert served_model_id("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert served_model_id(str(tmp_path / "no-config")) == str(tmp_path / "no-config")  # not a model directory


@pytest.mark.unit
def test_the_identity_is_the_models_not_where_its_files_came_from(tmp_path):
    """Two copies of one model differ only in what their writer says of itself (the path a converter read the GGUF from,
    its version): one identity. A real key, the chat template or the weights' bytes changed: another model."""
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "rope_theta": 100000.0}
    weights = bytes(range(256)) * 4096  # 1 MiB: more than the sampled slices cover
    dirs = []
    for i, (where, version) in enumerate([("../shared/data/models", "5.0.0"), ("/elsewhere/models", "5.1.0")]):
        d = tmp_path / f"copy{i}" / "SmolLM2-135M-Instruct"
        d.mkdir(parents=True)
        # the same keys in another order, spaced otherwise: JSON is compared by content
        (d / "config.json").write_text(json.dumps({"_name_or_path": where, "transformers_version": version, **config},
                                                  indent=i * 2 or None, sort_keys=bool(i)))
        (d / "tokenizer_config.json").write_text(json.dumps({"name_or_path": where, "model_max_length": 8192}))
        (d / "chat_template.jinja").write_text("{{ messages }}")
        (d / "model.safetensors").write_bytes(weights)
        dirs.append(d)
    a, b = dirs
    assert served_model_id(str(a)) == served_model_id(str(b)) == model_id(a, "SmolLM2-135M-Instruct")
    (b / "model.safetensors").write_bytes(weights[:500_000] + b"\x01" + weights[500_001:])  # one byte mid-file...
    assert served_model_id(str(a)) != served_model_id(str(b))  # ... of a sampled slice: a fine-tune is another model
    assert served_model_id(str(a), "dummy") == served_model_id(str(b), "dummy")  # dummy weights: the files' bytes are not used
    (b / "model.safetensors").write_bytes(weights)
    (b / "chat_template.jinja").write_text("{{ messages }}!")
    assert served_model_id(str(a)) != served_model_id(str(b))
    (b / "chat_template.jinja").write_text("{{ messages }}")
    (b / "config.json").write_text(json.dumps({**config, "rope_theta": 10000.0}))
    assert served_model_id(str(a)) != served_model_id(str(b))


def test_a_fresh_conversion_of_the_gguf_is_the_model_the_committed_labels_name(smollm2):
    """The session's conversion of the GGUF (a fresh directory on every machine) has the identity the committed
    SmolLM2 labels record, so a predictor trained on them is found to be for the served model (``predictor_fit: same``)."""
    from serving.launch.models import predictor_fit

    root = Path(__file__).resolve().parents[1]
    base = served_model_id(str(smollm2))
    summaries = sorted((root / "training" / "labels").glob("smollm2-*.summary.json"))
    adapters = {d.name: adapter_id(base, d, d.name) for d in (root / "serving" / "launch" / "lora").iterdir()}
    for summary in summaries:  # the base's labels name it; an adapter's name the committed adapter on this base
        adapter = next((a for a in adapters if summary.name.startswith(a + ".")), None)
        assert json.loads(summary.read_text())["model"] == adapters.get(adapter, base), summary.name
    assert len(summaries) == 3 + len(adapters) and len(adapters) == 2
    fit = predictor_fit(smollm2, {"target": {"model": json.loads(summaries[0].read_text())["model"]}})
    assert fit["verdict"] == "same", fit


@pytest.mark.slow
def test_two_conversions_of_the_gguf_from_two_spellings_of_its_path_are_one_model(data, smollm2, tmp_path, monkeypatch):
    """A second conversion, from a relative path through a symlinked directory into another cache, as another machine
    would make it: one identity with the session's."""
    from predictor.convert import convert_gguf

    (tmp_path / "models").symlink_to(need_data("models/SmolLM2-135M-Instruct.Q4_1.gguf").parent, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    again = convert_gguf(Path("models") / "SmolLM2-135M-Instruct.Q4_1.gguf", tmp_path / "cache" / "SmolLM2-135M-Instruct")
    assert json.loads((again / "config.json").read_text()).get("_name_or_path") != json.loads(
        (smollm2 / "config.json").read_text()).get("_name_or_path")  # the files differ where the converter read from
    assert served_model_id(str(again)) == served_model_id(str(smollm2))


@pytest.mark.unit
@pytest.mark.parametrize(("served", "target", "verdict"), [
    ("SmolLM2@0123456789ab", "SmolLM2@0123456789ab", "same"),
    ("SmolLM2@0123456789ab", "SmolLM2@ba9876543210", "different"),  # another config, tokenizer or template
    ("Other@0123456789ab", "SmolLM2@0123456789ab", "different"),  # a fine-tune of the same base: same files
    ("HuggingFaceTB/SmolLM2", "smollm2@0123456789ab", "same_name"),  # a hub name: only names compare
    ("SmolLM2", "ChatGPT", "different"),
])
def test_models_compare_by_name_and_hash(served, target, verdict):
    assert compare_models(served, target) == verdict


@pytest.mark.unit
def test_a_target_is_checked_and_described():
    assert split_id(TARGET["model"]) == ("SmolLM2-135M-Instruct", "0123456789ab") and split_id("gpt@x") == ("gpt@x", None)
    assert check_target(None) is None
    assert check_target({"model": None, "label_tokenizer": "gpt2", "source": "dataset answers (ChatGPT)"})["max_tokens"] is None
    assert check_target({**TARGET, "samples": 2})["samples"] == 2  # a newer writer's keys are kept
    for bad, words in (({"model": "m"}, "lacks label_tokenizer, source"), ({**TARGET, "max_tokens": 0}, "max_tokens"),
                       ({**TARGET, "sampling": {"temperature": "hot"}}, "sampling"), ({**TARGET, "model": ""}, "model"),
                       ("SmolLM2", "must be a dict")):
        with pytest.raises(ValueError, match=words):
            check_target(bad)
    assert describe(TARGET).startswith("SmolLM2-135M-Instruct@0123456789ab (relabel of sharegpt by the served model, "
                                       "max_tokens 1024")
    assert describe(None) == "unknown (no target recorded)"


# --- the package: export and read back ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def packages(data, tmp_path_factory) -> dict[str, Path]:
    """The same tiny classifier exported twice: with the target and without one (as before targets were recorded)."""
    from tests.tiny_package import tiny_packages

    return tiny_packages(tmp_path_factory.mktemp("packages"), need_data("tokenizers/gpt2/tokenizer.json"),
                         {"with": TARGET, "without": None})


def test_the_target_goes_into_the_package_and_comes_back(packages, tmp_path):
    from predictor.runtime import OnnxLengthPredictor

    pred = OnnxLengthPredictor(packages["with"])
    assert pred.target == TARGET
    assert pred.predict(["How long is a piece of string?"]).probs.shape == (1, 3)  # still a working package
    assert OnnxLengthPredictor(packages["without"]).target is None
    assert json.loads((packages["without"] / "meta.json").read_text())["target"] is None
    # an older package has no target key at all, and a malformed one must not stop the predictor from loading
    import shutil

    old = shutil.copytree(packages["with"], tmp_path / "old")
    meta = json.loads((old / "meta.json").read_text())
    del meta["target"]
    (old / "meta.json").write_text(json.dumps(meta))
    assert OnnxLengthPredictor(old).target is None
    (old / "meta.json").write_text(json.dumps({**meta, "target": {"model": 3}}))
    assert OnnxLengthPredictor(old).target is None


def test_export_refuses_a_malformed_target_before_writing(packages, tmp_path):
    from predictor.buckets import BucketScheme
    from predictor.prompt import InputFormat
    from training.export import export_package

    with pytest.raises(ValueError, match="lacks label_tokenizer"):
        export_package(None, tmp_path / "p", Path("."), BucketScheme.from_edges([64]), InputFormat(8, (), (), 0, False),  # type: ignore[arg-type]
                       {}, target={"model": "m"})
    assert not (tmp_path / "p").exists()


# --- the registry ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The registry over its own embedded SQLite store in a tmp dir (LENGTHWISE_HOME), restored afterwards."""
    from registry import store as st

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LENGTHWISE_HOME", str(tmp_path_factory.mktemp("target-home")))
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        assert st.configure().startswith("sqlite:///" + os.environ["LENGTHWISE_HOME"])
        yield st
    st.configure()


def _register(store, package: Path, name: str, target: dict | None = None, accuracy: float = 0.5) -> str:
    import mlflow

    with mlflow.start_run(experiment_id=ensure_experiment("target-tests")):
        return store.register_package(package, name, {"accuracy": accuracy, "kendall_tau": 0.1}, "split-1", [64, 256],
                                      target=target).version


def test_a_version_records_its_target_and_the_list_shows_it(store, packages, capsys):
    from mlflow import MlflowClient

    from serving.cli import main

    v_new = _register(store, packages["with"], "lp-target")  # the package's own target
    v_old = _register(store, packages["without"], "lp-target")  # registered as before targets were recorded
    assert store.version_target("lp-target", v_new) == TARGET
    assert store.version_target("lp-target", v_old) is None
    tags = MlflowClient().get_model_version("lp-target", v_new).tags
    assert tags["lengthwise.target_model"] == "SmolLM2-135M-Instruct@0123456789ab"
    assert json.loads(tags["lengthwise.label_sampling"]) == {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}
    assert tags["lengthwise.label_max_tokens"] == "1024" and tags["lengthwise.label_tokenizer"].startswith("served model")
    assert main(["registry", "list", "--name", "lp-target"]) == 0
    rows = {ln.split("│")[1].strip(): ln for ln in capsys.readouterr().out.splitlines() if ln.count("│") > 5}
    assert "SmolLM2-135M-Instruct@0123456789ab" in rows[v_new] and "1024" in rows[v_new]
    assert "unknown" in rows[v_old]


def test_a_given_target_must_agree_with_the_packages(store, packages):
    other = {**TARGET, "model": "SmolLM2-360M-Instruct@ba9876543210"}
    with pytest.raises(ValueError, match="differs from the package's"):
        _register(store, packages["with"], "lp-given", target=other)
    v = _register(store, packages["without"], "lp-given", target=other)  # a package without one takes the given one
    assert store.version_target("lp-given", v)["model"] == "SmolLM2-360M-Instruct@ba9876543210"


def test_promotion_refuses_a_version_for_another_model(store, packages):
    name = "lp-promote"
    champ = _register(store, packages["with"], name)
    store.promote(name, champ)
    other = _register(store, packages["without"], name, accuracy=0.9,
                      target={**TARGET, "model": "SmolLM2-360M-Instruct@ba9876543210"})
    with pytest.raises(store.PromotionRefused, match="predicts lengths of SmolLM2-360M-Instruct@ba9876543210"):
        store.promote(name, other)
    assert "forced" in store.promote(name, other, force=True)
    unknown = _register(store, packages["without"], name, accuracy=0.95)  # no target: the guard cannot compare
    assert "now @champion" in store.promote(name, unknown)
