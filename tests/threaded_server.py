"""An ASGI app served by uvicorn on a local port in a daemon thread: the tests' stand-in engines and sidecars.

One piece for what every stand-in needs: a free port (or a given one), the server started and waited for, and a stop
that lets it finish. The app is the stand-in's own; this only serves it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from serving.launch.process import free_port


class ThreadedServer:
    """``app`` on ``http://127.0.0.1:PORT``, started before the constructor returns (``what`` names it if it does not
    start within ``start_timeout_s``); ``config``: more ``uvicorn.Config`` settings (e.g. ``timeout_keep_alive``)."""

    def __init__(self, app: Any, what: str, port: int | None = None, start_timeout_s: float = 10.0,
                 **config: Any) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     **config))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            assert time.monotonic() < deadline, f"{what} did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
