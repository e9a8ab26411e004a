"""Served-length files: the served model's own response lengths for a prompt set, as ``lengthwise relabel`` writes them.

A predictor for a served model should learn that model's lengths, not those of whoever answered the prompt set
(TetriInfer and ProD relabel their data this way). ``lengthwise relabel`` runs the prompts through the model and writes
one JSON line per (prompt, sample); this module is the file's other half, on the training side (which never imports
``serving``):

- :func:`prompt_hash` names a prompt by its turns alone, so the lengths can be joined back to the prompt set without the
  model: with the text (``messages`` column) a file is a ``--format jsonl`` dataset by itself; without it
  (``relabel --no-text``, the lengths alone, small enough to commit) :func:`join_served_lengths` gives the prompt set's
  examples their served lengths (``train-predictor --served-lengths``).
- :func:`read_served` reads the lines back, tolerating a last line cut short by a killed run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import lzma
from collections.abc import Sequence
from pathlib import Path

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


def join_served_lengths(examples: Sequence[Example], path: str | Path) -> list[Example]:
    """The examples whose prompt has served lengths in ``path``, once per sample with that sample's length as the label
    (``response_tokens``; the group kept, so a prompt's samples never straddle a split). A prompt that appears twice in
    the set is labelled once, as relabel ran it once; prompts without a length are left out."""
    lengths: dict[str, list[int]] = {}
    for rec in sorted(read_served(path)[0], key=lambda r: (r["prompt_hash"], r["sample"])):
        lengths.setdefault(rec["prompt_hash"], []).append(int(rec["response_tokens"]))
    out, seen = [], set()
    for e in examples:
        h = prompt_hash(e.turns)
        if h in seen or h not in lengths:
            continue
        seen.add(h)
        out.extend(dataclasses.replace(e, response=None, response_tokens=n) for n in lengths[h])
    if not out:
        raise DataError(f"none of the {len(examples)} prompts has a served length in {path}: was it relabelled from "
                        "this prompt set (same --format, --first-turns-only)?")
    return out
