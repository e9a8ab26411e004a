"""Progress that reaches a log file: a rich progress bar draws nothing on a console that is not a terminal.

Rich renders a :class:`~rich.progress.Progress` live on a terminal; written to a file (``nohup``, CI, a notebook's
captured output) it shows only its last state, when it stops, so an hour of relabelling or a replay looks like a hung
process. :func:`logged` prints each task's state as one plain line every ``every_s`` seconds while the bar runs on
such a console, and does nothing on a terminal. :func:`waiting` does the same for a wait with no count (an engine
starting), :class:`Counter` for the benches' tqdm bars.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self, TextIO

from rich.console import Console
from rich.progress import Progress

LOG_EVERY_S = 60.0


def _log_file(console: Console) -> TextIO:
    """Where a console's progress lines go when it is not a terminal: its own file, unless that is standard output,
    which holds a command's results (its table, its JSON path) and stays clean of progress."""
    return sys.stderr if console.file is sys.stdout else console.file


def _line(label: str, task) -> str:
    total = f"/{task.total:.0f}" if task.total is not None else ""
    rate = f", {task.speed:.2f}/s" if task.speed else ""
    left = f", about {task.time_remaining / 60:.1f} min left" if task.time_remaining is not None else ""
    what = f" {task.description}" if task.description else ""
    return f"{label}: {task.completed:.0f}{total}{what}, {task.elapsed or 0:.0f} s elapsed{rate}{left}"


@contextmanager
def logged(progress: Progress, label: str, every_s: float = LOG_EVERY_S) -> Iterator[Progress]:
    """Within the block, a plain line per task every ``every_s`` seconds on ``progress``'s console when that console
    is not a terminal."""
    if progress.console.is_terminal:
        yield progress
        return
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(every_s):
            out = _log_file(progress.console)
            for task in progress.tasks:
                out.write(_line(label, task) + "\n")
                out.flush()

    thread = threading.Thread(target=report, name=f"{label}-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()


@contextmanager
def waiting(console: Console, message: str, every_s: float = LOG_EVERY_S, first_s: float = 2.0) -> Iterator[None]:
    """``console.status(message)`` on a terminal; elsewhere the message as a line once the wait has lasted ``first_s``
    and a line every ``every_s`` seconds after, so starting an engine for minutes does not read as a hang in a log,
    while a wait that ends at once (or a command that fails at once on bad input) leaves no line behind; ``first_s``
    0 says it as it starts."""
    if console.is_terminal:
        with console.status(message):
            yield
        return
    out = _log_file(console)
    stop = threading.Event()
    started = time.monotonic()

    def say() -> None:
        out.write(message + "\n")
        out.flush()

    if first_s <= 0:  # a step the command narrates (the demo's): said as it starts, however short
        say()

    def report() -> None:
        if first_s > 0:
            if stop.wait(first_s):
                return
            say()
        while not stop.wait(every_s):
            out.write(f"{message} still running, {time.monotonic() - started:.0f} s\n")
            out.flush()

    thread = threading.Thread(target=report, name="status-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Counter:
    """A count of finished units (runs of a sweep, prompts predicted) drawn as a tqdm bar on a terminal and written
    as a plain line at most every ``every_s`` seconds elsewhere (tqdm either draws ``\\r`` frames into a file or, as
    the benches asked it with ``disable=None``, nothing at all)."""

    def __init__(self, desc: str, total: int | None = None, unit: str = "run", every_s: float = LOG_EVERY_S,
                 file: TextIO | None = None, quiet: bool = False) -> None:
        self.file = file or sys.stderr
        self.desc, self.total, self.unit = desc, total, unit
        self.every_s = float("inf") if quiet else every_s
        self.n, self.postfix = 0, ""
        self.started = self.logged_at = time.monotonic()
        self._bar = None
        if self.file.isatty() and not quiet:
            from tqdm import tqdm

            self._bar = tqdm(desc=desc, total=total, unit=unit, leave=False, file=self.file)

    def update(self, n: int = 1) -> None:
        self.n += n
        if self._bar is not None:
            self._bar.update(n)
        elif time.monotonic() - self.logged_at >= self.every_s:
            self.logged_at = time.monotonic()
            self.file.write(self.line() + "\n")
            self.file.flush()

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s
        if self._bar is not None:
            self._bar.set_postfix_str(s)

    def line(self) -> str:
        elapsed = time.monotonic() - self.started
        rate = self.n / elapsed if elapsed > 0 else 0.0
        total = f"/{self.total}" if self.total is not None else ""
        left = (f", about {(self.total - self.n) / rate / 60:.1f} min left"
                if self.total is not None and rate > 0 else "")
        tail = f" ({self.postfix})" if self.postfix else ""
        return f"{self.desc}: {self.n}{total} {self.unit}s, {elapsed:.0f} s elapsed, {rate:.2f}/s{left}{tail}"

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
