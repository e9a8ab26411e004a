"""A model package's ``meta.json``, read into one typed record.

A package (``model.onnx``, ``tokenizer.json``, ``meta.json``) is written by training (training/export.py, then the
steps that add to it: slice routes and the fast tier, the fused graph) and read by the runtime, the registry and the
benchmarks. Reading it in one place gives every reader the same field names and types, instead of each one indexing
a dict and guessing what an absent key means.

Unknown keys are kept, not refused: an older package lacks keys a newer one has, and a newer one may carry keys this
code does not read yet. Three fields are left loose on purpose, because the module that uses them checks them with a
message that names what is wrong: ``target`` (:mod:`predictor.target`; a malformed one counts as unknown rather than
refusing the package), ``routes`` and ``fast_tier`` (:mod:`predictor.slices`).

Writes go through :func:`update_meta`, which keeps every key of the file as it is, known here or not.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator

from predictor.buckets import BucketScheme
from predictor.conditioning import META_KEY as CONDITIONED_KEY
from predictor.partial import META_KEY as REMAINING_KEY
from predictor.prompt import InputFormat
from predictor.slices import FAST_TIER_KEY, ROUTES_KEY

META_FILE = "meta.json"


class PackageMeta(BaseModel):
    """What a package says about itself; every field but the bucket scheme and the input format may be absent."""

    model_config = ConfigDict(extra="allow", frozen=True, arbitrary_types_allowed=True)

    buckets: Annotated[BucketScheme, PlainValidator(BucketScheme.from_dict)]
    input_format: Annotated[InputFormat, PlainValidator(InputFormat.from_dict)]
    target: Any = None  # checked where used (predictor.target.check_target); None: made before targets were recorded
    variant: str | None = None  # "fused" when the package ships the fused graph (predictor.runtime.add_fused_variant)
    fused: dict[str, Any] | None = None  # what was fused and its parity with model.onnx
    student: dict[str, Any] | None = None  # a distilled student's record (its "layers", ...); None: not distilled
    stages: list[dict[str, Any]] | None = None  # what each training stage learnt from, in order
    routes: Any = Field(None, alias=ROUTES_KEY)  # {slice: route}, checked by predictor.slices.load_routes
    fast_tier: Any = Field(None, alias=FAST_TIER_KEY)  # {"predictor", "files": {slice: file}}: slices.load_fast_tier
    conditioned_models: list[str] | None = Field(None, alias=CONDITIONED_KEY)  # served models it was trained on
    remaining_length: bool | None = Field(None, alias=REMAINING_KEY)  # trained on answers so far (predictor.partial)
    backbone: str | None = None
    trained_on: str | None = None  # the data file it was trained on
    data_format: str | None = Field(None, alias="format")  # that file's format (sharegpt, alpaca-eval, ...)
    generator: str | None = None  # whose answers the dataset's lengths are, when the file holds several
    eval_split: str | None = None  # the test split's fingerprint


def read_meta(package_dir: str | Path) -> PackageMeta:
    """The package's ``meta.json``. OSError when it is missing; ValueError (pydantic's ValidationError) when it is
    not JSON or lacks the bucket scheme or the input format."""
    return PackageMeta.model_validate_json((Path(package_dir) / META_FILE).read_bytes())


def update_meta(package_dir: str | Path, values: Mapping[str, Any]) -> None:
    """Set ``values`` in the package's ``meta.json``, keeping every other key as it is (those :class:`PackageMeta` does
    not know too: the file, not the record, is what the next reader sees)."""
    path = Path(package_dir) / META_FILE
    meta = json.loads(path.read_text())
    meta.update(values)
    path.write_text(json.dumps(meta, indent=2, default=float))
