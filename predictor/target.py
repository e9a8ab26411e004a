"""Which model a length predictor predicts for: the target-model description a package and a registry version carry.

A predictor learns the response lengths of whoever wrote its labels. ShareGPT's answers are ChatGPT's; a predictor
trained on them predicts ChatGPT's lengths, not those of the model an engine serves, and a scheduler that orders
requests by another model's lengths orders them by noise. So every package records its *target*, and the gateway
compares it with the model it serves before it schedules by the predictor.

A target is a plain dict (JSON in ``meta.json``, tags in the registry), with these keys:

- ``model``: ``name@hash`` (:func:`model_id`) of the model whose responses were counted, or a bare name when its files
  were not at hand (e.g. ``"ChatGPT"`` for dataset answers), or None when nobody knows;
- ``label_tokenizer``: which tokenizer counted the labels (``"served model's own output tokens"`` for a relabel);
- ``sampling``: temperature, top_p and repetition_penalty of the labels, or None;
- ``max_tokens``: the labels' cap, or None;
- ``source``: where the labels came from, e.g. ``"relabel of sharegpt by the served model"``.

Nothing here imports another module of the project (only the standard library), so the training side, the registry,
the runtime and the gateway can all share one definition of a model's identity.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# The files that decide a length besides the weights.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# What a converter or a download writes into those files about itself, not about the model: where it read the model
# from (``_name_or_path``, another path on every machine and cache), its own version, a hub commit. Left out of the hash.
VOLATILE_KEYS = ("transformers_version", "name_or_path")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
WEIGHT_SAMPLES = 16       # evenly spaced reads per weights file ...
WEIGHT_SAMPLE_BYTES = 1 << 16  # ... of 64 KiB each: a fine-tune changes every tensor, and a 140 GB model reads in ms
TARGET_KEYS = ("model", "label_tokenizer", "sampling", "max_tokens", "source")
_ID = re.compile(r"^(?P<name>.+)@(?P<hash>[0-9a-f]{12})$")


def _canonical(f: Path) -> bytes:
    """A JSON file's content without what its writer says of itself (:data:`VOLATILE_KEYS`, keys starting with ``_``),
    keys sorted; any other file (or JSON that does not parse) as its bytes."""
    raw = f.read_bytes()
    if f.suffix != ".json":
        return raw
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw

    def clean(o: Any) -> Any:
        if isinstance(o, dict):
            return {k: clean(v) for k, v in o.items() if not (k.startswith("_") or k in VOLATILE_KEYS)}
        if isinstance(o, list):
            return [clean(v) for v in o]
        return o

    return json.dumps(clean(doc), sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _weights_fingerprint(model_dir: Path, h: Any) -> None:
    """Fold every weights file's size and :data:`WEIGHT_SAMPLES` evenly spaced slices of its bytes into ``h``: two
    conversions of one checkpoint write the same bytes, two fine-tunes of one base differ in every tensor."""
    files = sorted(f for f in model_dir.iterdir() if f.is_file() and f.suffix in WEIGHT_SUFFIXES)
    for f in files:
        size = f.stat().st_size
        h.update(f"weights:{size}".encode())
        with f.open("rb") as fh:
            for i in range(WEIGHT_SAMPLES):
                fh.seek(max(0, (size - WEIGHT_SAMPLE_BYTES) * i // max(WEIGHT_SAMPLES - 1, 1)))
                h.update(fh.read(WEIGHT_SAMPLE_BYTES))


def model_id(model_dir: Path, name: str, load_format: str = "auto") -> str:
    """``name@hash``: the hash covers what decides the model's answers and nothing about where its files came from: the
    config, generation config, tokenizer and chat template (JSON without its writer's bookkeeping, so two conversions
    of one GGUF, or one model in two caches, agree) and a sample of the weights' bytes (dummy weights under a real
    config are another model, whatever files lie beside it)."""
    h = hashlib.sha256()
    for f in MODEL_FILES:
        if (model_dir / f).is_file():
            h.update(f.encode() + b"\0" + _canonical(model_dir / f))
    if load_format != "auto":
        h.update(f"load_format={load_format}".encode())
    else:
        _weights_fingerprint(model_dir, h)
    return f"{name}@{h.hexdigest()[:12]}"


def adapter_id(base: str, adapter_dir: Path, name: str) -> str:
    """``name@hash`` of a LoRA adapter served on ``base`` (the base's identity, :func:`model_id`): the hash covers the
    base and the adapter's config and weights, so the same adapter on another base, or a retrained one, is another
    model. ``name`` is the adapter's served name (a catalogue entry, the adapter directory's name by default)."""
    h = hashlib.sha256(f"base:{base}".encode())
    if (adapter_dir / "adapter_config.json").is_file():
        h.update(b"adapter_config.json\0" + _canonical(adapter_dir / "adapter_config.json"))
    _weights_fingerprint(adapter_dir, h)
    return f"{name}@{h.hexdigest()[:12]}"


def served_model_id(model: str, load_format: str = "auto") -> str:
    """The identity of what an engine serves as ``--model``: ``name@hash`` for a local Hugging Face directory (named as
    ``lengthwise relabel`` names it: the directory's name); a GGUF file's name without its suffixes (its converted
    files are elsewhere, so no hash); anything else (a hub name) as given."""
    p = Path(model).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return model_id(p, p.name or p.resolve().name, load_format)
    if p.suffix == ".gguf":
        return p.name.split(".")[0]
    return model


def split_id(identity: str) -> tuple[str, str | None]:
    """``(name, hash)`` of ``name@hash``; ``(identity, None)`` for a bare name."""
    m = _ID.match(identity)
    return (m["name"], m["hash"]) if m else (identity, None)


def _base_name(name: str) -> str:
    """A name to compare: its last path part, case-folded (``HuggingFaceTB/SmolLM2-135M`` and ``smollm2-135m`` agree)."""
    return name.rstrip("/").rsplit("/", 1)[-1].casefold()


def compare_models(served: str, target: str) -> str:
    """``"same"`` (names and hashes agree), ``"same_name"`` (the names agree, and one side has no hash to compare) or
    ``"different"``. The hash alone never decides: two fine-tunes of one base share config, tokenizer and template."""
    (sn, sh), (tn, th) = split_id(served), split_id(target)
    if _base_name(sn) != _base_name(tn):
        return "different"
    if sh is None or th is None:
        return "same_name"
    return "same" if sh == th else "different"


def make_target(model: str | None, label_tokenizer: str, source: str, sampling: Mapping[str, float] | None = None,
                max_tokens: int | None = None) -> dict[str, Any]:
    """A checked target description (see the module docstring for the keys)."""
    return check_target({"model": model, "label_tokenizer": label_tokenizer, "sampling": sampling,
                         "max_tokens": max_tokens, "source": source})


def check_target(target: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``target`` as a plain dict with every key of :data:`TARGET_KEYS` (``sampling`` and ``max_tokens`` default to
    None), or None; ValueError with one readable line when a key is missing or of the wrong type. Further keys are kept:
    a newer writer may say more than this reader knows."""
    if target is None:
        return None
    if not isinstance(target, Mapping):
        # one exception type for every malformed target: readers (runtime, registry, export) catch ValueError
        raise ValueError(f"a target must be a dict with keys {', '.join(TARGET_KEYS)}, got {type(target).__name__}")  # noqa: TRY004
    out = {"sampling": None, "max_tokens": None, **target}
    missing = [k for k in TARGET_KEYS if k not in out]
    if missing:
        raise ValueError(f"the target lacks {', '.join(missing)} (keys: {', '.join(TARGET_KEYS)})")
    if out["model"] is not None and (not isinstance(out["model"], str) or not out["model"].strip()):
        raise ValueError(f"target model must be a name (name@hash) or None, got {out['model']!r}")
    for key in ("label_tokenizer", "source"):
        if not isinstance(out[key], str) or not out[key].strip():
            raise ValueError(f"target {key} must be a non-empty string, got {out[key]!r}")
    sampling = out["sampling"]
    if sampling is not None:
        if not isinstance(sampling, Mapping) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                         for v in sampling.values()):
            raise ValueError(f"target sampling must map settings to numbers (temperature, top_p, ...), got {sampling!r}")
        out["sampling"] = {str(k): float(v) for k, v in sampling.items()}
    cap = out["max_tokens"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ValueError(f"target max_tokens must be a positive integer or None, got {cap!r}")
    return out


def describe(target: Mapping[str, Any] | None) -> str:
    """One line for logs and tables: the model, then how its labels were made."""
    if not target:
        return "unknown (no target recorded)"
    parts = [str(target.get("source") or "")]
    if target.get("max_tokens"):
        parts.append(f"max_tokens {target['max_tokens']}")
    if target.get("label_tokenizer"):
        parts.append(f"counted by {target['label_tokenizer']}")
    details = ", ".join(p for p in parts if p)
    return f"{target.get('model') or 'unknown model'}" + (f" ({details})" if details else "")
