"""Writing closed windows without ever blocking serving: a bounded buffer and a background thread.

Where a window goes is the caller's ``write`` (the sidecar's writes to MLflow: :mod:`predictor.monitoring_runs`);
what is here is what any store needs while it is down: windows wait in the buffer, the thread retries with backoff,
and when the buffer is full the oldest windows are dropped, and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from monitoring.online import WindowStats

log = logging.getLogger(__name__)


class WindowLogger:
    """Writes closed windows through ``write`` from a background thread; a bounded buffer rides out outages.

    ``where`` names the store in warnings (``could not log an online-monitoring window to MLflow``)."""

    def __init__(self, write: Callable[[WindowStats], None], max_buffered: int = 1000, retry_min_s: float = 1.0,
                 retry_max_s: float = 30.0, on_change: Callable[[int, int], None] | None = None, where: str = "its store"):
        self._write = write
        self.where = where
        self._buf: deque[WindowStats] = deque()
        self.max_buffered = max_buffered
        self.dropped = 0
        self.logged = 0
        self.failures = 0
        self.last_error: str | None = None
        self.retry_min_s, self.retry_max_s = retry_min_s, retry_max_s
        self._on_change = on_change or (lambda buffered, dropped: None)
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"{where.lower().replace(' ', '-')}-window-logger",
                                        daemon=True)
        self._thread.start()

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def submit(self, windows: list[WindowStats]) -> None:
        """Queue windows for writing; never blocks on the store."""
        if not windows:
            return
        with self._cv:
            for w in windows:
                if len(self._buf) >= self.max_buffered:
                    self._buf.popleft()
                    self.dropped += 1
                self._buf.append(w)
            self._cv.notify()
        self._on_change(len(self._buf), self.dropped)

    def close(self, timeout: float = 5.0) -> None:
        """Try to write what is buffered (bounded by ``timeout``), then stop the thread."""
        deadline = time.time() + timeout
        with self._cv:
            self._cv.notify()
        while self._buf and time.time() < deadline and self.failures == 0:
            time.sleep(0.05)
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=max(0.1, deadline - time.time()))

    def _loop(self) -> None:
        delay = self.retry_min_s
        while True:
            with self._cv:
                while not self._buf and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                win = self._buf[0]
            try:
                self._write(win)
            except Exception as exc:  # noqa: BLE001 - tracking server down, DB locked: keep the window, back off, retry
                self.failures += 1
                self.last_error = " ".join(str(exc).split())[:300]
                log.warning("could not log an online-monitoring window to %s (%d buffered, retry in %.1f s): %s",
                            self.where, len(self._buf), delay, self.last_error)
                with self._cv:
                    self._cv.wait(timeout=delay)
                delay = min(delay * 2, self.retry_max_s)
                continue
            delay = self.retry_min_s
            self.failures = 0
            with self._cv:
                if self._buf and self._buf[0] is win:
                    self._buf.popleft()
            self.logged += 1
            self._on_change(len(self._buf), self.dropped)
