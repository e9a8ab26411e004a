"""Where runs and models live, and how a length predictor is registered, promoted and loaded.

Default store: an embedded SQLite tracking/registry database plus a local artifact root under
``$LENGTHWISE_HOME`` (default ``~/.lengthwise``): ``mlflow.db`` and ``artifacts/``. Setting
``MLFLOW_TRACKING_URI`` (e.g. ``http://127.0.0.1:5000`` for an ``mlflow server``) overrides both.

A registered version is an MLflow pyfunc whose artifact is the ONNX model package, so
``models:/length-predictor@champion`` loads with nothing but onnxruntime and the tokenizer.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

from predictor.runtime import OnnxLengthPredictor

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "length-predictor"
CHAMPION = "champion"
CHALLENGER = "challenger"
# Version tags written at registration and read by the promotion guard.
TAG_SPLIT = "eval_split"
TAG_EDGES = "bucket_edges"
COMPARED_METRICS = ("accuracy", "kendall_tau", "mae_tokens")


class PromotionRefused(RuntimeError):
    """The candidate is worse than (or not comparable with) the current alias holder."""


def lengthwise_home() -> Path:
    return Path(os.environ.get("LENGTHWISE_HOME", Path.home() / ".lengthwise")).expanduser()


def tracking_uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    home = lengthwise_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


def configure() -> str:
    """Point the MLflow client at our tracking + registry store; returns the URI in use."""
    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def ensure_experiment(name: str) -> str:
    """Experiment id; local stores keep artifacts under ``$LENGTHWISE_HOME/artifacts``, not the cwd."""
    uri = configure()
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        location = (lengthwise_home() / "artifacts" / name).as_uri()
    return mlflow.create_experiment(name, artifact_location=location)


class LengthPredictorModel(mlflow.pyfunc.PythonModel):
    """MLflow pyfunc wrapper: a DataFrame with a ``prompt`` column in, one row per prediction out."""

    def load_context(self, context) -> None:
        self.predictor = OnnxLengthPredictor(context.artifacts["package"])

    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        q = float((params or {}).get("quantile", 0.9))
        out = self.predictor.predict([str(p) for p in model_input["prompt"]], quantile=q)
        lo_hi = [self.predictor.scheme.range_of(int(b)) for b in out.buckets]
        return pd.DataFrame({
            "bucket": out.buckets.astype("int64"),
            "range_lo": [a for a, _ in lo_hi],
            "range_hi": [b for _, b in lo_hi],
            "expected_tokens": out.expected,
            "quantile_tokens": out.quantile,
        })


SIGNATURE = ModelSignature(
    inputs=Schema([ColSpec("string", "prompt")]),
    outputs=Schema([ColSpec("long", "bucket"), ColSpec("long", "range_lo"), ColSpec("long", "range_hi"),
                    ColSpec("double", "expected_tokens"), ColSpec("double", "quantile_tokens")]),
)


@dataclass
class Registered:
    name: str
    version: str
    model_uri: str  # models:/<name>/<version>


def register_package(package_dir: Path, name: str, metrics: dict, split_fingerprint: str, edges: list[int]) -> Registered:
    """Log the package as a pyfunc model in the active run and register it as a new version of ``name``."""
    info = mlflow.pyfunc.log_model(
        name="length_predictor",
        python_model=LengthPredictorModel(),
        artifacts={"package": str(package_dir)},
        signature=SIGNATURE,
        registered_model_name=name,
        pip_requirements=["onnxruntime", "tokenizers", "numpy", "pandas"],
    )
    version = str(info.registered_model_version)
    client = MlflowClient()
    tags = {TAG_SPLIT: split_fingerprint, TAG_EDGES: ",".join(map(str, edges))}
    tags.update({k: f"{float(metrics[k]):.6f}" for k in COMPARED_METRICS if k in metrics})
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)
    return Registered(name, version, f"models:/{name}/{version}")


def alias_version(name: str, alias: str) -> str | None:
    try:
        return str(MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def set_alias(name: str, alias: str, version: str) -> None:
    MlflowClient().set_registered_model_alias(name, alias, str(version))


def promote(name: str, version: str, alias: str = CHAMPION, force: bool = False) -> str:
    """Move ``alias`` to ``version`` unless the current holder is better on the same evaluation split.

    Comparison is on top-1 accuracy (ties broken by Kendall tau), and only between versions evaluated
    on the same test split with the same buckets; anything else needs ``force``. Returns a message.
    """
    client = MlflowClient()
    cand = client.get_model_version(name, str(version))
    current = alias_version(name, alias)
    if current is None or current == str(version):
        set_alias(name, alias, version)
        return f"{name} version {version} is now @{alias}"
    champ = client.get_model_version(name, current)
    if not force:
        for tag, what in ((TAG_SPLIT, "test splits"), (TAG_EDGES, "bucket schemes")):
            if cand.tags.get(tag) != champ.tags.get(tag):
                raise PromotionRefused(
                    f"version {version} and @{alias} (version {current}) were evaluated on different {what}; "
                    "compare them on the same data or pass --force"
                )
        key = lambda v: (float(v.tags.get("accuracy", "nan")), float(v.tags.get("kendall_tau", "nan")))
        if key(cand) < key(champ):
            raise PromotionRefused(
                f"version {version} (accuracy {key(cand)[0]:.4f}, tau {key(cand)[1]:.4f}) is worse than @{alias} "
                f"version {current} (accuracy {key(champ)[0]:.4f}, tau {key(champ)[1]:.4f}); pass --force to promote anyway"
            )
    set_alias(name, alias, version)
    return f"{name} version {version} is now @{alias} (was version {current}{', forced' if force else ''})"


def load_predictor(model_uri: str) -> OnnxLengthPredictor:
    """Load ``models:/<name>@<alias>`` (or ``/<version>``, or a run URI) into an onnxruntime predictor."""
    configure()
    pyfunc = mlflow.pyfunc.load_model(model_uri)
    return pyfunc.unwrap_python_model().predictor
