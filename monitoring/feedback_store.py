"""Served predictions and their actual lengths, kept on local disk as training data (SQLite).

Why keep them: the sidecar's feedback is the only labelled data that looks like today's traffic. Each row holds
what the predictor saw (the prompt turns it encoded, as JSON, or only their sha256 when prompts are not kept), what
it said (bucket probabilities over the bucket edges, the argmax bucket, the expected and quantile length), what the
engine then did (actual output tokens and its finish reason), and which model version predicted it for which target
model. A capped or aborted answer (``censored``) is a lower bound on the true length, not the true length: a
retraining job must treat it so.

Why SQLite in WAL mode: one file under ``$LENGTHWISE_HOME``, no server, and a reader (``lengthwise retrain``) can
read while the sidecar writes. The store is bounded by count and by age: after each write the oldest rows beyond
``max_rows``, and rows older than ``max_age_s``, are deleted (rows are appended in time order by one writer, so row
ids are contiguous and both deletions touch only the oldest end of the table).

Writes never block serving: :class:`FeedbackWriter` takes rows on a bounded queue and writes them from its own
thread, in batches. A full queue drops the row; a locked database or a full disk fails the batch; either way the
row is counted (``on_outcome``) and logged, and the sidecar's answer is unaffected.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from predictor.common import lengthwise_home

log = logging.getLogger(__name__)

DB_FILE = "feedback.db"
DEFAULT_MAX_ROWS = 200_000
DEFAULT_MAX_AGE_DAYS = 30.0
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY,          -- append order (contiguous: only the oldest rows are ever deleted)
    prediction_id TEXT NOT NULL,
    time REAL NOT NULL,              -- when the feedback arrived, unix seconds
    predicted_at REAL NOT NULL,      -- when the prediction was served
    model_name TEXT NOT NULL,
    model_version TEXT NOT NULL,
    target TEXT,                     -- JSON: the model the version was trained to predict for; NULL when it records none
    turns TEXT,                      -- JSON [[role, text], ...] as the predictor encoded them; NULL when prompts are not kept
    prompt_sha256 TEXT NOT NULL,     -- of the turns' JSON, kept always
    probs TEXT NOT NULL,             -- JSON: one probability per bucket
    edges TEXT NOT NULL,             -- JSON: the top of every bucket but the last, open one (len(probs) - 1)
    bucket INTEGER NOT NULL,
    expected_tokens REAL NOT NULL,
    quantile_tokens REAL,
    actual_tokens INTEGER NOT NULL,
    finish_reason TEXT,              -- as the engine said it; NULL when the client did not say
    censored INTEGER NOT NULL        -- 1: the answer was cut (capped, aborted): the true length is at least actual_tokens
);
CREATE INDEX IF NOT EXISTS feedback_time ON feedback (time);
CREATE INDEX IF NOT EXISTS feedback_model ON feedback (model_name, model_version, time);
"""
_COLUMNS = ("prediction_id", "time", "predicted_at", "model_name", "model_version", "target", "turns", "prompt_sha256",
            "probs", "edges", "bucket", "expected_tokens", "quantile_tokens", "actual_tokens", "finish_reason", "censored")


@dataclass(frozen=True)
class FeedbackRow:
    """One served prediction and what the engine then generated."""

    prediction_id: str
    time: float
    predicted_at: float
    model_name: str
    model_version: str
    target: dict | None
    turns: list[tuple[str, str]] | None  # None: the sidecar kept only prompt_sha256
    prompt_sha256: str
    probs: list[float]
    edges: list[int]
    bucket: int
    expected_tokens: float
    quantile_tokens: float | None
    actual_tokens: int
    finish_reason: str | None
    censored: bool

    def _values(self) -> tuple:
        return (self.prediction_id, self.time, self.predicted_at, self.model_name, self.model_version,
                None if self.target is None else json.dumps(self.target, sort_keys=True),
                None if self.turns is None else json.dumps([list(t) for t in self.turns], ensure_ascii=False),
                self.prompt_sha256, json.dumps(self.probs), json.dumps(self.edges), self.bucket, self.expected_tokens,
                self.quantile_tokens, self.actual_tokens, self.finish_reason, int(self.censored))

    @classmethod
    def _from(cls, r: sqlite3.Row) -> FeedbackRow:
        return cls(r["prediction_id"], r["time"], r["predicted_at"], r["model_name"], r["model_version"],
                   None if r["target"] is None else json.loads(r["target"]),
                   None if r["turns"] is None else [(str(a), str(b)) for a, b in json.loads(r["turns"])],
                   r["prompt_sha256"], json.loads(r["probs"]), json.loads(r["edges"]), r["bucket"], r["expected_tokens"],
                   r["quantile_tokens"], r["actual_tokens"], r["finish_reason"], bool(r["censored"]))


def default_path() -> Path:
    """``$LENGTHWISE_HOME/feedback.db``, beside the MLflow store."""
    return lengthwise_home() / DB_FILE


def error_kind(exc: BaseException) -> str:
    """``locked`` (another connection holds the lock past the busy timeout), ``disk_full``, ``read_only`` (the file or
    its file system), ``io`` or ``error``: the reason an operator reads in the store's error counter."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc).lower()
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
        return "locked"
    if name.startswith("SQLITE_FULL") or "disk is full" in text or isinstance(exc, OSError) and exc.errno == 28:
        return "disk_full"
    if name.startswith("SQLITE_READONLY") or "readonly" in text or isinstance(exc, OSError) and exc.errno == 30:
        return "read_only"
    if name.startswith(("SQLITE_IOERR", "SQLITE_CANTOPEN")) or isinstance(exc, OSError):
        return "io"
    return "error"


class FeedbackStore:
    """The feedback database at ``path``: append and prune (the writer's side), and read (a retraining job's side)."""

    def __init__(self, path: Path | str | None = None, busy_timeout_s: float = 1.0):
        self.path = Path(path) if path is not None else default_path()
        self.busy_timeout_s = busy_timeout_s

    # --- writing (one thread: FeedbackWriter's) -----------------------------------------------------
    def connect(self) -> sqlite3.Connection:
        """A read-write connection in WAL mode, creating the file and its tables when missing."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a power cut may lose the last rows, never corrupt
            if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                conn.executescript(f"BEGIN; {_SCHEMA} PRAGMA user_version = {SCHEMA_VERSION}; COMMIT;")
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def append(conn: sqlite3.Connection, rows: list[FeedbackRow], max_rows: int, max_age_s: float,
               now: float | None = None) -> int:
        """Insert ``rows`` and apply retention, in one transaction; returns how many old rows were deleted."""
        now = time.time() if now is None else now
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.executemany(f"INSERT INTO feedback ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})",
                             [r._values() for r in rows])
            deleted = conn.execute("DELETE FROM feedback WHERE time < ?", (now - max_age_s,)).rowcount
            deleted += conn.execute("DELETE FROM feedback WHERE id <= (SELECT max(id) FROM feedback) - ?",
                                    (max_rows,)).rowcount
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return deleted

    # --- reading (any process) ----------------------------------------------------------------------
    def _reader(self) -> sqlite3.Connection | None:
        """A read-only connection; None while there is no store (no file, or one whose tables are not made yet)."""
        if not self.path.exists():
            return None
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=self.busy_timeout_s)
        if conn.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
            conn.close()
            return None
        conn.row_factory = sqlite3.Row
        return conn

    @staticmethod
    def _where(since: float | None, until: float | None, model_name: str | None,
               model_version: str | None) -> tuple[str, list]:
        terms, args = [], []
        for clause, v in (("time >= ?", since), ("time < ?", until), ("model_name = ?", model_name),
                          ("model_version = ?", model_version)):
            if v is not None:
                terms.append(clause)
                args.append(v)
        return (" WHERE " + " AND ".join(terms)) if terms else "", args

    def read(self, since: float | None = None, until: float | None = None, model_name: str | None = None,
             model_version: str | None = None, limit: int | None = None) -> list[FeedbackRow]:
        """Rows with ``since <= time < until`` (unix seconds) of a model (and version), oldest first; [] without a store."""
        conn = self._reader()
        if conn is None:
            return []
        where, args = self._where(since, until, model_name, model_version)
        tail = " LIMIT ?" if limit is not None else ""
        try:
            cur = conn.execute(f"SELECT {', '.join(_COLUMNS)} FROM feedback{where} ORDER BY id{tail}",
                               [*args, *([limit] if limit is not None else [])])
            return [FeedbackRow._from(r) for r in cur]
        finally:
            conn.close()

    def count(self, since: float | None = None, until: float | None = None, model_name: str | None = None,
              model_version: str | None = None) -> dict[str, int]:
        """``{"rows", "with_prompt", "censored"}`` over the rows ``read`` would return."""
        conn = self._reader()
        if conn is None:
            return {"rows": 0, "with_prompt": 0, "censored": 0}
        where, args = self._where(since, until, model_name, model_version)
        try:
            rows, with_prompt, censored = conn.execute(
                f"SELECT count(*), count(turns), coalesce(sum(censored), 0) FROM feedback{where}", args).fetchone()
        finally:
            conn.close()
        return {"rows": rows, "with_prompt": with_prompt, "censored": censored}

    def stores_prompts(self, since: float | None = None, until: float | None = None, model_name: str | None = None,
                       model_version: str | None = None) -> bool:
        """Whether there are rows and every one kept its prompt turns (False: a sidecar ran with --no-store-prompts,
        so those rows hold only a hash and cannot be trained on)."""
        c = self.count(since, until, model_name, model_version)
        return c["rows"] > 0 and c["with_prompt"] == c["rows"]


class FeedbackWriter:
    """Writes rows to a :class:`FeedbackStore` from a background thread; ``submit`` never blocks.

    ``on_outcome(outcome, rows)`` is called with ``written``, ``dropped`` (queue full), ``failed`` (the batch could
    not be written) or ``pruned`` (deleted by retention); ``on_error(kind)`` with :func:`error_kind` of each failure.
    """

    def __init__(self, store: FeedbackStore, max_rows: int = DEFAULT_MAX_ROWS,
                 max_age_s: float = DEFAULT_MAX_AGE_DAYS * 86400.0, queue_size: int = 10_000, batch: int = 256,
                 on_outcome: Callable[[str, int], None] | None = None, on_error: Callable[[str], None] | None = None):
        if max_rows < 1 or max_age_s <= 0 or queue_size < 1:
            raise ValueError("max_rows and queue_size must be >= 1 and max_age_s > 0")
        self.store, self.max_rows, self.max_age_s, self.batch = store, max_rows, max_age_s, batch
        self._q: queue.Queue[FeedbackRow | None] = queue.Queue(maxsize=queue_size)
        self._on_outcome = on_outcome or (lambda outcome, n: None)
        self._on_error = on_error or (lambda kind: None)
        self.counts = {"written": 0, "dropped": 0, "failed": 0, "pruned": 0}
        self.last_error: str | None = None
        self._last_logged = 0.0
        self._thread = threading.Thread(target=self._loop, name="feedback-store-writer", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return self._q.qsize()

    def submit(self, row: FeedbackRow) -> bool:
        """Queue a row for writing; False (and counted as dropped) when the queue is full."""
        try:
            self._q.put_nowait(row)
        except queue.Full:
            self._count("dropped", 1)
            return False
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (bounded by ``timeout``), then stop the thread."""
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout=timeout)

    def _count(self, outcome: str, n: int) -> None:
        self.counts[outcome] += n
        self._on_outcome(outcome, n)

    def _loop(self) -> None:
        conn: sqlite3.Connection | None = None
        stop = False
        while not stop:
            first = self._q.get()
            rows: list[FeedbackRow] = []
            if first is None:
                stop = True
            else:
                rows.append(first)
            while len(rows) < self.batch:
                try:
                    nxt = self._q.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                rows.append(nxt)
            if not rows:
                continue
            try:
                conn = conn or self.store.connect()
                pruned = self.store.append(conn, rows, self.max_rows, self.max_age_s)
            except (sqlite3.Error, OSError) as exc:
                self._failed(exc, len(rows))
                if conn is not None and not isinstance(exc, sqlite3.OperationalError):
                    conn.close()
                    conn = None
                continue
            self._count("written", len(rows))
            if pruned:
                self._count("pruned", pruned)
        if conn is not None:
            conn.close()

    def _failed(self, exc: BaseException, n: int) -> None:
        kind = error_kind(exc)
        self.last_error = f"{kind}: {' '.join(str(exc).split())[:200]}"
        self._count("failed", n)
        self._on_error(kind)
        now = time.monotonic()
        if now - self._last_logged >= 10.0:  # a long outage logs once every 10 s, not once per batch
            self._last_logged = now
            log.warning("could not write %d feedback rows to %s (%s); they are dropped, serving is not affected",
                        n, self.store.path, self.last_error)
