"""Served-length files: the served model's own response lengths for a prompt set, as ``lengthwise relabel`` writes them.

A predictor for a served model should learn that model's lengths, not those of whoever answered the prompt set
(TetriInfer and ProD relabel their data this way). ``lengthwise relabel`` runs the prompts through the model and writes
one JSON line per (prompt, sample); this module is the file's other half, on the training side (which never imports
``serving``):

- :func:`prompt_hash` names a prompt by its turns alone, so the lengths can be joined back to the prompt set without the
  model: with the text (``messages`` column) a file is a ``--format jsonl`` dataset by itself; without it
  (``relabel --no-text``, the lengths alone, small enough to commit) :func:`join_served_lengths` gives the prompt set's
  examples their served lengths (``train-predictor --served-lengths``).
- :func:`read_served` reads the lines back, tolerating a last line cut short by a killed run; :func:`load_served` keeps
  each prompt's sample lengths and the set-up that made them (the labels' target: model, sampling, cap).
- :func:`group_samples` gathers a prompt's K samples back into one example, for soft labels (``--label soft``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.data.example import DataError, Example, Turn


def prompt_hash(turns: Sequence[Turn]) -> str:
    """sha256 of the prompt's turns (role and text, in order): the same prompt has the same hash in any format, model
    or chat template, and nothing else changes it."""
    canon = json.dumps([[t.role, t.text] for t in turns], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def turn_index(turns: Sequence[Turn]) -> int:
    """How many user turns came before the prompt's latest one: 0 for a conversation's first turn."""
    return max(sum(t.role == "user" for t in turns) - 1, 0)


def read_served(path: str | Path) -> tuple[list[dict], int]:
    """The complete records of a served-length file and the byte length they take.

    A line without its newline is what a run killed while writing leaves: it is not returned, and a writer resuming
    the file truncates it to the returned length. Any other line that is not a JSON object with ``prompt_hash``,
    ``sample`` and ``response_tokens`` means the file is something else: :class:`DataError`.
    """
    p = Path(path)
    try:
        raw = lzma.decompress(p.read_bytes()) if p.suffix == ".xz" else p.read_bytes()  # .xz: a finished file, committed
    except OSError as exc:
        raise DataError(f"cannot read {p}: {exc.strerror or exc}") from None
    except lzma.LZMAError:
        raise DataError(f"{p} is not an xz file") from None
    end = raw.rfind(b"\n") + 1  # the torn tail, if any, starts here
    records = []
    for n, line in enumerate(raw[:end].split(b"\n")[:-1], 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DataError(f"{p}:{n} is not a JSON line: not a served-length file") from None
        if not isinstance(rec, dict) or not {"prompt_hash", "sample", "response_tokens"} <= set(rec):
            raise DataError(f"{p}:{n} lacks prompt_hash, sample or response_tokens: not a served-length file")
        records.append(rec)
    return records, end


@dataclass(frozen=True)
class ServedLabels:
    """What a served-length file says: each prompt's sample lengths, and how they were made (the labels' target)."""

    lengths: dict[str, list[int]]  # prompt hash -> response tokens of its samples, in sample order
    model: str | None              # the served model (``name@hash``) that wrote them
    sampling: dict | None          # its sampling settings (temperature, top_p, repetition_penalty)
    max_tokens: int | None         # the cap a sample ran to when censored
    censored: int                  # samples that ran to the cap: their true length is at least max_tokens
    cut: dict[str, list[bool]] = dataclasses.field(default_factory=dict)  # prompt hash -> each sample's censored flag
    engines: tuple[str, ...] = ()  # what drew them (``engine`` of each record; files before it were all vLLM's)

    def target(self) -> dict[str, Any]:
        """The labels' target (:mod:`predictor.target`): the served model's own output tokens, at its sampling and cap."""
        return {"model": self.model, "label_tokenizer": "served model's own output tokens", "sampling": self.sampling,
                "max_tokens": self.max_tokens, "source": "relabel by the served model"}


def load_served(path: str | Path) -> ServedLabels:
    """Read a served-length file into :class:`ServedLabels`; :class:`DataError` when its records name more than one
    model, sampling or cap (labels of two set-ups in one file would teach a mixture of both)."""
    records = sorted(read_served(path)[0], key=lambda r: (r["prompt_hash"], r["sample"]))
    lengths: dict[str, list[int]] = {}
    cut: dict[str, list[bool]] = {}
    for rec in records:
        lengths.setdefault(rec["prompt_hash"], []).append(int(rec["response_tokens"]))
        cut.setdefault(rec["prompt_hash"], []).append(bool(rec.get("censored")))
    setups = {json.dumps([r.get("model"), r.get("sampling"), r.get("max_tokens")], sort_keys=True) for r in records}
    if len(setups) > 1:
        raise DataError(f"{path} mixes labels of {len(setups)} set-ups (model, sampling, max_tokens): "
                        "relabel each into a file of its own")
    model, sampling, cap = json.loads(setups.pop()) if setups else (None, None, None)
    engines = tuple(sorted({str(r.get("engine", "vllm")) for r in records}))
    return ServedLabels(lengths, model, sampling, cap, sum(bool(r.get("censored")) for r in records), cut, engines)


def join_served_lengths(examples: Sequence[Example], served: str | Path | ServedLabels) -> list[Example]:
    """The examples whose prompt has served lengths in ``served`` (a file or what :func:`load_served` read), once per
    sample with that sample's length as the label (``response_tokens``; the group kept, so a prompt's samples never
    straddle a split). A prompt that appears twice in the set is labelled once, as relabel ran it once; prompts
    without a length are left out. A censored sample keeps the cap as its length and is marked ``censored``: its
    true length is at least that (training takes it as a lower bound, :func:`training.module.censored_cross_entropy`)."""
    labels = served if isinstance(served, ServedLabels) else load_served(served)
    lengths = labels.lengths
    out, seen = [], set()
    for e in examples:
        h = prompt_hash(e.turns)
        if h in seen or h not in lengths:
            continue
        seen.add(h)
        cut = labels.cut.get(h) or [False] * len(lengths[h])
        out.extend(dataclasses.replace(e, response=None, response_tokens=n, censored=c) for n, c in zip(lengths[h], cut))
    if not out:
        path = served if not isinstance(served, ServedLabels) else "the served-length file"
        raise DataError(f"none of the {len(examples)} prompts has a served length in {path}: was it relabelled from "
                        "this prompt set (same --format, --first-turns-only)?")
    return out


def group_samples(examples: Sequence[Example]) -> list[tuple[Example, list[tuple[int, bool]]]]:
    """Each distinct prompt once (first-seen order) with all its samples as ``(length, censored)``: what soft labels
    train on, one example per prompt whose target is the bucket histogram of its samples."""
    by_prompt: dict[tuple, tuple[Example, list[tuple[int, bool]]]] = {}
    for e in examples:
        key = (e.group, e.turns)
        if key not in by_prompt:
            by_prompt[key] = (e, [])
        by_prompt[key][1].append((int(e.response_tokens or 0), bool(e.censored)))
    return list(by_prompt.values())


def table_target(path: str | Path) -> dict[str, Any] | None:
    """The target of a ``--format jsonl`` dataset whose rows say which model wrote their lengths (``lengthwise relabel``
    with the text writes ``model``, ``sampling`` and ``max_tokens`` on every line): the served model's own output
    tokens, as from :func:`load_served`. None when a row names no model (then the lengths are the dataset's answers);
    :class:`DataError` when rows name different set-ups."""
    p = Path(path)
    setups = set()
    try:
        with (lzma.open(p, "rt", encoding="utf-8") if p.suffix == ".xz" else open(p, encoding="utf-8")) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if not isinstance(rec, dict) or not isinstance(rec.get("model"), str) or not rec["model"].strip():
                    return None
                setups.add(json.dumps([rec["model"], rec.get("sampling"), rec.get("max_tokens"), rec.get("source")],
                                      sort_keys=True))
    except (OSError, ValueError, lzma.LZMAError):
        return None  # the loader has already said what is wrong with the file, or will
    if len(setups) != 1:
        if setups:
            raise DataError(f"{p} mixes lengths of {len(setups)} set-ups (model, sampling, max_tokens): one per file, "
                            "or one predictor for several models with --condition-on-model")
        return None
    model, sampling, cap, source = json.loads(setups.pop())
    return {"model": model, "label_tokenizer": "served model's own output tokens", "sampling": sampling,
            "max_tokens": cap, "source": source or "relabel by the served model"}
