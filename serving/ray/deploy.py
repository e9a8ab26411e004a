"""Application builders for Ray Serve's config files: ``serve run``, ``serve deploy`` and KubeRay's ``RayService``.

A Serve config names each application by ``import_path`` (``serving.ray.deploy:gateway``) and passes it ``args``;
Ray calls the builder with those args and deploys the application it returns. The builders here build the same
applications as ``lengthwise serve --backend ray`` (:mod:`serving.ray.app`), from the same settings:

* :func:`gateway`: the ``lengthwise`` application (the ingress at ``/`` over ``engines`` engine replicas behind
  ``LengthwiseRequestRouter``). Its args are :class:`~serving.gateway.settings.GatewaySettings` fields (``model``,
  ``engines``, ``policy``, ``placement``, ``engine_args``, ``predictor_url``, SLO flags, ...) plus ``engine_cpus`` and
  ``engine_gpus``, the resources of one engine replica (default one CPU, no GPU).
* :func:`predictor`: the ``predictor`` application (the sidecar, route ``/predictor``); its args are the sidecar's
  settings (``model``: a package directory or a ``models:/`` URI).

A config file cannot pass one application's address to another, so ``predictor_url`` is given in the ``lengthwise``
application's args: the sidecar's route on the Serve proxy of the ingress's own node (Ray runs a proxy on every node),
``http://127.0.0.1:8000/predictor`` with Serve's default HTTP port. ``serving/ray/serve_config.yaml`` is an example.

Bad args fail the build, with pydantic's message naming the field, before any replica starts (``serve run`` prints it;
a ``RayService`` reports the application as ``DEPLOY_FAILED``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve import Application

from predictor.sidecar.settings import SidecarSettings
from serving.gateway.settings import GatewaySettings
from serving.ray.app import ingress_app, sidecar_app


def gateway_settings(args: Mapping[str, Any]) -> tuple[GatewaySettings, float, float]:
    """The gateway's settings and one engine replica's CPUs and GPUs, from a config file's ``args``."""
    rest = dict(args)
    cpus, gpus = float(rest.pop("engine_cpus", 1.0)), float(rest.pop("engine_gpus", 0.0))
    if cpus < 0 or gpus < 0:
        raise ValueError(f"engine_cpus and engine_gpus must be >= 0 (got {cpus}, {gpus})")
    settings = GatewaySettings(**rest)
    if settings.models_file is not None:
        raise ValueError("the Ray application serves one model: models_file (a catalogue) is served by lengthwise serve's "
                         "http backend")
    if settings.engine_urls or settings.prefill_urls or settings.prefill_engines:
        raise ValueError("the Ray application starts its own engine replicas: engine_urls, prefill_urls and prefill_engines "
                         "do not apply")
    if settings.engine_bound != "static":
        raise ValueError("engine_bound slo is the HTTP backend's: Ray bounds each engine replica by its max_ongoing_requests")
    return settings, cpus, gpus


def gateway(args: dict[str, Any]) -> Application:
    """The ``lengthwise`` application: the ingress over the engine replicas (see the module docstring for ``args``)."""
    settings, cpus, gpus = gateway_settings(args)
    return ingress_app(settings, cpus, gpus)


def predictor(args: dict[str, Any]) -> Application:
    """The ``predictor`` application: the length predictor's sidecar, its settings checked now rather than on a replica."""
    SidecarSettings(**args)
    return sidecar_app(dict(args))
