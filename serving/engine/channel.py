"""The plug-in's own port in the engine-core process: its counters out, refined predictions in.

Why a port of its own: vLLM's HTTP server runs in the API-server process, and vLLM 0.32 has no official way to carry
data to a request already running. Its engine-core utility calls are reachable only from the API server's own client,
``collective_rpc`` reaches the workers rather than the scheduler, and a request's ``extra_args`` are read once, at
arrival. So the plug-in serves one small HTTP port (``metrics_port`` in its settings) from a daemon thread:

* ``GET /metrics``: the plug-in's counters for Prometheus (:mod:`serving.engine.metrics`);
* ``POST /v1/refine``: one :class:`~serving.policy.hints.Refinement` for a running request, named by the ``ref`` the
  gateway gave it in ``vllm_xargs``. The answer is 202 when the update is queued, and 404 when no request of that
  ref is running here: it finished, it never came, or this engine started again since. Several at once
  (:class:`~serving.policy.hints.Refinements`, ``{"refinements": [...]}``) get 200 with the refs ``queued`` and those
  ``unknown``. A bad key gets 401. A body over :data:`MAX_BODY` bytes gets 413, and one that is not a refinement gets
  422.

The key is the engine's own: ``$VLLM_API_KEY``, which ``vllm serve`` reads as its ``--api-key`` and which engines the
gateway starts are given. An engine without one takes refinements only on a loopback address.

Memory is bounded: the inbox holds refs of running requests only, and at most one update each (a newer one replaces
one not yet applied). The scheduler takes them at the start of its next step (:meth:`RefinementInbox.take`), so a
request that gets no update is never touched. The thread and the scheduler share nothing but the inbox, behind its lock.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from serving.engine.metrics import StatsCollector
from serving.policy.hints import Refinement, Refinements

log = logging.getLogger(__name__)

KEY_ENV = "VLLM_API_KEY"
MAX_BODY = 262_144  # bytes: a refinement is a few hundred, and a call holds at most MAX_REFINEMENTS of them
REFINE_PATH = "/v1/refine"


class RefinementInbox:
    """Refinements waiting for the scheduler's next step, one per running request at most."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: dict[str, int] = {}  # ref -> the policy's request id, for requests the engine holds
        self._pending: dict[str, tuple[int, Refinement, float]] = {}
        self.counts = {"refinements_received": 0, "refinements_unknown": 0, "refinements_replaced": 0}

    def open(self, ref: str, rid: int) -> None:
        """A request with ``ref`` arrived: updates for it are taken from now on."""
        with self._lock:
            self._live[ref] = rid

    def close(self, ref: str, rid: int) -> None:
        """The request left: later updates for it get 404, and one still waiting is dropped."""
        with self._lock:
            if self._live.get(ref) == rid:  # a later request with the same ref keeps its own
                del self._live[ref]
                self._pending.pop(ref, None)

    def offer(self, update: Refinement) -> bool:
        """Queue ``update`` for its request; False when no running request has its ref."""
        with self._lock:
            rid = self._live.get(update.ref)
            if rid is None:
                self.counts["refinements_unknown"] += 1
                return False
            self.counts["refinements_received"] += 1
            self.counts["refinements_replaced"] += update.ref in self._pending
            self._pending[update.ref] = (rid, update, time.monotonic())
            return True

    def take(self) -> list[tuple[int, Refinement, float]]:
        """Every waiting update, as (request id, update, when it came on ``time.monotonic()``); the inbox is then empty."""
        if not self._pending:  # read without the lock: a miss waits one step
            return []
        with self._lock:
            out, self._pending = list(self._pending.values()), {}
        return out

    @property
    def live(self) -> int:
        return len(self._live)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class PluginServer(ThreadingHTTPServer):
    """The port's HTTP server; :func:`serve_plugin` starts one."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], stats: Callable[[], dict], inbox: RefinementInbox,
                 key: str | None) -> None:
        super().__init__(address, _Handler)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(stats))
        self.inbox, self.key = inbox, key
        self.open_refine = key is None and _loopback(address[0])


class _Handler(BaseHTTPRequestHandler):
    server: PluginServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("plug-in port: " + format, *args)

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._send(status, json.dumps({"error": {"message": message, "code": status.value}}).encode())

    def do_GET(self) -> None:
        if self.path.split("?")[0] in ("/metrics", "/"):
            self._send(200, generate_latest(self.server.registry), CONTENT_TYPE_LATEST)
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no {self.path} here: GET /metrics, POST {REFINE_PATH}")

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = MAX_BODY + 1  # unreadable: refused below, the connection closed
        if self.path != REFINE_PATH:
            self.close_connection = True
            return self._error(HTTPStatus.NOT_FOUND, f"no {self.path} here: POST {REFINE_PATH}")
        if not self._authorized():
            self.close_connection = True
            return self._error(HTTPStatus.UNAUTHORIZED, "refinements need the engine's key: Authorization: Bearer "
                                                        f"${KEY_ENV}")
        if length > MAX_BODY:
            self.close_connection = True
            return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a refinement is at most {MAX_BODY} bytes")
        try:
            data = json.loads(self.rfile.read(length))
        except ValueError as exc:
            return self._error(HTTPStatus.UNPROCESSABLE_ENTITY, f"not a refinement: the body is not JSON ({exc})")
        try:
            many = isinstance(data, dict) and "refinements" in data
            update = (Refinements if many else Refinement).model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "body"
            return self._error(HTTPStatus.UNPROCESSABLE_ENTITY, f"not a refinement: {where}: {err['msg']}")
        if isinstance(update, Refinements):
            taken: list[str] = []
            unknown: list[str] = []
            for u in update.refinements:
                (taken if self.server.inbox.offer(u) else unknown).append(u.ref)
            return self._send(HTTPStatus.OK, json.dumps({"queued": taken, "unknown": unknown}).encode())
        if not self.server.inbox.offer(update):
            return self._error(HTTPStatus.NOT_FOUND, f"no running request has ref {update.ref!r} (finished, never "
                                                     "came, or this engine started again since)")
        self._send(HTTPStatus.ACCEPTED, b'{"queued":true}')

    def _authorized(self) -> bool:
        if self.server.open_refine:
            return True
        if self.server.key is None:
            return False
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.server.key}".encode())


def serve_plugin(stats: Callable[[], dict], inbox: RefinementInbox, port: int, host: str = "127.0.0.1") -> PluginServer:
    """Start the port in a daemon thread (``.shutdown()`` then ``.server_close()`` stop it). OSError when the port is
    taken."""
    key = os.environ.get(KEY_ENV) or None
    server = PluginServer((host, port), stats, inbox, key)
    if key is None and not server.open_refine:
        log.warning("lengthwise: refinements refused on %s:%d: no $%s to check them by, and the address is not "
                    "loopback", host, port, KEY_ENV)
    threading.Thread(target=server.serve_forever, name="lengthwise-plugin-port", daemon=True).start()
    return server


__all__ = ["KEY_ENV", "MAX_BODY", "REFINE_PATH", "PluginServer", "RefinementInbox", "serve_plugin"]
