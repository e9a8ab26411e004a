"""The data tables of README.md (short) and docs/data.md (full), rendered from the manifest, so that neither can
disagree with what ``lengthwise data fetch`` gets (tests/test_data_fetch.py checks both)."""

from __future__ import annotations

from predictor.datafiles.manifest import DataFile, Source

GITHUB = "https://github.com"


def _where(src: Source) -> str:
    if src.kind == "pypi":
        where = f"PyPI `{src.requirement}`, `{src.member}`"
    elif len(src.paths) == 1:
        where = f"GitHub [{src.repo}@{src.commit[:7]}]({GITHUB}/{src.repo}/blob/{src.commit}/{src.paths[0]}) `{src.paths[0]}`"
    else:
        where = f"GitHub [{src.repo}@{src.commit[:7]}]({GITHUB}/{src.repo}/tree/{src.commit}), {len(src.paths)} files"
    note = src.transform.get("note")
    return where + (f" ({note})" if note else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def short_table(files: list[DataFile]) -> str:
    """README.md's table: path | needed by | from (each source's one-word form, in the order fetched)."""
    rows = ["| file under the data directory | needed by | from |", "|---|---|---|"]
    for f in files:
        src = " or ".join(f"PyPI `{s.requirement}`" if s.kind == "pypi" else f"GitHub `{s.repo}`" for s in f.sources)
        rows.append(f"| `{f.path}` | {', '.join(f.groups)} | {src} |")
    return "\n".join(rows) + "\n"


def table(files: list[DataFile]) -> str:
    """The Markdown table: path | what | where it comes from (sources in the order fetched) | licence."""
    rows = ["| path | what | where it comes from | licence |", "|---|---|---|---|"]
    for f in files:
        rows.append(f"| `{f.path}` | {_cell(f.what)} | {_cell('; or '.join(_where(s) for s in f.sources))} | "
                    f"{_cell(f.licence)} |")
    return "\n".join(rows) + "\n"
