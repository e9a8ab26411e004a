"""Online-monitoring runs in MLflow: one run per model version, one step per closed window, each metric of a window
logged as ``online_<metric>``.

The sidecar writes them (:class:`MlflowWindowLogger`) and ``lengthwise registry report``, retraining and the loop
bench read them back (:func:`window_history`); writer and reader share the run's name and tags here. Here, in the
predictor and not in the registry, because the sidecar writes them and the predictor never imports the registry. The
windows themselves are :mod:`monitoring.online`; buffering and retrying while MLflow is down,
:mod:`monitoring.window_log`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from monitoring.online import WindowStats
from monitoring.window_log import WindowLogger
from predictor.tracking import configure, ensure_experiment

MONITORING_EXPERIMENT = "lengthwise-monitoring"
TAG_KIND = "lengthwise.kind"
TAG_NAME = "lengthwise.model_name"
TAG_VERSION = "lengthwise.model_version"
KIND = "online-monitoring"


def find_monitoring_run(client, experiment_id: str, name: str, version: str):
    """The monitoring run of version ``version`` of ``name`` (the oldest, should there be several), or None."""
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{TAG_KIND}` = '{KIND}' and tags.`{TAG_NAME}` = '{name}' and tags.`{TAG_VERSION}` = '{version}'",
        max_results=1, order_by=["attributes.start_time ASC"],
    )
    return runs[0] if runs else None


class MlflowWindowLogger(WindowLogger):
    """Writes closed windows to MLflow from a background thread; a bounded buffer rides out outages. A version's run is
    found again after a restart, and its step count continues."""

    def __init__(self, max_buffered: int = 1000, retry_min_s: float = 1.0, retry_max_s: float = 30.0,
                 on_change: Callable[[int, int], None] | None = None):
        self._runs: dict[tuple[str, str], tuple[str, int]] = {}  # (name, version) -> (run_id, next step)
        super().__init__(self._log, max_buffered, retry_min_s, retry_max_s, on_change, where="MLflow")

    def _run_for(self, client, name: str, version: str) -> tuple[str, int]:
        key = (name, version)
        if key not in self._runs:
            exp = ensure_experiment(MONITORING_EXPERIMENT)
            run = find_monitoring_run(client, exp, name, version)
            if run is None:
                run = client.create_run(exp, run_name=f"online-{name}-v{version}",
                                        tags={TAG_KIND: KIND, TAG_NAME: name, TAG_VERSION: version})
                step = 0
            else:
                hist = client.get_metric_history(run.info.run_id, "online_n")
                step = max((m.step for m in hist), default=-1) + 1
            self._runs[key] = (run.info.run_id, step)
        return self._runs[key]

    def _log(self, win: WindowStats) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Metric

        configure()
        client = MlflowClient()
        run_id, step = self._run_for(client, win.model_name, win.model_version)
        ts = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(f"online_{k}", float(v), ts, step) for k, v in win.metrics().items()])
        self._runs[(win.model_name, win.model_version)] = (run_id, step + 1)


def window_history(name: str, version: str) -> tuple[str | None, list[dict]]:
    """(run id, one dict of metrics per logged window in step order) for the report."""
    from mlflow import MlflowClient

    configure()
    client = MlflowClient()
    run = find_monitoring_run(client, ensure_experiment(MONITORING_EXPERIMENT), name, version)
    if run is None:
        return None, []
    steps: dict[int, dict] = {}
    for key in [k for k in run.data.metrics if k.startswith("online_")]:
        for m in client.get_metric_history(run.info.run_id, key):
            steps.setdefault(m.step, {"step": m.step, "timestamp": m.timestamp})[key.removeprefix("online_")] = m.value
    return run.info.run_id, [steps[s] for s in sorted(steps)]
