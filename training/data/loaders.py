"""Loaders for ShareGPT, AlpacaEval model outputs, JSONL/CSV tables and Hugging Face datasets."""

from __future__ import annotations

import json
import lzma
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pandas as pd

from monitoring.online import CUT  # finish reasons of an answer that was cut: its length is a lower bound
from training.data.example import DataError, Example, Turn

FORMATS = ("sharegpt", "alpaca-eval", "jsonl", "csv", "hf")

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
_PART_SUFFIX = re.compile(r"_\d+$")


def _open_text(path: Path):
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, "rt", encoding="utf-8")


def _check_file(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file not found: {p}")
    if p.is_dir():
        raise DataError(f"expected a data file, got a directory: {p}")
    return p


def sharegpt_examples(records: Iterable[dict], first_turn_only: bool = False) -> list[Example]:
    """One example per human turn directly answered by a gpt turn.

    The prompt is the conversation so far (earlier turns plus the human turn); long conversations
    split upstream into ``<id>_0``, ``<id>_1`` share the group ``<id>`` so no split leaks.
    """
    out: list[Example] = []
    for rec in records:
        conv = rec.get("conversations") or rec.get("messages")
        if not isinstance(conv, list):
            continue
        group = _PART_SUFFIX.sub("", str(rec.get("id", len(out))))
        turns: list[Turn] = []
        for i, msg in enumerate(conv):
            role = _SHAREGPT_ROLES.get(str(msg.get("from", msg.get("role", ""))).lower())
            text = msg.get("value", msg.get("content"))
            if role is None or not isinstance(text, str):
                continue
            if role == "assistant" and turns and turns[-1].role == "user" and turns[-1].text.strip() and text.strip():
                out.append(Example(group=group, turns=tuple(turns), response=text))
                if first_turn_only:
                    break
            turns.append(Turn(role, text))
    return out


def load_sharegpt(path: str | Path, first_turn_only: bool = False) -> list[Example]:
    p = _check_file(path)
    try:
        with _open_text(p) as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError, lzma.LZMAError) as exc:
        raise DataError(f"{p} is not a ShareGPT JSON file ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, list) or (data and not isinstance(data[0], dict)):
        raise DataError(f"{p} is not a ShareGPT file: expected a JSON list of conversations")
    return sharegpt_examples(data, first_turn_only)


def _read_jsonl(p: Path) -> list[dict]:
    rows = []
    with _open_text(p) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise DataError(f"{p}:{n} is not valid JSON (expected one JSON object per line)") from None
    return rows


def alpaca_eval_generators(path: str | Path) -> list[str]:
    return sorted({r["generator"] for r in _read_jsonl(_check_file(path)) if "generator" in r})


def load_alpaca_eval(path: str | Path, generator: str | None) -> list[Example]:
    """AlpacaEval outputs of one generator (the target model); group = instruction id."""
    if generator is None:
        gens = sorted(alpaca_eval_by_generator(path))
        raise DataError(f"--generator is required for alpaca-eval; available: {', '.join(gens[:8])}, ... ({len(gens)} in all)")
    return alpaca_eval_by_generator(path, [generator])[generator]


def alpaca_eval_by_generator(path: str | Path, generators: Sequence[str] | None = None) -> dict[str, list[Example]]:
    """The AlpacaEval outputs of ``generators`` (None: every one, in the file's order), read once: ``{generator:
    examples}``, each group the instruction's id, so one instruction answered by several models falls in one split."""
    p = _check_file(path)
    try:
        rows = _read_jsonl(p)
    except UnicodeDecodeError:
        raise DataError(f"{p} is not UTF-8 text") from None
    if rows and not {"instruction", "output", "generator"} <= set(rows[0]):
        raise DataError(f"{p} is not AlpacaEval model outputs: rows need instruction, output and generator")
    gens = sorted({r["generator"] for r in rows})
    for generator in generators or ():
        if generator not in gens:
            raise DataError(f"generator {generator!r} not in {p.name}; available: {', '.join(gens[:8])}, ... "
                            f"({len(gens)} in all)")
    out: dict[str, list[Example]] = {g: [] for g in (generators or dict.fromkeys(r["generator"] for r in rows))}
    for r in rows:
        if r["generator"] in out and isinstance(r.get("output"), str) and r["instruction"].strip():
            out[r["generator"]].append(Example(group=f"alpaca-{r.get('instruction_id', r['instruction'])}",
                                               turns=(Turn("user", r["instruction"]),), response=r["output"]))
    return out


def _row_turns(row: dict) -> tuple[Turn, ...] | None:
    """A table row's prompt: its ``messages`` (chat turns, e.g. what ``lengthwise relabel`` writes) or its ``prompt``
    as one user turn; None if the latest turn is no non-empty user turn. A row with ``generated_tokens`` above 0 is a
    remaining-length example (:mod:`predictor.partial`): its messages end with the answer so far, after a user turn."""
    msgs = row.get("messages")
    if isinstance(msgs, list):
        turns = tuple(Turn(_SHAREGPT_ROLES[str(m.get("role")).lower()], m["content"]) for m in msgs
                      if isinstance(m, dict) and str(m.get("role")).lower() in _SHAREGPT_ROLES
                      and isinstance(m.get("content"), str))
    else:
        prompt = row.get("prompt")
        turns = (Turn("user", prompt),) if isinstance(prompt, str) else ()
    if turns and _generated(row) > 0 and turns[-1].role == "assistant" and len(turns) >= 2:
        return turns if turns[-2].role == "user" and turns[-2].text.strip() else None
    return turns if turns and turns[-1].role == "user" and turns[-1].text.strip() else None


def _generated(row: dict) -> int:
    n = row.get("generated_tokens")
    return int(n) if isinstance(n, (int, float)) and not pd.isna(n) else 0


def table_examples(df: pd.DataFrame, source: str) -> list[Example]:
    """Rows with ``prompt`` (or ``messages``: a list of ``{"role", "content"}``) and ``response`` or ``response_tokens``;
    optional ``conversation_id``/``id``/``group``, and ``censored`` (true: the answer was cut, its length is a lower
    bound) or ``finish_reason`` (``length``, ``abort``, ... mean the same, as the engine reports them); ``model``, the
    served model that answered, where the rows mix several (``train-predictor --condition-on-model``)."""
    cols = set(df.columns)
    if not ({"prompt", "messages"} & cols) or not ({"response", "response_tokens"} & cols):
        raise DataError(
            f"{source} needs a 'prompt' column (or 'messages', the chat turns) and a 'response' or 'response_tokens' "
            f"column; found {sorted(cols)}"
        )
    id_col = next((c for c in ("conversation_id", "id", "group") if c in cols), None)
    out = []
    for i, row in enumerate(df.to_dict("records")):
        turns = _row_turns(row)
        if turns is None:
            continue
        group = str(row[id_col]) if id_col else f"row-{i}"
        resp = row.get("response")
        ntok = row.get("response_tokens")
        cut = _censored(row)
        model = row.get("model")
        model = str(model) if isinstance(model, str) and model.strip() else None
        if isinstance(resp, str):
            out.append(Example(group, turns, response=resp, censored=cut, model=model))
        elif ntok is not None and not pd.isna(ntok) and int(ntok) >= 0:
            out.append(Example(group, turns, response_tokens=int(ntok), censored=cut, model=model))
    return out


def _censored(row: dict) -> bool:
    """A row's label is a lower bound when it says ``censored`` or its ``finish_reason`` is a cut, not a stop."""
    flag = row.get("censored")
    if isinstance(flag, (bool, int)) and not isinstance(flag, float):
        return bool(flag)
    reason = row.get("finish_reason")
    return isinstance(reason, str) and reason in CUT


def load_table(path: str | Path, fmt: str) -> list[Example]:
    p = _check_file(path)
    try:
        if fmt == "csv":
            df = pd.read_csv(p)
        else:
            df = pd.DataFrame(_read_jsonl(p))
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise DataError(f"{p} is not a readable {fmt.upper()} file ({type(exc).__name__})") from None
    return table_examples(df, str(p))


def load_hf(dataset_id: str, split: str = "train") -> list[Example]:
    """A Hugging Face dataset id (or local dataset dir): ShareGPT-style or prompt/response columns."""
    try:
        import datasets

        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many types for "not found/offline"
        raise DataError(f"could not load Hugging Face dataset {dataset_id!r}: {str(exc).splitlines()[0]}") from None
    if "conversations" in ds.column_names or "messages" in ds.column_names:
        return sharegpt_examples(ds)
    return table_examples(ds.to_pandas(), dataset_id)


_LOADERS: dict[str, Callable[..., list[Example]]] = {
    "sharegpt": lambda path, **kw: load_sharegpt(path, kw.get("first_turn_only", False)),
    "alpaca-eval": lambda path, **kw: load_alpaca_eval(path, kw.get("generator")),
    "jsonl": lambda path, **kw: load_table(path, "jsonl"),
    "csv": lambda path, **kw: load_table(path, "csv"),
    "hf": lambda path, **kw: load_hf(str(path), kw.get("split", "train")),
}


def load_examples(path: str | Path, fmt: str, **kwargs) -> list[Example]:
    """Load examples of format ``fmt``; raises :class:`DataError` with a one-line reason on bad input."""
    if fmt not in _LOADERS:
        raise DataError(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    examples = _LOADERS[fmt](path, **kwargs)
    if not examples:
        raise DataError(f"no usable (prompt, response) examples in {path} as --format {fmt}")
    return examples
