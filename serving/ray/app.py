"""The Ray Serve application: engine replicas behind ``LengthwiseRequestRouter``, the ingress, and the sidecar.

What runs where: ``settings.engines`` engine replicas (one vLLM engine each, one CPU or GPU each as Ray places them),
routed by :class:`~serving.ray.router.LengthwiseRequestRouter` with ``settings.placement``; ``settings.replicas``
ingress replicas (the gateway's request steps, OpenAI API at ``/``; Ray's HTTP proxy spreads requests over them), each
calling the engines through its own handle and so deciding with its own router; and, when a predictor model is given, the sidecar
at ``/predictor`` as a separate application, whose URL on the local Serve proxy becomes the ingress's
``predictor_url``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from serving.gateway.settings import GatewaySettings
from serving.launch.engines import engine_args, engine_command, is_cpu_build, one_device_env
from serving.launch.malloc import engine_malloc, with_tcmalloc
from serving.ray.engine import EngineReplica
from serving.ray.ingress import Ingress
from serving.ray.router import LengthwiseRequestRouter, TimedPowerOfTwoRouter
from serving.ray.sidecar import ROUTE, SidecarReplica

STATS_PERIOD_S = 0.5  # how often each replica's routing stats are collected
log = logging.getLogger("serving.ray")


def engine_argv(settings: GatewaySettings) -> list[str]:
    """The vLLM arguments of one engine replica: the HTTP backend's (model, scheduler plug-in, policy, CPU defaults)."""
    return engine_command(settings, 0, is_cpu_build())[3:]


ROUTERS = ("lengthwise", "power-of-two")  # the engine deployment's request router: ours, or Ray's default (timed)


def router_config(settings: GatewaySettings, router: str = "lengthwise") -> RequestRouterConfig:
    """The engine deployment's request router: ``LengthwiseRequestRouter`` with the settings' placement, or with
    ``power-of-two`` Ray's default router (timed: the baseline ``lengthwise bench ray`` compares against)."""
    if router == "power-of-two":
        return RequestRouterConfig(request_router_class=TimedPowerOfTwoRouter)
    if router != "lengthwise":
        raise ValueError(f"unknown router {router!r}: one of {', '.join(ROUTERS)}")
    return RequestRouterConfig(
        request_router_class=LengthwiseRequestRouter, request_routing_stats_period_s=STATS_PERIOD_S,
        request_router_kwargs={"placement": settings.placement, "stale_after_s": max(settings.stale_after_s, 4 * STATS_PERIOD_S),
                               "others_pred_len": settings.fallback_tokens, "ingresses": settings.replicas})


def pinned_cores(settings: GatewaySettings, engine_cpus: float, engine_gpus: float) -> int:
    """How many cores each engine replica pins itself to: its whole ``engine_cpus`` on the CPU build with
    ``pin_engines`` (as the HTTP backend pins the engines it starts), 0 (unpinned) for GPU engines, a fraction of a
    CPU, or a ``VLLM_CPU_OMP_THREADS_BIND`` the user set."""
    if (not settings.pin_engines or engine_gpus > 0 or engine_cpus < 1 or not is_cpu_build()
            or "VLLM_CPU_OMP_THREADS_BIND" in os.environ):
        return 0
    return int(engine_cpus)


def replica_env(settings: GatewaySettings, engine_gpus: float) -> dict[str, str]:
    """Environment variables each engine replica's process starts with, on the CPU build as the HTTP backend's engines:
    the model run in the engine core process (``one_device_env``), and the system's tcmalloc first in ``LD_PRELOAD``
    (``engine_malloc``; :mod:`serving.launch.malloc`). The library is looked up on the node that deploys: a node without
    it at that path runs the replica on glibc's malloc (the loader says so)."""
    cpu = engine_gpus == 0 and is_cpu_build()
    env = one_device_env(cpu, engine_args(settings))
    lib = engine_malloc(cpu, settings.engine_malloc, log)
    return {**env, "LD_PRELOAD": with_tcmalloc(os.environ, lib)["LD_PRELOAD"]} if lib is not None else env


def engine_app(settings: GatewaySettings, engine_cpus: float = 1.0, engine_gpus: float = 0.0,
               router: str = "lengthwise") -> Any:
    """The engine deployment, bound: ``settings.engines`` replicas behind ``router`` (see :func:`router_config`), each
    pinned to :func:`pinned_cores` cores of its node and started with :func:`replica_env`."""
    options: dict[str, Any] = {"num_cpus": engine_cpus, "num_gpus": engine_gpus}
    env = replica_env(settings, engine_gpus)
    if env:
        options["runtime_env"] = {"env_vars": env}
    dep = serve.deployment(EngineReplica, name="engine", num_replicas=settings.engines,
                           max_ongoing_requests=2 * settings.engine_seqs, request_router_config=router_config(settings, router),
                           ray_actor_options=options, health_check_period_s=5)
    return dep.bind(engine_argv(settings), settings.fallback_tokens, pinned_cores(settings, engine_cpus, engine_gpus))


def ingress_app(settings: GatewaySettings, engine_cpus: float = 1.0, engine_gpus: float = 0.0,
                router: str = "lengthwise") -> Any:
    """The ingress over the engines, bound (the application ``serve.run`` starts at ``/``): ``settings.replicas`` replicas."""
    dep = serve.deployment(Ingress, name="ingress", num_replicas=settings.replicas, ray_actor_options={"num_cpus": 0},
                           max_ongoing_requests=max(1000, settings.outstanding_bounds(settings.engines)[1]))
    return dep.bind(settings, engine_app(settings, engine_cpus, engine_gpus, router))


def sidecar_app(sidecar: dict[str, Any]) -> Any:
    """The sidecar deployment, bound; ``sidecar`` its settings (``model``: a package directory or ``models:/`` URI)."""
    return serve.deployment(SidecarReplica, name="sidecar", num_replicas=1, ray_actor_options={"num_cpus": 0}).bind(sidecar)


def run(settings: GatewaySettings, sidecar: dict[str, Any] | None = None, engine_cpus: float = 1.0,
        engine_gpus: float = 0.0, router: str = "lengthwise") -> Any:
    """Deploy the sidecar (when given) and the gateway on the connected Ray cluster; returns the ingress handle.

    The ingress reaches the sidecar on its node's Serve proxy, ``http://127.0.0.1:{port}/predictor``.
    """
    if sidecar is not None:
        context = settings.engine_arg("--max-model-len")
        if context is not None and "max_actual_tokens" not in sidecar:  # no answer is longer than the engines' context
            sidecar = {**sidecar, "max_actual_tokens": int(context)}
        serve.run(sidecar_app(sidecar), name="predictor", route_prefix=ROUTE)
        port = serve.context._get_global_client().http_config.port
        settings = settings.model_copy(update={"predictor_url": f"http://127.0.0.1:{port}{ROUTE}"})
    return serve.run(ingress_app(settings, engine_cpus, engine_gpus, router), name="lengthwise", route_prefix="/")
