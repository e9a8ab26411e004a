"""How a length predictor is registered, promoted and loaded.

The MLflow store itself (where it is, pointing the client at it, an experiment in it) is :mod:`predictor.tracking`:
the sidecar uses it too, and the predictor never imports the registry.

A registered version is an MLflow pyfunc whose artifact is the ONNX model package, so
``models:/length-predictor@champion`` loads with nothing but onnxruntime and the tokenizer.

Each version records which model it predicts for (its target, :mod:`predictor.target`) as tags:
``lengthwise.target_model`` (``name@hash``), ``lengthwise.label_tokenizer``, ``lengthwise.label_sampling`` (JSON),
``lengthwise.label_max_tokens`` and ``lengthwise.label_source``; :func:`version_target` reads them back. A version
registered before targets were recorded has none of them, and its target is unknown (None). ``lengthwise.variant`` says
which graph the package ships beyond ``model.onnx``: ``fused`` after ``train-predictor --optimize``, else ``fp32``.
``lengthwise.routes`` says which predictor serves each slice when the package routes slices (predictor.slices), e.g.
``first_turn=tfidf-logreg,later_turns=lengthwise``; a version without it is served by its model alone.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import mlflow
import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.models import ModelSignature
from mlflow.types import ColSpec, Schema

from predictor.package_meta import META_FILE, read_meta
from predictor.runtime import OnnxLengthPredictor
from predictor.slices import routes_tag
from predictor.target import check_target
from predictor.tracking import configure, tracking_uri

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "length-predictor"
CHAMPION = "champion"
CHALLENGER = "challenger"
# Version tags written at registration and read by the promotion guard.
TAG_SPLIT = "eval_split"
TAG_EDGES = "bucket_edges"
COMPARED_METRICS = ("accuracy", "kendall_tau", "mae_tokens")
# The target model of a version (predictor.target): target key -> tag.
TAG_TARGET_MODEL = "lengthwise.target_model"
TARGET_TAGS = {"model": TAG_TARGET_MODEL, "label_tokenizer": "lengthwise.label_tokenizer",
               "sampling": "lengthwise.label_sampling", "max_tokens": "lengthwise.label_max_tokens",
               "source": "lengthwise.label_source"}
TAG_VARIANT = "lengthwise.variant"
TAG_ROUTES = "lengthwise.routes"
TAG_STAGES = "lengthwise.stages"  # what it learnt from, e.g. "dataset answers (sharegpt) x 20000 > SmolLM2-… x 5126"
TAG_FAST_TIER = "lengthwise.fast_tier"  # e.g. "tfidf-logreg:first_turn,later_turns": what a saturated sidecar answers with


class PromotionRefused(RuntimeError):
    """The candidate is worse than (or not comparable with) the current alias holder."""


class RegistryUnreachable(RuntimeError):
    """The tracking server ``MLFLOW_TRACKING_URI`` names does not answer."""


def check_reachable(timeout_s: float = 5.0) -> str:
    """The tracking URI in use, once a tracking server there has answered; raises :class:`RegistryUnreachable` if not.

    Why: a job that logs to MLflow would otherwise learn that the server is down only when it first logs (after its data
    and model are prepared, or its training has run) and then only after MLflow's own retries, minutes later, as a
    traceback. Any HTTP answer counts (a 401 from a server with authentication is a server that is up); the embedded
    SQLite store needs no check.
    """
    import httpx

    uri = tracking_uri()
    if not uri.startswith(("http://", "https://")):
        return uri
    try:
        httpx.get(uri.rstrip("/") + "/health", timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise RegistryUnreachable(f"the MLflow tracking server at {uri} does not answer ({type(exc).__name__}): start it, "
                                  "or unset MLFLOW_TRACKING_URI to use the embedded store under $LENGTHWISE_HOME") from None
    return uri


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


def register_package(package_dir: Path, name: str, metrics: dict, split_fingerprint: str, edges: list[int],
                     target: dict | None = None, slices: dict[str, dict] | None = None) -> Registered:
    """Log the package as a pyfunc model in the active run and register it as a new version of ``name``.

    ``slices`` (slice name -> its test metrics, e.g. ``first_turn``/``later_turns``) become tags ``<slice>.<metric>``
    beside the overall ones, so the online report compares each slice with its own offline figure.

    ``target`` (:mod:`predictor.target`) defaults to the one in the package's ``meta.json``; given both, they must
    agree (ValueError): the tags would otherwise say one model and the sidecar, which reads the package, another.
    """
    target = _package_target(Path(package_dir), check_target(target))
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
    for part, m in (slices or {}).items():
        tags.update({f"{part}.{k}": f"{float(m[k]):.6f}" for k in COMPARED_METRICS if m.get(k) is not None})
    tags.update(target_tags(target))
    tags[TAG_VARIANT] = package_variant(Path(package_dir))
    if (routes := package_routes(Path(package_dir))) is not None:
        tags[TAG_ROUTES] = routes
    if (fast := package_fast_tier(Path(package_dir))) is not None:
        tags[TAG_FAST_TIER] = fast
    if (stages := package_stages(Path(package_dir))) is not None:
        tags[TAG_STAGES] = stages
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, v)
    return Registered(name, version, f"models:/{name}/{version}")


def _package_target(package_dir: Path, given: dict | None) -> dict | None:
    """The target to record: ``given``, else the package's own; refused when both exist and differ."""
    try:
        own = check_target(read_meta(package_dir).target) if (package_dir / META_FILE).is_file() else None
    except ValueError:
        own = None
    if given is not None and own is not None and given != own:
        raise ValueError(f"the target given ({given.get('model')}) differs from the package's ({own.get('model')}); "
                         "export the package with the target it was trained for")
    return given if given is not None else own


def package_variant(package_dir: Path) -> str:
    """The graph variant a package ships (``meta.json``'s ``variant``: ``fused`` when it carries the fused graph), else
    ``fp32``; a distilled student's is prefixed with its layers (``student2-fp32``)."""
    try:
        meta = read_meta(package_dir)
    except (OSError, ValueError):
        return "fp32"
    variant = meta.variant or "fp32"
    student = meta.student
    return f"student{student['layers']}-{variant}" if student is not None and "layers" in student else variant


def package_routes(package_dir: Path) -> str | None:
    """Which predictor serves each slice of a package (``meta.json``'s routes, as :func:`predictor.slices.routes_tag`
    writes them), or None for a package without routes."""
    try:
        return routes_tag(read_meta(package_dir).routes)
    except (OSError, ValueError, AttributeError):
        return None


def package_stages(package_dir: Path) -> str | None:
    """What the package's model learnt from, stage by stage (``meta.json``'s ``stages``), as ``labels x examples > ...``;
    None for a package that does not say."""
    try:
        stages = read_meta(package_dir).stages
        return " > ".join(_stage_text(s) for s in stages) if stages else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def _stage_text(stage: dict) -> str:
    """One stage as ``labels x examples``, its auxiliary head's labels after it (``+ labels x examples on a second
    head``)."""
    text = f"{stage['labels']} x {stage['examples']}"
    if aux := stage.get("auxiliary"):
        text += f" + {aux['labels']} x {aux['examples']} on a second head (weight {aux['weight']:g})"
    return text


def package_fast_tier(package_dir: Path) -> str | None:
    """The package's fast tier as ``predictor:slice,slice`` (``meta.json``'s ``fast_tier``), or None without one."""
    try:
        tier = read_meta(package_dir).fast_tier
        return f"{tier['predictor']}:{','.join(tier['files'])}" if tier else None
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None


def target_tags(target: dict | None) -> dict[str, str]:
    """The version tags of a target: one per key that has a value (sampling as JSON)."""
    if target is None:
        return {}
    out = {}
    for key, tag in TARGET_TAGS.items():
        value = target.get(key)
        if value is not None:
            out[tag] = json.dumps(value, sort_keys=True) if key == "sampling" else str(value)
    return out


def version_target(name: str, version: str) -> dict | None:
    """The target (:mod:`predictor.target`) recorded on a version of ``name``; None when it records none (a version
    registered before targets were). MlflowException when the version does not exist."""
    return tags_target(MlflowClient().get_model_version(name, str(version)).tags)


def tags_target(tags: dict[str, str]) -> dict | None:
    """The target recorded in a version's tags, or None (no target tag at all)."""
    if not any(tag in tags for tag in TARGET_TAGS.values()):
        return None
    out: dict = {key: tags.get(tag) for key, tag in TARGET_TAGS.items()}
    if out["sampling"] is not None:
        out["sampling"] = json.loads(out["sampling"])
    if out["max_tokens"] is not None:
        out["max_tokens"] = int(out["max_tokens"])
    return out


def alias_version(name: str, alias: str) -> str | None:
    try:
        return str(MlflowClient().get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def set_alias(name: str, alias: str, version: str) -> None:
    MlflowClient().set_registered_model_alias(name, alias, str(version))


def ranking_key(metrics: Mapping[str, object]) -> tuple[float, float]:
    """What promotion compares, in order: top-1 accuracy, then Kendall tau (metrics, or a version's tags as strings)."""
    return float(metrics.get("accuracy", "nan")), float(metrics.get("kendall_tau", "nan"))  # type: ignore[arg-type]


def promote(name: str, version: str, alias: str = CHAMPION, force: bool = False) -> str:
    """Move ``alias`` to ``version`` unless the current holder is better on the same evaluation split.

    Comparison is on top-1 accuracy (ties broken by Kendall tau), and only between versions evaluated
    on the same test split with the same buckets, and (where both record one) for the same target model: a
    predictor for another model is not better or worse, it belongs to another deployment. Anything else needs
    ``force``. Returns a message.
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
        theirs, ours = champ.tags.get(TAG_TARGET_MODEL), cand.tags.get(TAG_TARGET_MODEL)
        if theirs and ours and theirs != ours:
            raise PromotionRefused(
                f"version {version} predicts lengths of {ours}, @{alias} (version {current}) those of {theirs}; "
                "register it under another --name for that model's deployment, or pass --force"
            )
        key = lambda v: ranking_key(v.tags)
        if key(cand) < key(champ):
            raise PromotionRefused(
                f"version {version} (accuracy {key(cand)[0]:.4f}, tau {key(cand)[1]:.4f}) is worse than @{alias} "
                f"version {current} (accuracy {key(champ)[0]:.4f}, tau {key(champ)[1]:.4f}); pass --force to promote anyway"
            )
    set_alias(name, alias, version)
    return f"{name} version {version} is now @{alias} (was version {current}{', forced' if force else ''})"


def load_predictor(model_uri: str) -> OnnxLengthPredictor:
    """Load ``models:/<name>@<alias>`` (or ``/<version>``, or a run URI) into an onnxruntime predictor.

    The package is downloaded into a temporary directory that lives as long as the predictor: MLflow's own download
    directory was never removed, about 110 MB in /tmp for every load (a retrain loads two)."""
    configure()
    download = tempfile.mkdtemp(prefix="lengthwise-predictor-")
    try:
        predictor = mlflow.pyfunc.load_model(model_uri, dst_path=download).unwrap_python_model().predictor
    except BaseException:
        shutil.rmtree(download, ignore_errors=True)
        raise
    weakref.finalize(predictor, shutil.rmtree, download, True)
    return predictor
