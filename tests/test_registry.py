"""Registration, aliases, the promotion guard and loading by alias, on the embedded store and a real server."""

from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from predictor.tracking import ensure_experiment
from registry import store


def test_registered_with_signature_and_aliases(trained):
    store.configure()
    name, version = trained["registered_name"], trained["registered_version"]
    mv = MlflowClient().get_model_version(name, version)
    assert mv.tags[store.TAG_SPLIT] == trained["eval_split"]
    assert float(mv.tags["accuracy"]) == pytest.approx(trained["accuracy"], abs=1e-5)
    assert store.alias_version(name, "challenger") == version
    assert store.alias_version(name, "champion") == version  # first --promote with no champion
    info = mlflow.models.get_model_info(f"models:/{name}@champion")
    assert [c["name"] for c in info.signature.inputs.to_dict()] == ["prompt"]


def test_load_by_alias_predicts(trained):
    import gc

    pred = store.load_predictor("models:/length-predictor@champion")
    out = pred.predict(["Explain quantum computing in simple terms."])
    assert out.probs.shape[1] == len(trained["buckets"]["edges"])
    download = next(p for p in Path(pred.package_dir).parents if p.name.startswith("lengthwise-predictor-"))
    assert download.is_dir()  # the package's download lives as long as the predictor ...
    del pred, out
    gc.collect()
    assert not download.exists()  # ... and no longer (MLflow's own was left in /tmp, about 110 MB a load)
    pyfunc = mlflow.pyfunc.load_model("models:/length-predictor@champion")
    import pandas as pd

    df = pyfunc.predict(pd.DataFrame({"prompt": ["hi", "write a poem"]}))
    assert list(df.columns) == ["bucket", "range_lo", "range_hi", "expected_tokens", "quantile_tokens"]
    assert (df["range_hi"] > df["range_lo"]).all()


def _register_copy(trained, metrics, split=None, edges=None) -> str:
    from pathlib import Path

    with mlflow.start_run(experiment_id=ensure_experiment("tests")):
        reg = store.register_package(Path(trained["work_dir"]) / "package", "length-predictor", metrics,
                                     split or trained["eval_split"], edges or trained["buckets"]["edges"])
    return reg.version


def test_promotion_guard(trained):
    store.configure()
    champ = store.alias_version("length-predictor", "champion")
    worse = dict(trained["model"], accuracy=trained["accuracy"] - 0.05)
    v_worse = _register_copy(trained, worse)
    with pytest.raises(store.PromotionRefused, match="worse"):
        store.promote("length-predictor", v_worse)
    assert store.alias_version("length-predictor", "champion") == champ
    v_other = _register_copy(trained, dict(trained["model"], accuracy=0.99), split="another-split")
    with pytest.raises(store.PromotionRefused, match="different test splits"):
        store.promote("length-predictor", v_other)
    better = _register_copy(trained, dict(trained["model"], accuracy=trained["accuracy"] + 0.01))
    assert "now @champion" in store.promote("length-predictor", better)
    assert store.alias_version("length-predictor", "champion") == better
    assert "forced" in store.promote("length-predictor", v_worse, force=True)
    store.promote("length-predictor", champ, force=True)  # leave the trained one as champion


def test_registry_cli(trained, capsys):
    from serving.cli import main

    assert main(["registry", "list"]) == 0
    assert "champion" in capsys.readouterr().out
    assert main(["registry", "promote", "999"]) == 2
    assert "error" in capsys.readouterr().err


def test_real_mlflow_server(trained, shared_mlflow_server, monkeypatch):
    """The same registration and alias loading against a real `mlflow server` over HTTP."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared_mlflow_server)
    assert store.configure() == shared_mlflow_server
    with mlflow.start_run(experiment_id=ensure_experiment("server-test")):
        from pathlib import Path

        reg = store.register_package(Path(trained["work_dir"]) / "package", "lp-server", trained["model"],
                                     trained["eval_split"], trained["buckets"]["edges"])
    assert "now @champion" in store.promote("lp-server", reg.version)
    pred = store.load_predictor("models:/lp-server@champion")
    assert pred.predict(["hello"]).probs.shape == (1, len(trained["buckets"]["edges"]))
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert store.configure().startswith("sqlite:///")  # back on the embedded store
    assert store.alias_version("lp-server", "champion") is None  # the server's model is not in it
