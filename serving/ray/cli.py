"""``lengthwise serve --backend ray``: deploy the application on a Ray cluster (a local one by default) and serve it.

The flags are ``lengthwise serve``'s own (model, ``--engines``, ``--policy``, ``--placement``, ``--engine-arg``, prediction
and SLO flags, ``--host``/``--port``), checked the same way before anything starts. The process stays in the foreground
and takes the application down on SIGINT/SIGTERM (and the local cluster it started); errors are one line, exit 2.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from serving.gateway.settings import GatewaySettings

log = logging.getLogger("serving.ray")


def _fail(msg: str) -> int:
    print(f"lengthwise serve: error: {msg}", file=sys.stderr)
    return 2


def serve_ray(settings: GatewaySettings, address: str | None, predictor_model: str | None) -> int:
    """Deploy and serve until a signal; returns the exit code."""
    if settings.models_file is not None:
        return _fail("--backend ray serves one model: a --models catalogue is served by --backend http (the default)")
    if settings.engine_urls or settings.prefill_urls or settings.prefill_engines:
        return _fail("--backend ray starts its own engine replicas: --engine-url, --prefill-url and --prefill-engines do "
                     "not apply")
    if settings.engine_bound != "static":
        return _fail("--engine-bound slo is the HTTP backend's: Ray bounds each engine replica by its "
                     "max_ongoing_requests (2 x --max-num-seqs); leave it out")
    if settings.replica_index:
        return _fail("--backend ray numbers its --replicas ingress replicas itself: leave out --replica-index")
    try:
        import ray
        from ray import serve
    except ImportError:
        return _fail("Ray is not installed here; install the ray extra (pip install -e '.[ray]')")
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        ray.init(address=address, include_dashboard=False) if address else ray.init(include_dashboard=False)
    except (ConnectionError, ValueError, RuntimeError) as exc:
        return _fail(f"cannot connect to the Ray cluster at {address}: {exc}" if address else f"cannot start Ray: {exc}")
    stop = threading.Event()  # after ray.init, which installs a SIGTERM handler of its own that aborts the driver
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        from serving.ray.app import run

        serve.start(http_options={"host": settings.host, "port": settings.port})
        run(settings, {"model": predictor_model} if predictor_model else None)
        log.info("lengthwise on Ray Serve: http://%s:%d/v1 (%d engine replica(s), %d ingress replica(s), placement %s)",
                 settings.host, settings.port, settings.engines, settings.replicas, settings.placement)
        stop.wait()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        try:
            serve.delete("lengthwise")
            serve.delete("predictor")
            if not address:
                serve.shutdown()
        finally:
            ray.shutdown()
