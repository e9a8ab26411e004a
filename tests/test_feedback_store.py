"""The feedback store on a real SQLite file: rows round-trip, retention by count and by age, a locked database and a
full writer queue are counted (never raised), and the reader API a retraining job uses (filters, prompt coverage)."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from monitoring.feedback_store import FeedbackRow, FeedbackStore, FeedbackWriter, error_kind
from tests.sidecar_proc import wait_for

pytestmark = pytest.mark.unit


def row(i: int, *, t: float | None = None, turns: bool = True, model: str = "lp", version: str = "1",
        reason: str | None = "stop") -> FeedbackRow:
    return FeedbackRow(
        prediction_id=f"p{i}", time=time.time() if t is None else t, predicted_at=(time.time() if t is None else t) - 1,
        model_name=model, model_version=version, target={"model": "smol@0123456789ab", "max_tokens": 512},
        turns=[("user", f"question {i} \u00e9")] if turns else None, prompt_sha256=f"{i:064x}", probs=[0.5, 0.25, 0.25],
        edges=[100, 200], bucket=0, expected_tokens=120.5, quantile_tokens=250.0, actual_tokens=i,
        finish_reason=reason, censored=reason == "length")


def written(store: FeedbackStore, rows: list[FeedbackRow], **kw) -> FeedbackWriter:
    w = FeedbackWriter(store, **kw)
    for r in rows:
        assert w.submit(r)
    w.close()
    return w


def test_rows_round_trip_and_the_file_is_wal(tmp_path):
    store = FeedbackStore(tmp_path / "sub" / "fb.db")
    rows = [row(1), row(2, turns=False, reason="length")]
    w = written(store, rows)
    assert w.counts["written"] == 2 and w.counts["failed"] == 0
    assert store.read() == rows  # every field, in order: the turns as (role, text) pairs, the target as a dict
    with sqlite3.connect(store.path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.count() == {"rows": 2, "with_prompt": 1, "censored": 1}
    assert store.read(limit=1) == rows[:1]


def test_reader_filters_and_prompt_coverage(tmp_path):
    store = FeedbackStore(tmp_path / "fb.db")
    now = time.time()
    written(store, [row(1, t=now - 30), row(2, t=now - 20, model="other"), row(3, t=now - 10, version="2"),
                    row(4, t=now - 5, version="2", turns=False)])
    assert [r.prediction_id for r in store.read(since=now - 25)] == ["p2", "p3", "p4"]
    assert [r.prediction_id for r in store.read(until=now - 20)] == ["p1"]
    assert [r.prediction_id for r in store.read(model_name="lp")] == ["p1", "p3", "p4"]
    assert [r.prediction_id for r in store.read(model_name="lp", model_version="2")] == ["p3", "p4"]
    assert store.stores_prompts(model_name="lp", until=now - 7) is True
    assert store.stores_prompts(model_name="lp") is False  # p4 kept only its hash: retraining on it must refuse
    assert store.stores_prompts(model_name="nobody") is False  # nothing to train on either
    missing = FeedbackStore(tmp_path / "none.db")
    assert missing.read() == [] and missing.count()["rows"] == 0 and not (tmp_path / "none.db").exists()
    sqlite3.connect(tmp_path / "empty.db").close()  # a file the writer has created but not yet given its tables
    assert FeedbackStore(tmp_path / "empty.db").read() == [] and not FeedbackStore(tmp_path / "empty.db").stores_prompts()


def test_retention_by_count_keeps_the_newest(tmp_path):
    store = FeedbackStore(tmp_path / "fb.db")
    w = written(store, [row(i) for i in range(12)], max_rows=5, batch=4)
    assert [r.actual_tokens for r in store.read()] == [7, 8, 9, 10, 11]
    assert w.counts["pruned"] == 7
    written(store, [row(12)], max_rows=5)  # a later writer (a restart) keeps the bound
    assert [r.actual_tokens for r in store.read()] == [8, 9, 10, 11, 12]


def test_retention_by_age(tmp_path):
    store = FeedbackStore(tmp_path / "fb.db")
    day = 86400.0
    now = time.time()
    written(store, [row(1, t=now - 40 * day), row(2, t=now - 31 * day), row(3, t=now - 29 * day), row(4)],
            max_age_s=30 * day)
    assert [r.actual_tokens for r in store.read()] == [3, 4]


def test_a_locked_database_is_counted_not_raised_and_writing_resumes(tmp_path):
    store = FeedbackStore(tmp_path / "fb.db", busy_timeout_s=0.1)
    errors: list[str] = []
    w = FeedbackWriter(store, on_error=errors.append)
    try:
        assert w.submit(row(0))
        wait_for(lambda: w.counts["written"] == 1, what="the first row")
        holder = sqlite3.connect(store.path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")  # another process holds the write lock
        try:
            assert w.submit(row(1))  # submit never waits on the lock
            wait_for(lambda: w.counts["failed"] == 1, what="the failed write")
            assert errors == ["locked"] and "locked" in (w.last_error or "")
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert w.submit(row(2))
        wait_for(lambda: w.counts["written"] == 2, what="writing to resume")
    finally:
        w.close()
    assert [r.actual_tokens for r in store.read()] == [0, 2]


def test_a_full_queue_drops_and_counts(tmp_path):
    store = FeedbackStore(tmp_path / "fb.db", busy_timeout_s=2.0)
    holder = sqlite3.connect(store.path, isolation_level=None)
    store.connect().close()  # the tables exist; now hold the lock so the writer stalls
    holder.execute("BEGIN EXCLUSIVE")
    w = FeedbackWriter(store, queue_size=2, batch=1)
    try:
        t0 = time.perf_counter()
        accepted = [w.submit(row(i)) for i in range(10)]
        assert time.perf_counter() - t0 < 0.5, "submit waited"
        assert accepted.count(False) >= 7 and w.counts["dropped"] == accepted.count(False)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
        w.close()


@pytest.mark.fault("the feedback store unwritable (its directory cannot be made)",
                   saw="nothing (the write is in the background)",
                   lost="the row, counted as an io error")
def test_an_unwritable_place_is_counted(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    errors: list[str] = []
    w = FeedbackWriter(FeedbackStore(blocker / "fb.db"), on_error=errors.append)
    assert w.submit(row(1))
    w.close()
    assert w.counts["failed"] == 1 and errors == ["io"]


def test_error_kinds():
    assert error_kind(sqlite3.OperationalError("database is locked")) == "locked"
    assert error_kind(sqlite3.OperationalError("database or disk is full")) == "disk_full"
    assert error_kind(OSError(28, "No space left on device")) == "disk_full"
    assert error_kind(sqlite3.OperationalError("attempt to write a readonly database")) == "read_only"
    assert error_kind(OSError(30, "Read-only file system")) == "read_only"
    assert error_kind(sqlite3.DatabaseError("file is not a database")) == "error"


def test_writer_thread_does_not_outlive_close(tmp_path):
    w = FeedbackWriter(FeedbackStore(tmp_path / "fb.db"))
    w.close()
    assert not any(t.name == "feedback-store-writer" and t.is_alive() and t is w._thread for t in threading.enumerate())
