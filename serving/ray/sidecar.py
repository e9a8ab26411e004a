"""The length predictor as a Ray Serve deployment: the ``predictor-sidecar`` app itself, served by Ray's HTTP proxy.

Why the same app rather than a handle API of its own: the gateway's request steps already speak the sidecar's HTTP
contract (``/v1/predict`` with its short timeout and fallback, ``/v1/feedback``, ``/ready``, the target-model check),
so the ingress reuses them unchanged with ``predictor_url`` pointing at this deployment's route on the Serve proxy of
its own node (Ray runs a proxy on every node). The replica builds the app (``predictor.sidecar.app.create_app``) once
it is placed (``__serve_build_asgi_app__``); Ray runs its lifespan, which starts the micro-batcher and loads the model
(``/ready`` answers 503 until then). ``@serve.batch`` is not used: the sidecar's own batcher already joins concurrent
prompts into shared onnxruntime runs, by padded-token budget, which ``serve.batch``'s fixed batch size cannot express.
"""

from __future__ import annotations

from typing import Any

from ray import serve

ROUTE = "/predictor"  # the sidecar's route prefix on the Serve proxy


@serve.ingress()
class SidecarReplica:
    """One sidecar replica; ``settings`` are :class:`predictor.sidecar.settings.SidecarSettings` fields."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from predictor.sidecar.settings import SidecarSettings

        self.settings = SidecarSettings(**settings)

    def __serve_build_asgi_app__(self) -> Any:
        from predictor.sidecar.app import create_app
        from predictor.sidecar.cache import parse_uri, resolve

        ref = parse_uri(self.settings.model)
        return create_app(self.settings, ref, resolve(ref))
