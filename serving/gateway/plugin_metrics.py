"""The scheduler plug-ins' counters on the gateway's ``/metrics``, one ``engine`` label per engine.

Each engine's plug-in serves its counters from the engine process (:mod:`serving.engine.metrics`); the
gateway fetches them when it is scraped and re-exports them, so one Prometheus target shows the
gateway and every engine's scheduler. An engine that does not answer in time is left out of that
scrape and counted in ``lengthwise_gateway_plugin_scrape_errors_total``.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

PREFIX = "lengthwise_scheduler_"


def relabel(text: str, engine: str) -> list[Metric]:
    """Parse one engine's exposition into its plug-in metric families, each sample with ``engine`` added."""
    out = []
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(PREFIX):
            continue
        m = Metric(fam.name, fam.documentation, fam.type)
        for s in fam.samples:
            if not s.name.endswith("_created"):
                m.add_sample(s.name, {**s.labels, "engine": engine}, s.value)
        out.append(m)
    return out


class _Snapshot(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


async def scrape(client: httpx.AsyncClient, targets: dict[str, str], timeout_s: float = 1.0) -> tuple[bytes, list[str]]:
    """Fetch every ``engine -> metrics URL`` concurrently; returns the merged exposition and the engines that failed."""
    async def one(engine: str, url: str):
        try:
            r = await client.get(url, timeout=timeout_s)
            r.raise_for_status()
            return engine, relabel(r.text, engine)
        except (httpx.HTTPError, ValueError):
            return engine, None

    results = await asyncio.gather(*(one(e, u) for e, u in targets.items()))
    merged: dict[str, Metric] = {}
    failed = []
    for engine, fams in results:
        if fams is None:
            failed.append(engine)
            continue
        for fam in fams:
            merged.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type)).samples.extend(fam.samples)
    if not merged:
        return b"", failed
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(list(merged.values())))
    return generate_latest(registry), failed
