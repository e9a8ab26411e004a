"""Printing an evaluation report: our model beside the baselines, as a table per slice, and which predictor wins."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

ROWS = (
    ("accuracy", "top-1 accuracy", "{:.3f}"),
    ("accuracy_within_1", "within-one accuracy", "{:.3f}"),
    ("mae_tokens", "MAE (tokens)", "{:.1f}"),
    ("bias_tokens", "bias (tokens)", "{:+.1f}"),
    ("kendall_tau", "Kendall tau", "{:.3f}"),
    ("pairwise_accuracy", "pairwise ranking accuracy", "{:.3f}"),
    ("under_prediction_rate", "under-prediction @padding", "{:.3f}"),
    ("ece", "calibration error (ECE)", "{:.3f}"),
)
SLICE_TITLES = {"first_turn": "first turns", "later_turns": "later turns", "all": "all turns"}


def _cell(m: dict, key: str, fmt: str) -> str:
    return fmt.format(m[key]) if key in m else "-"


def metrics_table(report: dict, title: str = "Held-out test split") -> Table:
    """All test rows: the model and every baseline (each fitted per slice), with top-1 at coarser buckets."""
    cols = {"lengthwise": report["model"], **report.get("baselines", {})}
    t = _predictors_table(f"{title}, all turns (n={report['model']['n']}, padding {report['model']['padding']:.0%})", cols)
    widths = report.get("accuracy_at_widths", {})
    for w in ("100", "200", "400"):
        if all(w in widths.get(n, {}) for n in cols):
            t.add_row(f"top-1 @{w}-token buckets", *[f"{widths[n][w]['accuracy']:.3f}" for n in cols])
    return t


def slice_table(report: dict, name: str) -> Table:
    """One slice (``first_turn`` or ``later_turns``): every predictor's metrics on that slice's test rows."""
    block = report["slices"][name]
    return _predictors_table(f"{SLICE_TITLES.get(name, name)} (n={next(iter(block.values()))['n']})", block)


def _predictors_table(title: str, cols: dict[str, dict]) -> Table:
    """A metric per row (ROWS), a predictor per column: the layout of the whole split and of each slice."""
    t = Table(title=title)
    t.add_column("metric")
    for name in cols:
        t.add_column(name, justify="right")
    for key, label, fmt in ROWS:
        t.add_row(label, *[_cell(m, key, fmt) for m in cols.values()])
    return t


def verdicts(report: dict) -> list[str]:
    """One line per slice: which predictor is better there, by the recommendation's metric, against the model."""
    by = report.get("recommended_by", "pairwise_accuracy")
    lines = []
    for name, best in report.get("recommended", {}).items():
        block = report["slices"][name]
        ours = block["lengthwise"].get(by, float("nan"))
        if best == "lengthwise":
            others = {k: m.get(by, float("nan")) for k, m in block.items() if k != "lengthwise"}
            runner = max(others, key=lambda k: others[k], default=None) if others else None
            vs = f" vs {runner} {others[runner]:.3f}" if runner else ""
            verb = "ties" if runner and others[runner] == ours else "is better"
            lines.append(f"{SLICE_TITLES.get(name, name)}: lengthwise {verb} ({by} {ours:.3f}{vs})")
        else:
            lines.append(f"{SLICE_TITLES.get(name, name)}: {best} is better ({by} {block[best][by]:.3f} vs lengthwise "
                         f"{ours:.3f}); recommended for this slice")
    return lines


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 120))
    console.print(metrics_table(report))
    for name in report.get("slices", {}):
        if name != "all":
            console.print(slice_table(report, name))
    for line in verdicts(report):
        console.print(line)
    if report.get("routes"):
        console.print("serves: " + ", ".join(f"{SLICE_TITLES.get(part, part)} by {route.get('predictor')}"
                                             for part, route in report["routes"].items()))
    labels = report.get("labels", {})
    if labels.get("censored_samples_in_file"):
        console.print(f"{labels['censored_samples_in_file']} samples of the served-length file ran to the cap (censored; "
                      f"{labels.get('at_cap_test_rows', 0)} test rows at the cap): labelled with the cap, they land in "
                      "the top bucket")
    agree = (labels.get("between_samples") or {}).get("all")
    if agree:
        console.print(f"between two samples of the same prompt ({agree['prompts']} prompts): Kendall tau "
                      f"{agree['kendall_tau']:.3f}, pairwise {agree['pairwise_accuracy']:.3f}: the served model's own noise; "
                      f"a predictor of each prompt's mean length would score about tau {agree['ideal_tau_estimate']:.2f} "
                      "against single samples (an estimate; per slice in the JSON, labels.between_samples)")
    console.print(f"ONNX parity: max |logit diff| = {report['onnx_parity_max_abs_diff']:.2e}  "
                  f"training {report['train_seconds']:.0f}s over {len(report.get('epoch_seconds', []))} epochs "
                  f"({', '.join(f'{s:.0f}s' for s in report.get('epoch_seconds', []))})")
    if pre := report.get("pretrain"):
        console.print(f"pre-trained first on {pre['labels']}: {pre['examples']} training-split examples, "
                      f"{len(pre['epoch_seconds'])} epochs in {pre['train_seconds']:.0f}s, best served validation accuracy "
                      f"{pre['best_val_acc']:.3f} before the served labels")
    if aux := report.get("auxiliary"):
        console.print(f"trained with a second head on {aux['labels']}: {aux['examples']} training-split examples, loss "
                      f"weight {aux['weight']:g} (the served head ships)")
    console.print(f"model: {report['model_uri']}" + (f"  alias @{report['alias']}" if report.get("alias") else ""))
    if report.get("promotion"):
        console.print(f"promotion: {report['promotion']}")
