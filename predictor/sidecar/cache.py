"""Resolve a model URI to a local ONNX package directory, through a cache that survives the registry.

The sidecar must restart when MLflow is down (a node reboot during a tracking-server outage should
not take length prediction with it), so every package it resolves is copied under
``$LENGTHWISE_HOME/cache/models/<name>/<version>/`` beside a ``registry.json`` (version tags such as
the offline ``accuracy`` that online monitoring compares against), and the alias it was reached by is
remembered in ``<name>/aliases.json``. When the registry cannot be reached, ``models:/<name>@<alias>``
falls back to the version the alias last pointed at; a name the registry does not know is an error
even when a cache exists, because serving a model the registry disowns would be a silent surprise.

Accepted URIs: ``models:/<name>@<alias>``, ``models:/<name>/<version>``, or a package directory
(``model.onnx`` + ``tokenizer.json`` + ``meta.json``) for development without a registry.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from predictor.common import lengthwise_home
from predictor.package_meta import META_FILE
from predictor.runtime import MODEL_FILE, TOKENIZER_FILE
from predictor.tracking import configure, tracking_uri

log = logging.getLogger(__name__)

PACKAGE_FILES = (MODEL_FILE, TOKENIZER_FILE, META_FILE)
REGISTRY_FILE = "registry.json"
ALIASES_FILE = "aliases.json"
_MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[^/@]+)|/(?P<version>[^/@]+))$")


class ModelResolveError(RuntimeError):
    """The URI names nothing servable: unknown model/alias/version, or registry down and nothing cached."""


@dataclass(frozen=True)
class ModelRef:
    """A parsed ``models:/`` URI (exactly one of alias/version set) or a local directory (``path``)."""

    uri: str
    name: str | None = None
    alias: str | None = None
    version: str | None = None
    path: Path | None = None

    @property
    def follows_alias(self) -> bool:
        """Whether the served version can move (hot reload polls only these)."""
        return self.alias is not None


@dataclass(frozen=True)
class ResolvedModel:
    """A package on local disk plus what the registry said about it."""

    path: Path
    name: str
    version: str
    uri: str
    tags: dict = field(default_factory=dict)
    from_cache_only: bool = False  # the registry was unreachable; served from the cache

    @property
    def offline_accuracy(self) -> float | None:
        try:
            return float(self.tags["accuracy"])
        except (KeyError, TypeError, ValueError):
            return None


def parse_uri(uri: str) -> ModelRef:
    m = _MODELS_URI.match(uri.strip())
    if m:
        return ModelRef(uri=uri, name=m["name"], alias=m["alias"], version=m["version"])
    p = Path(uri).expanduser()
    if p.is_dir():
        return ModelRef(uri=uri, path=p.resolve())
    raise ModelResolveError(
        f"{uri!r} is neither models:/<name>@<alias>, models:/<name>/<version> nor a model package directory"
    )


def cache_root() -> Path:
    return lengthwise_home() / "cache" / "models"


def is_package(d: Path) -> bool:
    return all((d / f).is_file() for f in PACKAGE_FILES)


def _write_json_atomic(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def cached_version(name: str, version: str) -> ResolvedModel | None:
    d = cache_root() / name / str(version)
    if not is_package(d):
        return None
    info = _read_json(d / REGISTRY_FILE)
    return ResolvedModel(d, name, str(version), f"models:/{name}/{version}", info.get("tags", {}))


def cached_alias(name: str, alias: str) -> str | None:
    return _read_json(cache_root() / name / ALIASES_FILE).get(alias)


def remember_alias(name: str, alias: str, version: str) -> None:
    path = cache_root() / name / ALIASES_FILE
    aliases = _read_json(path)
    if aliases.get(alias) != str(version):
        aliases[alias] = str(version)
        _write_json_atomic(path, aliases)


def _package_in(model_dir: Path) -> Path:
    """The ``package`` artifact inside a downloaded MLflow pyfunc model directory."""
    from mlflow.models import Model

    try:
        rel = Model.load(str(model_dir)).flavors["python_function"]["artifacts"]["package"]["path"]
        if is_package(model_dir / rel):
            return model_dir / rel
    except Exception as exc:  # noqa: BLE001 - an unexpected MLmodel layout: fall back to searching the files
        log.debug("no package path in %s/MLmodel (%s); searching the files", model_dir, exc)
    for meta in model_dir.rglob(META_FILE):  # older layouts: any directory that holds a whole package
        if is_package(meta.parent):
            return meta.parent
    raise ModelResolveError(f"the registered model at {model_dir} holds no ONNX package (model.onnx, tokenizer.json, meta.json)")


def download_version(name: str, version: str) -> ResolvedModel:
    """Copy version ``version`` of ``name`` into the cache (once) and return it; registry errors propagate."""
    import mlflow
    from mlflow import MlflowClient

    mv = MlflowClient().get_model_version(name, str(version))
    tags = dict(mv.tags or {})
    hit = cached_version(name, version)
    # the same name and version from another registry (a different tracking URI) is another model
    stale = hit is not None and _read_json(hit.path / REGISTRY_FILE).get("run_id") not in (None, mv.run_id)
    if hit is not None and not stale:
        return ResolvedModel(hit.path, name, str(version), hit.uri, tags)
    root = cache_root() / name
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".download-") as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=tmp))
        staged = Path(tmp) / "package"
        shutil.move(str(_package_in(local)), staged)
        _write_json_atomic(staged / REGISTRY_FILE, {"name": name, "version": str(version), "run_id": mv.run_id,
                                                    "source": mv.source, "tags": tags})
        target = root / str(version)
        if stale:  # move the old copy aside; a process still reading it keeps its open files
            os.replace(target, Path(tmp) / "stale")
        try:
            os.replace(staged, target)  # atomic: a reader sees no package or a whole one
        except OSError:
            if not is_package(target):  # another process won the race with a whole copy: keep theirs
                raise
    log.info("cached %s version %s under %s", name, version, target)
    return ResolvedModel(target, name, str(version), f"models:/{name}/{version}", tags)


def prune(name: str, keep: int, protect: tuple[str, ...] = ()) -> list[str]:
    """Delete the cached versions of ``name`` older than its ``keep`` newest, except any version an alias last pointed
    at (the registry-down fallback serves those) and ``protect`` (what this process serves). Every new version a
    retraining loop promotes is another full package (about 110 MB with its fast tier): without this the cache only
    grows. A version is moved aside before it is deleted, so a reader sees a whole package or none. Returns the
    versions deleted."""
    root = cache_root() / name
    if not root.is_dir():
        return []
    guarded = set(protect) | {str(v) for v in _read_json(root / ALIASES_FILE).values()}
    versions = sorted((d.name for d in root.iterdir() if not d.name.startswith(".") and is_package(d)),
                      key=lambda v: (v.isdigit(), int(v) if v.isdigit() else 0, v), reverse=True)
    removed = []
    for v in versions[keep:]:
        if v in guarded:
            continue
        aside = root / f".pruned-{v}-{os.getpid()}"
        try:
            os.replace(root / v, aside)
        except OSError:  # another process pruned it first
            continue
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(v)
    if removed:
        log.info("cache: removed %s version(s) %s (keeping the %d newest and what aliases point at)", name,
                 ", ".join(removed), keep)
    return removed


def _is_not_found(exc: BaseException) -> bool:
    code = getattr(exc, "error_code", "")
    return code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND")


def registry_version(ref: ModelRef) -> str:
    """The version an alias points at now (asks the registry; raises when it cannot)."""
    from mlflow import MlflowClient

    if ref.alias is None:
        return str(ref.version)
    return str(MlflowClient().get_model_version_by_alias(ref.name, ref.alias).version)


def resolve(uri: str | ModelRef) -> ResolvedModel:
    """A local package for ``uri``: from the registry (caching it), else from the cache when the registry is down."""
    ref = parse_uri(uri) if isinstance(uri, str) else uri
    if ref.path is not None:
        if not is_package(ref.path):
            raise ModelResolveError(f"{ref.path} is not a model package (needs {', '.join(PACKAGE_FILES)})")
        info = _read_json(ref.path / REGISTRY_FILE)
        return ResolvedModel(ref.path, info.get("name", ref.path.name), str(info.get("version", "local")), ref.uri,
                             info.get("tags", {}))
    from mlflow.exceptions import MlflowException

    try:
        configure()
        version = registry_version(ref)
        resolved = download_version(ref.name, version)
    except MlflowException as exc:
        if _is_not_found(exc):
            raise ModelResolveError(f"{ref.uri} is not in the registry at {_where()}: {_first_line(exc)}") from None
        return _from_cache(ref, exc)
    except ModelResolveError:
        raise
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS, timeouts: the registry is down, not the request wrong
        return _from_cache(ref, exc)
    if ref.alias is not None:
        remember_alias(ref.name, ref.alias, resolved.version)
    return resolved


def _from_cache(ref: ModelRef, exc: BaseException) -> ResolvedModel:
    version = cached_alias(ref.name, ref.alias) if ref.alias else ref.version
    hit = cached_version(ref.name, version) if version else None
    if hit is None:
        raise ModelResolveError(
            f"cannot reach the registry at {_where()} ({_first_line(exc)}) and no cached copy of {ref.uri} "
            f"under {cache_root()}"
        ) from None
    log.warning("registry at %s unreachable (%s); serving cached %s version %s", _where(), _first_line(exc), ref.name, version)
    return ResolvedModel(hit.path, hit.name, hit.version, hit.uri, hit.tags, from_cache_only=True)


def _where() -> str:
    return tracking_uri()


_NETWORK_REASONS = (("Connection refused", "connection refused"), ("timed out", "timed out"),
                    ("Name or service not known", "unknown host"), ("No route to host", "no route to host"),
                    ("Temporary failure in name resolution", "unknown host"))


def _first_line(exc: BaseException) -> str:
    """A short reason: the network failure in a few words, else the first line of the message."""
    text = str(getattr(exc, "message", None) or exc or type(exc).__name__)
    for needle, reason in _NETWORK_REASONS:
        if needle in text:
            return reason
    first = " ".join(text.strip().splitlines()[0].split()) if text.strip() else type(exc).__name__
    return first[:200]
