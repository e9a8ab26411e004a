"""A rich progress bar on a console that is not a terminal prints nothing until it stops; ``serving.progress.logged``
prints each task's state as a plain line while it runs, and nothing extra on a terminal."""

from __future__ import annotations

import io
import time

import pytest
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from serving.progress import Counter, logged, waiting

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


def test_a_wait_that_ends_at_once_leaves_no_line():
    out = io.StringIO()
    with waiting(Console(file=out, force_terminal=False), "loading ...", every_s=0.05, first_s=5.0):
        pass
    assert out.getvalue() == ""


def test_a_wait_with_no_count_is_said_once_it_lasts_and_every_interval():
    out = io.StringIO()
    with waiting(Console(file=out, force_terminal=False), "starting the engine ...", every_s=0.05, first_s=0.02):
        while out.getvalue().count("still running") < 2:
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert lines[0] == "starting the engine ..."
    assert lines[1].startswith("starting the engine ... still running, ") and lines[1].endswith(" s")


def test_a_wait_on_a_terminal_is_a_spinner_only():
    out = io.StringIO()
    with waiting(Console(file=out, force_terminal=True), "starting the engine ...", every_s=0.01):
        time.sleep(0.05)
    assert "still running" not in out.getvalue()


def test_a_count_in_a_file_is_a_plain_line_at_most_every_interval():
    out = io.StringIO()
    with Counter("sweep", total=10, unit="run", every_s=0.05, file=out) as c:
        c.set_postfix_str("vllm @ 1/s: SLO 0.95")
        for _ in range(10):
            c.update()
            time.sleep(0.02)
    lines = out.getvalue().splitlines()
    assert 1 <= len(lines) <= 5  # 10 updates over about 0.2 s, at most one line per 0.05 s
    assert lines[0].startswith("sweep: ") and "/10 runs, " in lines[0] and lines[0].endswith("(vllm @ 1/s: SLO 0.95)")
    assert "min left" in lines[0]


def test_a_quiet_count_writes_nothing():
    out = io.StringIO()
    with Counter("predicting", total=3, every_s=0.0, file=out, quiet=True) as c:
        c.update(3)
    assert out.getvalue() == ""
