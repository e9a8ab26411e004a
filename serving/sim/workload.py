"""Serving workloads for the simulator: who arrives when, with how many prompt and output tokens.

One loader reads the public traces and prompt sets in ``$LENGTHWISE_DATA`` (what each file is: the data directory's own
README) and tells the format from the file's content, not its name, so a renamed or compressed copy still loads:

* ``azure`` — Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``), wall clock;
* ``mooncake`` — Mooncake JSONL (``timestamp`` in ms, ``input_length``, ``output_length``, ``hash_ids``);
* ``sharegpt`` — ShareGPT JSON array (or JSONL of conversations): text, counted with a tokenizer;
* ``alpaca-eval`` — AlpacaEval model outputs JSONL, one generator's answers: text, counted likewise;
* ``lengths`` — length-only CSV (``num_prefill_tokens,num_decode_tokens``), no timestamps.

Sources with text keep the prompt turns on each request, so a real length predictor can run on them.
Every bad input raises :class:`WorkloadError` with one line naming the file, the line and the fix.
"""

from __future__ import annotations

import gzip
import io
import json
import lzma
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from training.data.example import DataError
from training.data.loaders import alpaca_eval_by_generator, load_alpaca_eval, sharegpt_examples

KINDS = ("azure", "mooncake", "sharegpt", "alpaca-eval", "lengths")
ARRIVALS = ("auto", "trace", "poisson")
DEFAULT_GENERATOR = "gpt4_1106_preview"

_XZ_MAGIC = b"\xfd7zXZ\x00"
_GZ_MAGIC = b"\x1f\x8b"
_AZURE_COLS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_LENGTH_COLS = ("num_prefill_tokens", "num_decode_tokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")
_ALPACA_KEYS = ("instruction", "output", "generator")
_HAS_TIMESTAMPS = {"azure": True, "mooncake": True, "sharegpt": False, "alpaca-eval": False, "lengths": False}
_EXPECTED = ("a CSV with header TIMESTAMP,ContextTokens,GeneratedTokens (Azure) or num_prefill_tokens,num_decode_tokens "
             "(length-only), a Mooncake JSONL (timestamp, input_length, output_length), a ShareGPT JSON array, "
             "or AlpacaEval model outputs JSONL (instruction, output, generator)")


_READ_ERRORS = (UnicodeDecodeError, lzma.LZMAError, EOFError, OSError)  # gzip.BadGzipFile is an OSError


class WorkloadError(ValueError):
    """A workload file or option that cannot be used; the message says where and what to fix."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a workload. ``turns`` holds ``(role, text)`` prompt turns when the source has text."""

    rid: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    turns: tuple | None = None
    service: str = ""  # the model answering it, where a workload mixes several (AlpacaEval generators)


@dataclass
class Workload:
    """Requests sorted by arrival; ``dropped`` counts rows skipped (zero lengths, over ``max_prompt_tokens``)."""

    name: str
    kind: str
    requests: list[TraceRequest]
    has_timestamps: bool
    dropped: int = 0
    arrival: str = "trace"   # how arrival times were made: "trace" or "poisson"
    source: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def has_text(self) -> bool:
        """Whether a real predictor can run on these requests (the source had prompt text)."""
        return bool(self.requests) and all(r.turns is not None for r in self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first to the last arrival."""
        return self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0


# --- reading ---------------------------------------------------------------------------------------


def _check_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise WorkloadError(f"workload file not found: {p} (give a trace or prompt file, e.g. under $LENGTHWISE_DATA/traces)")
    if p.is_dir():
        raise WorkloadError(f"expected a workload file, got a directory: {p}")
    return p


def _compression(p: Path) -> str:
    with open(p, "rb") as f:
        magic = f.read(6)
    if magic.startswith(_XZ_MAGIC):
        return "xz"
    if magic.startswith(_GZ_MAGIC):
        return "gz"
    return ""


def _open_text(p: Path) -> io.TextIOBase:
    """Open as UTF-8 text, decompressing xz or gzip by their magic bytes (the name does not matter)."""
    comp = _compression(p)
    if comp == "xz":
        return lzma.open(p, "rt", encoding="utf-8-sig", newline="")
    if comp == "gz":
        return gzip.open(p, "rt", encoding="utf-8-sig", newline="")
    return open(p, encoding="utf-8-sig", newline="")


def _head(p: Path, nbytes: int = 1 << 16) -> str:
    try:
        with _open_text(p) as f:
            return f.read(nbytes)
    except _READ_ERRORS as exc:
        raise WorkloadError(f"{p}: cannot read as UTF-8 text ({type(exc).__name__}); expected {_EXPECTED}") from None


def _first_line(p: Path) -> tuple[int, str]:
    """The first non-blank line and its number (read whole: JSONL rows can be long)."""
    try:
        with _open_text(p) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    return n, line.rstrip("\r\n")
    except _READ_ERRORS as exc:
        raise WorkloadError(f"{p}: cannot read as UTF-8 text ({type(exc).__name__}); expected {_EXPECTED}") from None
    return 0, ""


def _header_cols(line: str) -> list[str]:
    return [c.strip().strip('"').strip() for c in line.split(",")]


def detect_format(path: str | os.PathLike) -> str:
    """The workload kind of a file, read from its first line(s) so the file name is never trusted.

    Returns one of :data:`KINDS`; raises :class:`WorkloadError` for a missing, empty or unknown file.
    """
    p = _check_path(path)
    head = _head(p, 4096)
    if not head.strip():
        raise WorkloadError(f"{p}: empty file; expected {_EXPECTED}")
    if head.lstrip().startswith("["):
        return "sharegpt"
    lineno, first = _first_line(p)
    if first.lstrip().startswith("{"):
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            raise WorkloadError(f"{p}:{lineno}: not valid JSON; a JSONL workload needs one JSON object per line") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"{p}:{lineno}: expected a JSON object; expected {_EXPECTED}")
        if all(k in row for k in _MOONCAKE_KEYS):
            return "mooncake"
        if all(k in row for k in _ALPACA_KEYS):
            return "alpaca-eval"
        if "conversations" in row or "messages" in row:
            return "sharegpt"
        raise WorkloadError(f"{p}:{lineno}: unknown JSONL workload with keys {sorted(row)[:8]}; expected {_EXPECTED}")
    cols = _header_cols(first)
    if all(c in cols for c in _AZURE_COLS):
        return "azure"
    if all(c in cols for c in _LENGTH_COLS):
        return "lengths"
    shown = first if len(first) <= 80 else first[:77] + "..."
    raise WorkloadError(f"{p}:{lineno}: unknown workload format (first line {shown!r}); expected {_EXPECTED}")


def _read_csv(p: Path, usecols: Sequence[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """The columns as strings plus each row's line number (header is line 1); blank lines are skipped."""
    try:
        with _open_text(p) as f:
            df = pd.read_csv(f, dtype=str, keep_default_na=False, skip_blank_lines=False)
    except pd.errors.ParserError as exc:
        msg = str(exc).splitlines()[-1].replace("Error tokenizing data. C error: ", "")
        raise WorkloadError(f"{p}: malformed CSV ({msg}); every row needs the same columns as the header") from None
    except pd.errors.EmptyDataError:
        raise WorkloadError(f"{p}: empty file; expected {_EXPECTED}") from None
    missing = [c for c in usecols if c not in df.columns]
    if missing:
        raise WorkloadError(f"{p}:1: header lacks column(s) {', '.join(missing)}; found {list(df.columns)[:8]}")
    lines = np.arange(len(df)) + 2
    blank = df.apply(lambda col: col.isna() | (col.astype(str).str.strip() == "")).all(axis=1).to_numpy()
    return df.loc[~blank, list(usecols)].reset_index(drop=True), lines[~blank]


def _int_column(values: pd.Series, name: str, p: Path, lines: np.ndarray) -> np.ndarray:
    """Whole, non-negative token counts; the first bad row raises with its line number."""
    text = values.fillna("").astype(str).str.strip()
    num = pd.to_numeric(text, errors="coerce").to_numpy(dtype=np.float64)
    bad = ~np.isfinite(num)
    if bad.any():
        i = int(np.argmax(bad))
        if not text.iloc[i]:
            raise WorkloadError(f"{p}:{lines[i]}: {name} is missing; every row needs a value in each column of the header")
        raise WorkloadError(f"{p}:{lines[i]}: {name} is {values.iloc[i]!r}, not a number; fix or delete that row")
    for mask, what in ((num < 0, "negative"), (num != np.floor(num), "not a whole number")):
        if mask.any():
            i = int(np.argmax(mask))
            raise WorkloadError(f"{p}:{lines[i]}: {name} is {values.iloc[i]!r}, {what}; token counts must be whole numbers >= 0")
    return num.astype(np.int64)


def _load_azure(p: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    df, lines = _read_csv(p, _AZURE_COLS)
    raw = df["TIMESTAMP"].astype(str).str.strip()
    ts = pd.to_datetime(raw, format="ISO8601", errors="coerce")
    bad = ts.isna().to_numpy()
    if bad.any():
        i = int(np.argmax(bad))
        raise WorkloadError(f"{p}:{lines[i]}: TIMESTAMP {raw.iloc[i]!r} is not a date-time like '2023-11-16 18:17:03.9799600'")
    if getattr(ts.dt, "tz", None) is not None:
        ts = ts.dt.tz_convert("UTC").dt.tz_localize(None)
    secs = (ts - ts.min()).dt.total_seconds().to_numpy(dtype=np.float64)
    return (secs, _int_column(df["ContextTokens"], "ContextTokens", p, lines),
            _int_column(df["GeneratedTokens"], "GeneratedTokens", p, lines))


def _load_lengths(p: Path) -> tuple[np.ndarray, np.ndarray]:
    df, lines = _read_csv(p, _LENGTH_COLS)
    return (_int_column(df["num_prefill_tokens"], "num_prefill_tokens", p, lines),
            _int_column(df["num_decode_tokens"], "num_decode_tokens", p, lines))


def _jsonl_rows(p: Path) -> list[tuple[int, dict]]:
    rows = []
    with _open_text(p) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise WorkloadError(f"{p}:{n}: not valid JSON; a JSONL workload needs one JSON object per line") from None
            if not isinstance(row, dict):
                raise WorkloadError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append((n, row))
    return rows


def _number(row: dict, key: str, p: Path, n: int, whole: bool = True) -> float:
    if key not in row:
        raise WorkloadError(f"{p}:{n}: missing field {key!r}; every row needs {', '.join(_MOONCAKE_KEYS)}")
    v = row[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise WorkloadError(f"{p}:{n}: {key} is {v!r}, not a number; fix or delete that line")
    if v < 0:
        raise WorkloadError(f"{p}:{n}: {key} is {v!r}, negative; it must be >= 0")
    if whole and v != int(v):
        raise WorkloadError(f"{p}:{n}: {key} is {v!r}, not a whole number of tokens")
    return v


def _load_mooncake(p: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = _jsonl_rows(p)
    if not rows:
        raise WorkloadError(f"{p}: empty file; expected {_EXPECTED}")
    ts = np.array([_number(r, "timestamp", p, n, whole=False) for n, r in rows], dtype=np.float64) / 1000.0
    prompt = np.array([_number(r, "input_length", p, n) for n, r in rows], dtype=np.int64)
    out = np.array([_number(r, "output_length", p, n) for n, r in rows], dtype=np.int64)
    return ts - ts.min(), prompt, out


def _load_examples(p: Path, kind: str, generator: str | None, seed: int = 0) -> tuple[list, str, list[str] | None]:
    """Prompt/response examples via the training loaders (the same turn extraction the predictor learnt on), and each
    one's service: with several AlpacaEval generators (``a,b,c``), every generator's answers, shuffled together (seeded),
    each request served by the model that gave its answer."""
    try:
        if kind == "alpaca-eval":
            gen = generator or DEFAULT_GENERATOR
            if _compression(p) != ("xz" if p.suffix == ".xz" else ""):
                raise WorkloadError(f"{p}: compression does not match the file name; "
                                    "AlpacaEval files must be plain JSONL or xz named *.xz")
            gens = [g.strip() for g in gen.split(",") if g.strip()]
            if len(gens) == 1:
                return load_alpaca_eval(p, gens[0]), gens[0], None
            tagged = [(e, g) for g, examples in alpaca_eval_by_generator(p, gens).items() for e in examples]
            order = np.random.default_rng(seed).permutation(len(tagged))
            return [tagged[i][0] for i in order], ",".join(gens), [tagged[i][1] for i in order]
        if _head(p, 4096).lstrip().startswith("["):
            try:
                with _open_text(p) as f:
                    records = json.load(f)
            except json.JSONDecodeError as exc:
                raise WorkloadError(f"{p}:{exc.lineno}: not valid JSON ({exc.msg}); a ShareGPT file is one JSON array") from None
            if not isinstance(records, list) or (records and not isinstance(records[0], dict)):
                raise WorkloadError(f"{p}: not a ShareGPT file; expected a JSON list of {{'id', 'conversations'}} objects")
        else:
            records = [r for _, r in _jsonl_rows(p)]
        return sharegpt_examples(records, first_turn_only=True), "", None
    except DataError as exc:
        raise WorkloadError(str(exc)) from None


def _count_examples(examples: list, counter, max_requests: int | None, max_total: int | None,
                    chunk: int = 2048) -> tuple[list[tuple[int, int, tuple]], int]:
    """Token counts for examples in file order, stopping once ``max_requests`` are kept.

    Prompt = all prompt turns joined by newlines (as training counts prompt length); output = the response; each kept
    entry ends with its example's index.
    """
    kept: list[tuple[int, int, tuple]] = []
    dropped = 0
    i = 0
    while i < len(examples) and (max_requests is None or len(kept) < max_requests):
        need = chunk if max_requests is None else min(chunk, max(64, (max_requests - len(kept)) * 9 // 8 + 16))
        part = examples[i : i + need]
        i += len(part)
        counts = counter.count(["\n".join(t.text for t in e.turns) for e in part] + [e.response or "" for e in part])
        for j, (e, n_in, n_out) in enumerate(zip(part, counts[: len(part)], counts[len(part) :])):
            if max_requests is not None and len(kept) >= max_requests:
                break
            if n_in <= 0 or n_out <= 0 or (max_total is not None and n_in + n_out > max_total):
                dropped += 1
                continue
            kept.append((int(n_in), int(n_out), tuple((t.role, t.text) for t in e.turns), i - len(part) + j))
    return kept, dropped


# --- assembling --------------------------------------------------------------------------------------


def _arrival_mode(arrival: str, rate: float | None, kind: str, p: Path) -> str:
    if arrival not in ARRIVALS:
        raise WorkloadError(f"unknown arrival {arrival!r}; choose one of {', '.join(ARRIVALS)}")
    if rate is not None:
        try:
            ok = not isinstance(rate, bool) and math.isfinite(float(rate)) and float(rate) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise WorkloadError(f"rate must be a positive number of requests per second, got {rate!r}")
    has_ts = _HAS_TIMESTAMPS[kind]
    if arrival == "trace":
        if not has_ts:
            raise WorkloadError(f"{p} ({kind}) has no timestamps; use arrival='poisson' with a rate (requests/s)")
        if rate is not None:
            raise WorkloadError("rate applies only to Poisson arrivals; drop it or use arrival='poisson'")
        return "trace"
    if arrival == "auto" and has_ts and rate is None:
        return "trace"
    if rate is None:
        raise WorkloadError(f"{p} ({kind}) has no timestamps: give a Poisson rate (requests/s), e.g. rate=2.0")
    return "poisson"


def _filter(prompt: np.ndarray, out: np.ndarray, max_total: int | None, max_requests: int | None) -> tuple[np.ndarray, int]:
    """Indices kept (in order) and how many rows were dropped before the last kept one."""
    ok = (prompt > 0) & (out > 0)
    if max_total is not None:
        ok &= prompt + out <= max_total
    idx = np.flatnonzero(ok)
    if max_requests is not None:
        idx = idx[:max_requests]
    scanned = len(prompt) if max_requests is None or len(idx) < max_requests else int(idx[-1]) + 1
    return idx, scanned - len(idx)


def _name(p: Path, generator: str) -> str:
    stem = p.name
    for suf in (".xz", ".gz", ".jsonl", ".json", ".csv"):
        stem = stem.removesuffix(suf)
    return f"{stem}[{generator}]" if generator else stem


def spread_ties(times: np.ndarray) -> np.ndarray:
    """Spread requests that share a timestamp evenly over the gap to the next distinct timestamp.

    Quantised traces (Mooncake's conversation trace ticks every 3 s) turn into bursts of up to ~17
    simultaneous arrivals, and rescaling a trace to a lower rate never separates them, so queueing inside
    the burst, not the rate, decides SLO attainment. Spreading keeps each tick's count, hence the trace's
    burstiness over minutes, and the file order. The last tick spreads over the median tick gap.
    """
    t = np.asarray(times, dtype=np.float64)
    order = np.argsort(t, kind="stable")
    st = t[order]
    ticks, first, counts = np.unique(st, return_index=True, return_counts=True)
    if len(ticks) == len(st):
        return t.copy()
    gaps = np.diff(ticks)
    gaps = np.append(gaps, np.median(gaps) if len(gaps) else 0.0)
    for i, c, g in zip(first, counts, gaps):
        if c > 1:
            st[i:i + c] = st[i] + g * np.arange(c) / c
    out = np.empty_like(t)
    out[order] = st
    return out


def load_workload(path: str | os.PathLike, *, arrival: str = "auto", rate: float | None = None,
                  max_requests: int | None = None, seed: int = 0, tokenizer: str | None = None,
                  max_prompt_tokens: int | None = None, generator: str | None = None) -> Workload:
    """Load a trace or prompt set as a :class:`Workload` the simulator replays.

    ``arrival``: ``"trace"`` keeps the file's timestamps (rebased so the first request arrives at 0; requests
    sharing a timestamp are spread to the next one, see :func:`spread_ties`),
    ``"poisson"`` draws exponential gaps at ``rate`` req/s from ``numpy.random.default_rng(seed)``,
    ``"auto"`` uses the trace when it has timestamps and no ``rate`` is given. Rows with a zero prompt
    or output, or with ``prompt + output > max_prompt_tokens`` (the served model's context), are skipped
    and counted in ``dropped``; ``max_requests`` then keeps the first N in arrival (file) order.
    ``tokenizer`` counts tokens of text sources (ignored where the file gives counts), default
    ``$LENGTHWISE_DATA/tokenizers/gpt2/tokenizer.json``;
    ``generator`` picks whose AlpacaEval answers are the outputs (default ``gpt4_1106_preview``).
    """
    p = _check_path(path)
    if max_requests is not None and (isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1):
        raise WorkloadError(f"max_requests must be a positive integer, got {max_requests!r}")
    if max_prompt_tokens is not None and (not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 2):
        raise WorkloadError(f"max_prompt_tokens must be an integer >= 2 (prompt + output tokens), got {max_prompt_tokens!r}")
    kind = detect_format(p)
    mode = _arrival_mode(arrival, rate, kind, p)
    if kind != "alpaca-eval" and generator is not None:
        raise WorkloadError(f"generator applies only to AlpacaEval outputs, not to the {kind} file {p}")

    try:
        prompt, out, times, turns, dropped, gen, services = _load_rows(p, kind, max_requests, tokenizer, max_prompt_tokens,
                                                                       generator, seed)
    except _READ_ERRORS as exc:
        raise WorkloadError(f"{p}: unreadable or truncated {kind} file ({type(exc).__name__}: {exc}); "
                            "re-download or fix it") from None

    n = len(prompt)
    if mode == "trace":
        assert times is not None
        arrivals = spread_ties(times - times[0])
    else:
        gaps = np.random.default_rng(seed).exponential(1.0 / float(rate), size=n)
        arrivals = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    requests = [
        TraceRequest(rid=i, arrival=float(arrivals[i]), prompt_tokens=int(prompt[i]), output_tokens=int(out[i]),
                     turns=turns[i] if turns is not None else None, service=services[i] if services is not None else "")
        for i in range(n)
    ]
    return Workload(name=_name(p, gen), kind=kind, requests=requests, has_timestamps=_HAS_TIMESTAMPS[kind],
                    dropped=int(dropped), arrival=mode, source=str(p))


def _load_rows(p: Path, kind: str, max_requests: int | None, tokenizer: str | None, max_prompt_tokens: int | None,
               generator: str | None, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                              list[tuple] | None, int, str, list[str] | None]:
    """(prompt, output, times or None, turns or None, dropped, generator, services or None) after filtering and
    ``max_requests``."""
    times: np.ndarray | None = None
    turns: list[tuple] | None = None
    services: list[str] | None = None
    gen = ""
    if kind in ("sharegpt", "alpaca-eval"):
        from predictor.common import default_tokenizer
        from training.data.example import DataError
        from training.data.labels import load_counter

        try:  # the tokenizer first: a bad path should not cost a parse of the whole file
            counter = load_counter(tokenizer or default_tokenizer())
        except DataError as exc:
            raise WorkloadError(str(exc)) from None
        examples, gen, tags = _load_examples(p, kind, generator, seed)
        kept, dropped = _count_examples(examples, counter, max_requests, max_prompt_tokens)
        prompt = np.array([k[0] for k in kept], dtype=np.int64)
        out = np.array([k[1] for k in kept], dtype=np.int64)
        turns = [k[2] for k in kept]
        services = [tags[k[3]] for k in kept] if tags is not None else None
        if not kept:
            raise WorkloadError(f"{p}: no usable requests ({len(examples)} examples, {dropped} dropped for zero length or "
                                f"max_prompt_tokens={max_prompt_tokens}); raise max_prompt_tokens or check the file")
    else:
        if kind == "azure":
            times, prompt, out = _load_azure(p)
        elif kind == "mooncake":
            times, prompt, out = _load_mooncake(p)
        else:
            prompt, out = _load_lengths(p)
        n_rows = len(prompt)
        if n_rows == 0:
            raise WorkloadError(f"{p}: no data rows after the header; expected {_EXPECTED}")
        if times is not None:
            order = np.argsort(times, kind="stable")
            times, prompt, out = times[order], prompt[order], out[order]
        idx, dropped = _filter(prompt, out, max_prompt_tokens, max_requests)
        if len(idx) == 0:
            raise WorkloadError(f"{p}: all {n_rows} rows dropped (zero lengths or prompt + output > max_prompt_tokens="
                                f"{max_prompt_tokens}); raise max_prompt_tokens or use another trace")
        prompt, out = prompt[idx], out[idx]
        if times is not None:
            times = times[idx]

    return prompt, out, times, turns, dropped, gen, services
