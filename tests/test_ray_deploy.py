"""The Serve config file's applications build from their import paths and args, as ``serve run``/KubeRay builds them.

No cluster: Ray validates the file with its own schema (``ServeDeploySchema``), imports each ``import_path``, calls the
builder with ``args`` and builds the application into its deployments (``build_app``), which is what the controller
deploys. What is checked is what got built: the engine deployment's replicas, resources and request router with the
configured placement, the ingress's settings (the predictor URL), the sidecar's model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray")

CONFIG = Path(__file__).resolve().parents[1] / "serving/ray/serve_config.yaml"


def _build(app_cfg):
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve._private.build_app import build_app

    app = call_user_app_builder_with_args_if_necessary(import_attr(app_cfg.import_path), app_cfg.args)
    built = build_app(app, name=app_cfg.name, route_prefix=app_cfg.route_prefix)
    return {d.name: d for d in built.deployments}, built


@pytest.mark.unit
def test_the_example_config_builds_the_applications():
    from ray.serve.schema import ServeDeploySchema

    from serving.gateway.settings import GatewaySettings
    from serving.ray.router import LengthwiseRequestRouter

    cfg = ServeDeploySchema.parse_obj(yaml.safe_load(CONFIG.read_text()))
    apps = {a.name: a for a in cfg.applications}
    assert set(apps) == {"predictor", "lengthwise"} and apps["lengthwise"].route_prefix == "/"

    deps, built = _build(apps["lengthwise"])
    assert set(deps) == {"engine", "ingress"} and built.ingress_deployment_name == "ingress"
    engine = deps["engine"]
    opts = engine.ray_actor_options
    assert engine.num_replicas == 2 and (opts["num_cpus"], opts["num_gpus"]) == (1.0, 0.0)
    from serving.ray.app import replica_env

    env = replica_env(deps["ingress"].init_args[0], 0.0)  # the system's tcmalloc on the CPU build, where installed
    assert opts.get("runtime_env") == ({"env_vars": env} if env else None)
    router = engine._deployment_config.request_router_config
    assert router.get_request_router_class() is LengthwiseRequestRouter
    assert router.request_router_kwargs["placement"] == "lengthwise"
    settings = deps["ingress"].init_args[0]
    assert isinstance(settings, GatewaySettings)
    assert settings.predictor_url == "http://127.0.0.1:8000/predictor" and settings.engines == 2
    assert "--scheduler-cls" in " ".join(engine.init_args[0]) and "./SmolLM2-135M-Instruct" in engine.init_args[0]

    deps, _ = _build(apps["predictor"])
    assert set(deps) == {"sidecar"} and deps["sidecar"].init_args[0] == {"model": "models:/length-predictor@champion"}


@pytest.mark.unit
@pytest.mark.parametrize(("args", "says"), [
    ({"model": "m", "engines": 0}, "engines"),
    ({"model": "m", "placement": "no-such-placement"}, "placement"),
    ({"model": "m", "engine_urls": ["http://127.0.0.1:9"]}, "starts its own engine replicas"),
    ({"engines": 2}, "give --model"),
    ({"model": "m", "engine_gpus": -1}, "engine_gpus"),
    ({"model": "m", "engine_bound": "slo"}, "engine_bound slo is the HTTP backend's"),
    ({"model": "m", "no_such_field": 1}, "no_such_field"),
])
def test_bad_args_fail_the_build_naming_the_field(args, says):
    from serving.ray.deploy import gateway

    with pytest.raises(ValueError, match=says):
        gateway(args)


@pytest.mark.unit
def test_bad_sidecar_args_fail_the_build():
    from serving.ray.deploy import predictor

    with pytest.raises(ValueError, match="no_such_field"):
        predictor({"model": "x", "no_such_field": 1})


@pytest.mark.unit
def test_engine_replicas_pin_their_whole_cpus_on_the_cpu_build_only(monkeypatch):
    """Each engine replica pins itself to ``engine_cpus`` cores on the CPU build; GPU engines, a fraction of a CPU,
    ``pin_engines`` off, a bind the user set or a CUDA build leave it unpinned (0)."""
    from serving.gateway.settings import GatewaySettings
    from serving.ray import app

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(app, "is_cpu_build", lambda: True)
    s = GatewaySettings(model="m")
    assert app.pinned_cores(s, 1.0, 0.0) == 1 and app.pinned_cores(s, 2.0, 0.0) == 2
    assert app.pinned_cores(s, 0.5, 0.0) == 0 and app.pinned_cores(s, 1.0, 1.0) == 0
    assert app.pinned_cores(s.model_copy(update={"pin_engines": False}), 1.0, 0.0) == 0
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")
    assert app.pinned_cores(s, 1.0, 0.0) == 0
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setattr(app, "is_cpu_build", lambda: False)
    assert app.pinned_cores(s, 1.0, 0.0) == 0


@pytest.mark.unit
def test_engine_replicas_start_with_the_systems_tcmalloc_preloaded_on_the_cpu_build(monkeypatch):
    from serving.gateway.settings import GatewaySettings
    from serving.launch.malloc import find_tcmalloc
    from serving.ray import app

    s = GatewaySettings(model="m")
    monkeypatch.setattr(app, "is_cpu_build", lambda: True)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    env = app.replica_env(s, 0.0)
    lib = find_tcmalloc()
    one_device = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the model in the engine core process, as the HTTP engines
    assert env == ({**one_device, "LD_PRELOAD": str(lib)} if lib is not None else one_device)
    assert app.replica_env(s, 1.0) == {}  # a GPU replica: CUDA vLLM brings its own allocator setup and layout
    assert app.replica_env(s.model_copy(update={"engine_malloc": "system"}), 0.0) == one_device
    mp = s.model_copy(update={"engine_args": ["--distributed-executor-backend mp"], "engine_malloc": "system"})
    assert app.replica_env(mp, 0.0) == {}  # vLLM's own CPU layout, asked for
    monkeypatch.setattr(app, "is_cpu_build", lambda: False)
    assert app.replica_env(s, 0.0) == {}
