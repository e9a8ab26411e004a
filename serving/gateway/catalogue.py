"""The models one gateway serves (``lengthwise serve --models FILE``): each served name, where its engines are, and
its SLO.

A fleet rarely serves one model: several bases, and often many LoRA fine-tunes of one base that vLLM serves from the
base's engines in one batch and one KV pool. The catalogue is the operator's list of them. Each entry is a **base**,
whose engines are attached by URL (``engine_urls``) or started by ``serve`` from a model directory (``model``), or an
**adapter** (``adapter_of``: the base entry whose engines load it with ``--lora-modules``). A request names one of
them in ``model``; the gateway places it only on the engines that serve that name, and deadlines it by that entry's
SLO. An entry also says where its predicted lengths come from (``predictor``: a sidecar, a registry URI a sidecar must
serve, SeaLLM's profile of its own answers, or none; :mod:`serving.gateway.model_predictors`) and its priority class
inside an engine (``priority``, lower first). The single-model flags (``--model``/``--engine-url``) stay the
shorthand for a one-entry catalogue.

The file is YAML (``.yaml``/``.yml``) or TOML (``.toml``), read into :class:`Catalogue`; a mistake is one line that
names the file, the entry and the key (:class:`CatalogueError`).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from serving.argtypes import http_url

PREDICTOR_KINDS = ("sidecar", "profile", "none")
REGISTRY_URI = re.compile(r"^models:/[^/@\s]+(@[^/@\s]+|/[^/@\s]+)$")  # as the sidecar's --model takes them


class CatalogueError(ValueError):
    """The catalogue file cannot be used; the message names the file, the entry and the key."""


class ModelSlo(BaseModel):
    """A model's default SLO terms, used where a request states none (``x-slo-*`` headers still win): the deadline is
    arrival + ``ttft_ms`` + ``tpot_ms`` x predicted length. A term left out is the gateway's (``--slo-scale`` x
    ``--t-p``/``--t-g``): models of different sizes decode at different speeds, so each has its own."""

    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0, description="time to first token, milliseconds")
    tpot_ms: float | None = Field(None, gt=0, description="time per output token, milliseconds")

    def terms(self) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) in seconds, None where not set."""
        return (None if self.ttft_ms is None else self.ttft_ms / 1000,
                None if self.tpot_ms is None else self.tpot_ms / 1000)


class ServedModel(BaseModel):
    """One served name."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="what clients send as 'model' and /v1/models lists")
    engine_urls: list[str] = Field(default_factory=list, description="attach to these running vLLM servers, which "
                                   "serve this name (vllm serve --served-model-name NAME)")
    model: str | None = Field(None, description="start engines here from this model directory or name, served as NAME")
    engines: int = Field(1, ge=1, le=64, description="engines to start from model")
    engine_args: list[str] = Field(default_factory=list, description="more arguments for this model's engines started "
                                   "here, after --engine-arg's")
    adapter_of: str | None = Field(None, description="a LoRA adapter: the base entry whose engines serve it")
    adapter: str | None = Field(None, description="with adapter_of and a started base: the adapter's directory (peft's "
                                "adapter_config.json and weights)")
    slo: ModelSlo = Field(default_factory=ModelSlo)
    predictor: str = Field("sidecar", description="where this name's predicted lengths come from: 'sidecar' (the "
                           "sidecar asked with this name: a predictor for this model, or one conditioned on several), "
                           "a registry URI 'models:/NAME@ALIAS' or 'models:/NAME/VERSION' (the sidecar must serve "
                           "exactly that, checked at start), 'profile' (SeaLLM's service profile: the mean of this "
                           "name's own finished answers, learnt by the gateway, no sidecar) or 'none' (the fallback "
                           "length)")
    predictor_url: str | None = Field(None, description="this name's own sidecar (default: --predictor-url)")
    priority: int = Field(0, ge=-1000, le=1000, description="inside an engine, a request of a lower priority runs before "
                          "any of a higher one (vLLM's convention); the policy orders requests of one priority")
    on_engines: list[int] | None = Field(None, min_length=1, description="which of its base's engines started here serve "
                                         "this name, by index from 0 (default: all): a placement plan laid on the "
                                         "engines (an adapter is loaded only there; a base's own name is placed only "
                                         "there)")

    @field_validator("on_engines")
    @classmethod
    def _indices(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(set(v)) != len(v) or min(v) < 0):
            raise ValueError("give each engine index once, counting from 0")
        return None if v is None else sorted(v)

    @field_validator("engine_urls")
    @classmethod
    def _http(cls, v: list[str]) -> list[str]:
        return [http_url(u) for u in v]

    @field_validator("predictor_url")
    @classmethod
    def _http_one(cls, v: str | None) -> str | None:
        return None if v is None else http_url(v)

    @field_validator("predictor")
    @classmethod
    def _predictor(cls, v: str) -> str:
        if v in PREDICTOR_KINDS or REGISTRY_URI.match(v):
            return v
        raise ValueError(f"{v!r} is none of {', '.join(map(repr, PREDICTOR_KINDS))} or a registry URI "
                         "'models:/NAME@ALIAS' / 'models:/NAME/VERSION'")

    @property
    def predictor_kind(self) -> str:
        """``sidecar`` (a registry URI too: it is a sidecar's), ``profile`` or ``none``."""
        return "sidecar" if REGISTRY_URI.match(self.predictor) else self.predictor

    @property
    def predictor_uri(self) -> str | None:
        """The registry URI the sidecar must serve, where the entry names one."""
        return self.predictor if REGISTRY_URI.match(self.predictor) else None

    @model_validator(mode="after")
    def _kind(self) -> ServedModel:
        if self.adapter_of is not None:
            if self.engine_urls or self.model:
                raise ValueError("an adapter (adapter_of) runs on its base's engines: give it no engine_urls or model")
            return self
        if self.adapter is not None:
            raise ValueError("adapter needs adapter_of, the base entry that serves it")
        if bool(self.engine_urls) == bool(self.model):
            raise ValueError("give engine_urls (attach to running engines) or model (start them here), one of the two")
        return self

    @model_validator(mode="after")
    def _its_sidecar(self) -> ServedModel:
        if self.predictor_url is not None and self.predictor_kind != "sidecar":
            raise ValueError(f"predictor_url is a sidecar's, and predictor {self.predictor!r} asks none: drop it or "
                             "set predictor to 'sidecar' or a registry URI")
        return self

    @property
    def is_adapter(self) -> bool:
        return self.adapter_of is not None

    @property
    def starts_engines(self) -> bool:
        return self.model is not None


class Catalogue(BaseModel):
    """Every served name; bases before or after their adapters, in any order."""

    model_config = ConfigDict(extra="forbid")

    models: list[ServedModel] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> Catalogue:
        names = [m.name for m in self.models]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"the name {dup[0]!r} is given twice; each served name once")
        bases = {m.name: m for m in self.models if not m.is_adapter}
        urls: dict[str, str] = {}
        for m in self.models:
            if m.is_adapter:
                base = bases.get(m.adapter_of or "")
                if base is None:
                    raise ValueError(f"{m.name!r}: adapter_of {m.adapter_of!r} is not a base entry of this file "
                                     f"(bases: {', '.join(sorted(bases)) or 'none'})")
                if base.starts_engines and m.adapter is None:
                    raise ValueError(f"{m.name!r}: its base {base.name!r} is started here, so give the adapter's "
                                     "directory (adapter)")
            base = bases.get(m.adapter_of or m.name)
            if m.on_engines is not None and base is not None:
                if not base.starts_engines:
                    raise ValueError(f"{m.name!r}: on_engines lays names on the engines started here, and "
                                     f"{base.name!r} attaches engine_urls (each serves what it was started with)")
                if max(m.on_engines) >= base.engines:
                    raise ValueError(f"{m.name!r}: on_engines {m.on_engines} names an engine past the "
                                     f"{base.engines} of {base.name!r} (indices 0 to {base.engines - 1})")
            for url in m.engine_urls:
                if url in urls:
                    raise ValueError(f"{url} is listed by {urls[url]!r} and {m.name!r}: an engine serves one base (its "
                                     "adapters are entries with adapter_of)")
                urls[url] = m.name
        for base in bases.values():
            idle = [i for i, names in enumerate(self.engine_names(base.name)) if not names]
            if idle:
                raise ValueError(f"{base.name!r}: its engine {idle[0]} would serve no name (neither its on_engines nor "
                                 "any adapter's): start fewer engines or lay a name on it")
        return self

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.models]

    def entry(self, name: str) -> ServedModel | None:
        return next((m for m in self.models if m.name == name), None)

    def adapters_of(self, base: str) -> list[ServedModel]:
        return [m for m in self.models if m.adapter_of == base]

    def base_of(self, name: str) -> str:
        """The entry whose engines serve ``name`` (itself for a base)."""
        m = self.entry(name)
        return name if m is None or m.adapter_of is None else m.adapter_of

    def adapters_on(self, base: str, engine: int) -> list[ServedModel]:
        """The adapters loaded on ``base``'s engine number ``engine`` (each adapter's ``on_engines``, default all)."""
        return [a for a in self.adapters_of(base) if a.on_engines is None or engine in a.on_engines]

    def engine_names(self, base: str) -> list[list[str]]:
        """For each of ``base``'s engines (started here; one list for attached engines), the names placed on it: the
        base's own where its ``on_engines`` allows, then the adapters loaded there."""
        m = self.entry(base)
        assert m is not None and not m.is_adapter
        count = m.engines if m.starts_engines else 1
        return [[*([m.name] if m.on_engines is None or i in m.on_engines else []),
                 *(a.name for a in self.adapters_on(base, i))] for i in range(count)]

    def engine_runs(self, base: str) -> list[tuple[int, list[ServedModel]]]:
        """``base``'s started engines as runs of consecutive engines that load the same adapters: (how many, those
        adapters). One run unless an adapter's ``on_engines`` lays it on some engines only."""
        m = self.entry(base)
        assert m is not None and m.starts_engines
        runs: list[tuple[int, list[ServedModel]]] = []
        for i in range(m.engines):
            loaded = self.adapters_on(base, i)
            if runs and [a.name for a in runs[-1][1]] == [a.name for a in loaded]:
                runs[-1] = (runs[-1][0] + 1, loaded)
            else:
                runs.append((1, loaded))
        return runs

    def attached_urls(self) -> list[str]:
        return [u for m in self.models for u in m.engine_urls]

    def lora_args(self, base: str, adapters: list[ServedModel] | None = None) -> list[str]:
        """The vLLM arguments that make a started base's engines serve ``adapters`` (default: all of the base's), all in
        one batch: ``--enable-lora --lora-modules NAME=DIR ... --max-loras N --max-lora-rank R`` (R: the largest rank
        among them, from each adapter's ``adapter_config.json``); none without adapters."""
        adapters = self.adapters_of(base) if adapters is None else adapters
        if not adapters:
            return []
        ranks = [adapter_rank(Path(a.adapter or "")) for a in adapters]
        return ["--enable-lora", "--lora-modules", *(f"{a.name}={a.adapter}" for a in adapters),
                "--max-loras", str(len(adapters)), "--max-lora-rank", str(_vllm_rank(max(ranks)))]


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM's --max-lora-rank accepts


def _vllm_rank(rank: int) -> int:
    return next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])


def adapter_rank(directory: Path) -> int:
    """The LoRA rank ``r`` a peft adapter directory was trained with (CatalogueError when it is not one)."""
    try:
        return int(json.loads((directory / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CatalogueError(f"{directory} is not a LoRA adapter directory (no readable adapter_config.json with 'r': "
                             f"{exc})") from None


def read_catalogue(path: Path) -> Catalogue:
    """The catalogue in ``path`` (YAML or TOML), checked: every adapter directory is read too, so a wrong path is said
    now and not after the engines' start-up."""
    raw = _parse(path)
    try:
        catalogue = Catalogue.model_validate(raw)
    except ValidationError as exc:
        raise CatalogueError(f"{path}: {_where(exc, raw)}") from None
    for m in catalogue.models:
        if m.adapter is not None:
            try:
                adapter_rank(Path(m.adapter))
            except CatalogueError as exc:
                raise CatalogueError(f"{path}: entry {m.name!r}, key 'adapter': {exc}") from None
    return catalogue


def _parse(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix not in {".yaml", ".yml", ".toml"}:
        raise CatalogueError(f"{path}: a catalogue is a .yaml, .yml or .toml file")
    try:
        text = path.read_text()
    except OSError as exc:
        raise CatalogueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    import yaml

    try:
        raw = tomllib.loads(text) if suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        kind = "TOML" if suffix == ".toml" else "YAML"
        raise CatalogueError(f"{path}: not valid {kind}: {' '.join(str(exc).split())}") from None
    return {"models": raw} if isinstance(raw, list) else raw  # a bare list of entries is a catalogue too


def _where(exc: ValidationError, raw: Any) -> str:
    """The first error as ``entry 'NAME' (models[i]), key 'a.b': message``."""
    err = exc.errors()[0]
    loc = list(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
        i = loc[1]
        entries = raw.get("models") if isinstance(raw, dict) else None
        name = entries[i].get("name") if isinstance(entries, list) and isinstance(entries[i], dict) else None
        who = f"entry {name!r} (models[{i}])" if isinstance(name, str) else f"models[{i}]"
        key = ".".join(map(str, loc[2:]))
        return f"{who}, key {key!r}: {msg}" if key else f"{who}: {msg}"
    if loc:
        return f"key {'.'.join(map(str, loc))!r}: {msg}"
    return msg
