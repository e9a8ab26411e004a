"""Printing an evaluation report: our model beside the baselines, as a table."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

ROWS = (
    ("accuracy", "top-1 accuracy", "{:.3f}"),
    ("accuracy_within_1", "within-one accuracy", "{:.3f}"),
    ("mae_tokens", "MAE (tokens)", "{:.1f}"),
    ("bias_tokens", "bias (tokens)", "{:+.1f}"),
    ("kendall_tau", "Kendall tau", "{:.3f}"),
    ("under_prediction_rate", "under-prediction @padding", "{:.3f}"),
    ("ece", "calibration error (ECE)", "{:.3f}"),
)


def metrics_table(report: dict, title: str = "Held-out test split") -> Table:
    cols = {"lengthwise": report["model"], **report.get("baselines", {})}
    t = Table(title=f"{title} (n={report['model']['n']}, padding {report['model']['padding']:.0%})")
    t.add_column("metric")
    for name in cols:
        t.add_column(name, justify="right")
    for key, label, fmt in ROWS:
        t.add_row(label, *[fmt.format(m[key]) for m in cols.values()])
    widths = report.get("accuracy_at_widths", {})
    for w in ("100", "200", "400"):
        if all(w in widths.get(n, {}) for n in cols):
            t.add_row(f"top-1 @{w}-token buckets", *[f"{widths[n][w]['accuracy']:.3f}" for n in cols])
    return t


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 120))
    console.print(metrics_table(report))
    console.print(f"ONNX parity: max |logit diff| = {report['onnx_parity_max_abs_diff']:.2e}  "
                  f"training {report['train_seconds']:.0f}s over {len(report.get('epoch_seconds', []))} epochs "
                  f"({', '.join(f'{s:.0f}s' for s in report.get('epoch_seconds', []))})")
    console.print(f"model: {report['model_uri']}" + (f"  alias @{report['alias']}" if report.get("alias") else ""))
    if report.get("promotion"):
        console.print(f"promotion: {report['promotion']}")
