"""A rich progress bar on a console that is not a terminal prints nothing until it stops; ``serving.progress.logged``
prints each task's state as a plain line while it runs, and nothing extra on a terminal."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from serving.progress import logged

pytestmark = pytest.mark.unit


def _bar(console: Console) -> Progress:
    return Progress(TextColumn("work"), BarColumn(), MofNCompleteColumn(), console=console, transient=True)


def test_a_bar_written_to_a_file_reports_in_plain_lines_while_it_runs():
    out = io.StringIO()
    with _bar(Console(file=out, force_terminal=False)) as bar, logged(bar, "relabel", every_s=0.05):
        task = bar.add_task("", total=40)
        for _ in range(8):
            bar.advance(task, 5)
            time.sleep(0.03)
        while "40/40" not in out.getvalue():  # the reporter sees the last state within one interval
            time.sleep(0.01)
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("relabel: ")]
    assert len(lines) >= 2 and "s elapsed" in lines[0]
    assert any(ln.startswith("relabel: 40/40") for ln in lines)


def test_a_terminal_gets_only_the_bar():
    out = io.StringIO()
    with _bar(Console(file=out, force_terminal=True)) as bar, logged(bar, "relabel", every_s=0.01):
        bar.add_task("", total=2)
        time.sleep(0.05)
    assert "relabel: " not in out.getvalue()
