"""``lengthwise registry report``: a version's online prediction error, read back from MLflow.

Shows the windows the sidecar logged (newest last) and their feedback-weighted total next to the
offline test metrics the version was registered with, so drift reads as one comparison, and one line with the drift
alarm as the last window leaves it (on since when, or off). ``censored`` counts answers cut short (capped at
max_tokens, aborted): they are lower bounds, counted in a metric only where its outcome is already decided
(monitoring/online.py says how).
"""

from __future__ import annotations

import datetime as dt

from mlflow import MlflowClient
from rich.console import Console
from rich.table import Table

from monitoring import online
from predictor import monitoring_runs
from registry import store

_COLUMNS = (("n", "feedback", "{:.0f}"), ("censored", "censored", "{:.0f}"), ("accuracy", "top-1", "{:.3f}"),
            ("accuracy_within_1", "within-1", "{:.3f}"),
            ("mae_tokens", "MAE tok", "{:.1f}"), ("bias_tokens", "bias tok", "{:+.1f}"),
            ("under_prediction_rate", "under-pred", "{:.3f}"), ("quantile_overrun_rate", "> quantile", "{:.3f}"))


def _fmt(row: dict, key: str, f: str) -> str:
    return f.format(row[key]) if key in row else "-"


def print_report(name: str, version: str | None, alias: str | None, last: int = 20, console: Console | None = None) -> dict:
    """Print the report; returns ``{"version", "run_id", "windows", "total", "offline", "drift"}`` for callers and tests."""
    console = console or Console(width=max(Console().width, 120))
    store.configure()
    client = MlflowClient()
    if version is None:
        version = str(client.get_model_version_by_alias(name, alias or store.CHAMPION).version)
    mv = client.get_model_version(name, str(version))  # raises for an unknown version: a clear CLI error
    offline = {k: float(mv.tags[k]) for k in store.COMPARED_METRICS if k in mv.tags}
    run_id, rows = monitoring_runs.window_history(name, str(version))
    total = online.merge_windows(rows)
    drift = online.drift_state(rows)
    title = f"online error: {name} version {version}" + (f" (@{alias})" if alias and version == _alias_version(name, alias)
                                                         else "")
    if not rows:
        console.print(f"{title}: no online feedback logged yet (monitoring experiment '{monitoring_runs.MONITORING_EXPERIMENT}' "
                      f"at {store.tracking_uri()})")
        return {"version": str(version), "run_id": run_id, "windows": [], "total": total, "offline": offline,
                "drift": drift}
    t = Table(title=title, caption=f"monitoring run {run_id}; alarm = window top-1 below offline minus the sidecar's margin")
    t.add_column("window", justify="right")
    t.add_column("closed (UTC)", no_wrap=True)
    for _, header, _ in _COLUMNS:
        t.add_column(header, justify="right")
    t.add_column("alarm", justify="center")
    for r in rows[-last:]:
        when = dt.datetime.fromtimestamp(r["timestamp"] / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        t.add_row(str(r["step"]), when, *(_fmt(r, k, f) for k, _, f in _COLUMNS),
                  "[red]ALARM[/red]" if r.get("accuracy_alarm") else "")
    t.add_section()
    t.add_row("all", f"{len(rows)} windows", *(_fmt(total, k, f) for k, _, f in _COLUMNS),
              f"{total.get('alarm_windows', 0):.0f}" if total.get("alarm_windows") else "")
    off = {"accuracy": offline.get("accuracy"), "mae_tokens": offline.get("mae_tokens")}
    t.add_row("offline", "test split", "", *(_fmt({k: v for k, v in off.items() if v is not None}, k, f)
                                            for k, _, f in _COLUMNS[1:]), "")
    console.print(t)
    if "accuracy" in total and "accuracy" in offline:
        console.print(f"online top-1 {total['accuracy']:.3f} vs offline {offline['accuracy']:.3f} "
                      f"({total['accuracy'] - offline['accuracy']:+.3f}) over {total['n']:.0f} feedbacks")
    for line in slice_lines(total, mv.tags) + model_lines(total, drift, offline.get("accuracy")):
        console.print(line)
    console.print(drift_line(name, str(version), drift))
    return {"version": str(version), "run_id": run_id, "windows": rows, "total": total, "offline": offline,
            "drift": drift}


def slice_lines(total: dict, tags: dict[str, str]) -> list[str]:
    """Per slice (first turns, later turns), online top-1 and MAE beside the offline figures the version was
    registered with (tags ``<slice>.<metric>``): a predictor can hold up on later turns, where the previous answer's
    length is a hint, and fail on first turns."""
    lines = []
    for part in online.SLICES:
        if f"{part}_n" not in total:
            continue
        text = f"{part.replace('_', ' ')}: {total[f'{part}_n']:.0f} feedbacks"
        for k, label, f in (("accuracy", "top-1", "{:.3f}"), ("mae_tokens", "MAE", "{:.1f}")):
            if f"{part}_{k}" in total:
                text += f", {label} {f.format(total[f'{part}_{k}'])}"
                if f"{part}.{k}" in tags:
                    text += f" (offline {f.format(float(tags[f'{part}.{k}']))})"
        lines.append(text)
    return lines


def model_lines(total: dict, drift: dict, offline_accuracy: float | None) -> list[str]:
    """Per served model (a predictor answering for several), online top-1 and MAE over every window, and whether its
    part of the last window raised the alarm: the total hides a predictor that fails one service and fits the rest."""
    lines = []
    for served in online.served_models([total]):
        p = f"{online.MODEL_PREFIX}{served}."
        text = f"served model {served}: {total.get(p + 'n', 0):.0f} feedbacks"
        if p + "accuracy" in total:
            text += f", top-1 {total[p + 'accuracy']:.3f}" + (f" (offline {offline_accuracy:.3f}, all models)"
                                                              if offline_accuracy is not None else "")
        if p + "mae_tokens" in total:
            text += f", MAE {total[p + 'mae_tokens']:.1f}"
        if drift.get("models", {}).get(served, {}).get("alarm"):
            text += ", [red]its part of the last window is in ALARM[/red]"
        if total.get(p + "alarm_windows"):
            text += f" ({total[p + 'alarm_windows']:.0f} windows in alarm)"
        lines.append(text)
    return lines


def drift_line(name: str, version: str, drift: dict) -> str:
    """One line: the version's drift alarm as its last logged window leaves it."""
    acc = drift.get("window_accuracy")
    where = (f"last window top-1 {acc:.3f}" if acc is not None else "last window had no decided feedback")
    if drift.get("offline_accuracy") is not None and drift.get("margin") is not None:
        where += f", alarm below {drift['offline_accuracy'] - drift['margin']:.3f} " \
                 f"(offline {drift['offline_accuracy']:.3f} - margin {drift['margin']:.2f})"
    if not drift.get("alarm"):
        return f"drift alarm: off for {name} version {version} ({where})"
    since = dt.datetime.fromtimestamp(drift["since"] / 1000, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return f"[red]drift alarm: ON[/red] for {name} version {version} since {since} ({where})"


def _alias_version(name: str, alias: str) -> str | None:
    return store.alias_version(name, alias)
