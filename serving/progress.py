"""Progress that reaches a log file: a rich progress bar draws nothing on a console that is not a terminal.

Rich renders a :class:`~rich.progress.Progress` live on a terminal; written to a file (``nohup``, CI, a notebook's
captured output) it shows only its last state, when it stops, so an hour of relabelling or a replay looks like a hung
process. :func:`logged` prints each task's state as one plain line every ``every_s`` seconds while the bar runs on
such a console, and does nothing on a terminal.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import Progress

LOG_EVERY_S = 60.0


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
            for task in progress.tasks:
                progress.console.file.write(_line(label, task) + "\n")
                progress.console.file.flush()

    thread = threading.Thread(target=report, name=f"{label}-progress", daemon=True)
    thread.start()
    try:
        yield progress
    finally:
        stop.set()
        thread.join()
