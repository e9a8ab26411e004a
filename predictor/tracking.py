"""The MLflow store lengthwise uses: where it is, pointing the client at it, and an experiment in it.

Default store: an embedded SQLite tracking/registry database plus a local artifact root under
``$LENGTHWISE_HOME`` (default ``~/.lengthwise``): ``mlflow.db`` and ``artifacts/``. Setting
``MLFLOW_TRACKING_URI`` (e.g. ``http://127.0.0.1:5000`` for an ``mlflow server``) overrides both.

Why here and not in the registry: the sidecar resolves ``models:/`` URIs and writes its monitoring runs to the same
store, and the predictor never imports the registry (the registry stores predictor packages, so the dependency runs
one way). MLflow is imported by the functions that talk to it, so the sidecar's command line (``--help``, a refused
flag) starts without it.
"""

from __future__ import annotations

import os

from predictor.common import lengthwise_home


def tracking_uri() -> str:
    """``$MLFLOW_TRACKING_URI``, else the embedded store ``sqlite:///$LENGTHWISE_HOME/mlflow.db``."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    home = lengthwise_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


def configure() -> str:
    """Point the MLflow client at our tracking + registry store; returns the URI in use."""
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def ensure_experiment(name: str) -> str:
    """Experiment id; local stores keep artifacts under ``$LENGTHWISE_HOME/artifacts``, not the cwd."""
    import mlflow

    uri = configure()
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    location = None
    if uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        location = (lengthwise_home() / "artifacts" / name).as_uri()
    return mlflow.create_experiment(name, artifact_location=location)
