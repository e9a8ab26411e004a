"""A test's real data file, or a skip that says how to get it: ``need_data("tokenizers/gpt2/tokenizer.json")``.

Every test and fixture that reads a file of the data directory (predictor/datafiles/manifest.toml) reaches it through
:func:`need_data`, so that a machine without some files (a fresh clone where GitHub was unreachable) runs the rest and
skips those tests with one line each; conftest's terminal summary counts them. With shared/data present (CI), nothing
skips.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from predictor.common import data_dir

FETCH = "lengthwise data fetch --only tests"
_REASON = re.compile(r"missing data file (\S+)")


def need_data(rel: str) -> Path:
    """``data_dir() / rel``, or skip the test (or every test of a fixture that calls it) when that file is missing."""
    path = data_dir() / rel
    if not path.exists():
        pytest.skip(f"missing data file {rel} under {data_dir()} — run: {FETCH}")
    return path


def missing_in(reason: str) -> str | None:
    """The data file a skip's reason names, when :func:`need_data` skipped it."""
    m = _REASON.search(reason)
    return m[1] if m else None


def need_files(*rels: str) -> Path:
    """:func:`need_data` on each of ``rels``, then the data directory: for a test whose code under test finds its
    files by itself (a scenario's workload and tokenizer, MuxServe's trace)."""
    for rel in rels:
        need_data(rel)
    return data_dir()
