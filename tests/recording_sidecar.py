"""A real HTTP server with the sidecar's routes that records every call (path, Authorization header, body).

For the gateway's side of the sidecar contract alone: which calls it makes, when, and with what credentials. The
sidecar's own behaviour is tested with the real sidecar (tests/test_sidecar*.py).
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.threaded_server import ThreadedServer

PREDICTION = {"bucket": 1, "range": [64, 256], "expected_tokens": 120.0, "quantile_tokens": 200.0, "prediction_id": "p-1",
              "model_name": "length-predictor", "model_version": "7"}


class RecordingSidecar:
    """``calls``: (path, Authorization header or None, JSON body or None), in order. ``ready`` False: /ready is 503.
    ``predict_delay_s``: how long each prediction takes; ``keep_alive_s``: how long an idle connection stays open."""

    def __init__(self, predict_delay_s: float = 0.0, keep_alive_s: float = 5.0) -> None:
        self.calls: list[tuple[str, str | None, dict | None]] = []
        self.ready = True
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next):
            body = await request.json() if request.method == "POST" else None
            self.calls.append((request.url.path, request.headers.get("authorization"), body))
            return await call_next(request)

        @app.get("/ready")
        def ready():
            if not self.ready:
                return JSONResponse({"detail": "no model loaded yet"}, status_code=503)
            return {"status": "ready", "model_name": "length-predictor", "model_version": "7"}

        @app.get("/health")
        def health():
            return {"status": "ok", "target": None}

        @app.post("/v1/predict")
        async def predict():
            await asyncio.sleep(predict_delay_s)
            return {"predictions": [PREDICTION]}

        @app.post("/v1/feedback")
        def feedback():
            return {"status": "ok"}

        self._http = ThreadedServer(app, "the recording sidecar", timeout_keep_alive=keep_alive_s)
        self.url = self._http.url

    def paths(self, path: str) -> list[tuple[str, str | None, dict | None]]:
        return [c for c in self.calls if c[0] == path]

    def stop(self) -> None:
        self._http.stop()
