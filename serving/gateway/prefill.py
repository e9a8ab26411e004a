"""Disaggregated prefill: a prompt is prefilled on a prefill engine, then decoded on the engine placement chooses.

Why: in a decode pool a step costs its decodes and their KV reads, never a neighbour's prompt (a 13k-token
prefill chunk stretches every decode beside it). That is the setting of Aladdin's decode-GPU saving and of
``lengthwise bench placement --scenario *-decode``; with ``--prefill-url`` the gateway serves it.

The hop follows vLLM's own proxy for its KV-transfer connectors (``--kv-transfer-config``): the request goes
to a prefill engine first with ``max_tokens`` 1, no stream and ``kv_transfer_params`` asking for a remote
decode; the engine computes the prompt's KV and hands it to its connector. Its answer's
``kv_transfer_params`` (where the KV is: NixlConnector's engine id, blocks and host) go into the request
that then goes, unchanged otherwise, to the decode engine placement chose, whose connector loads the KV
instead of recomputing it. Connectors that find KV by the prompt itself (ExampleConnector's shared
storage, LMCache) return no parameters and need none. The one generated token is discarded: the decode
engine produces the answer, first token included, so streams and usage are the decode engine's. The prefill
answer's usage gives the prompt's exact token count, which the decode placement then plans with (the
gateway's own count is an estimate without a tokenizer).

Failures: prefill engines are a pool of their own with the decode pool's health checks and retries (JSQ
among them); a prefill engine's 4xx is the client's error and comes back unchanged, and when no prefill
engine is left the client gets a 503 that says so. Nothing is sent to a decode engine until the prefill
succeeded.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from starlette.responses import Response

from serving.gateway.errors import ApiError
from serving.gateway.forward import Forwarder, Outcome
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.pool import EnginePool
from serving.gateway.requests import ClientRequest
from serving.gateway.settings import GatewaySettings
from serving.placement import Job
from serving.policy.hints import HINT_KEYS

# What vLLM's disaggregated-serving proxy asks of a prefill engine: keep the KV for a decode elsewhere.
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
_DROP = ("stream", "stream_options", "max_completion_tokens", "min_tokens", "n", "best_of", "logprobs", "top_logprobs",
         "echo", "kv_transfer_params")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: the decode request's prompt and sampling, one token, one sequence, no stream.

    Of ``vllm_xargs`` only the gateway's scheduling hints go (the prefill engine's plug-in schedules by them); the
    client's own keys are for its answer's sampling (logits processors) and travel to the decode engine alone: on a
    one-token request whose token is discarded they change nothing, and a processor that checks its argument against
    ``max_tokens`` (``bench fleet``'s exact-length one) would refuse ``max_tokens`` 1."""
    out = {k: v for k, v in body.items() if k not in _DROP}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(REMOTE_DECODE))
    if isinstance(body.get("vllm_xargs"), dict):
        hints = {k: v for k, v in body["vllm_xargs"].items() if k in HINT_KEYS}
        if hints:
            out["vllm_xargs"] = hints
        else:
            out.pop("vllm_xargs")
    return out


@dataclasses.dataclass
class Prefilled:
    """A finished prefill: the decode engine's body, and what the response headers report."""

    body: dict[str, Any]
    engine: str
    seconds: float
    prompt_tokens: int | None = None  # the prompt as the engine tokenized it (usage), exact where the gateway estimates


class PrefillHop:
    def __init__(self, pool: EnginePool, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self.pool, self.metrics = pool, metrics
        self.forwarder = Forwarder(pool, settings, metrics)

    async def aclose(self) -> None:
        await self.forwarder.aclose()
        await self.pool.aclose()

    async def run(self, req: ClientRequest, body: dict[str, Any], headers: dict[str, str],
                  job: Job) -> Prefilled | Response:
        """Prefill ``req`` on a prefill engine; the decode body, or the prefill engine's error response for the client.

        ``job`` is the request as the decode placement sees it; a copy with a one-token plan is placed among the
        prefill engines (JSQ by outstanding requests and tokens).
        """
        t0 = time.perf_counter()
        pbody = prefill_body(body)
        preq = dataclasses.replace(req, body=pbody, stream=False, wants_usage=False, max_tokens=1, outputs=1)
        pjob = Job(job.rid, job.prompt_len, 1.0, arrival=job.arrival)
        done: list[Outcome] = []
        try:
            resp = await self.forwarder.forward(preq, pbody, headers, pjob, done.append)
        except ApiError as exc:
            self.metrics.prefill_hops.labels("failed").inc()
            if exc.status == 503:
                raise ApiError(503, f"prefill: {exc.message}", code="prefill_unavailable", headers=exc.headers) from None
            raise
        engine = done[0].engine if done else None
        if resp.status_code != 200:
            self.metrics.prefill_hops.labels("client_error" if resp.status_code < 500 else "failed").inc()
            resp.headers["x-lengthwise-prefill-engine"] = engine or ""
            return resp
        try:
            answer = json.loads(resp.body)
            params = answer.get("kv_transfer_params")
            prompt_tokens = answer.get("usage", {}).get("prompt_tokens")
        except (ValueError, AttributeError):
            params, prompt_tokens = None, None
        seconds = time.perf_counter() - t0
        self.metrics.prefill_hops.labels("ok" if params else "ok_no_transfer_params").inc()
        self.metrics.prefill_latency.observe(seconds)
        decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}  # where the KV is: ours to say, not the client's
        if params:
            decode["kv_transfer_params"] = params
        exact = type(prompt_tokens) is int and prompt_tokens > 0
        return Prefilled(decode, engine or "", seconds, prompt_tokens if exact else None)
