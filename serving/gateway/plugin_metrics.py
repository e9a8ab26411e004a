"""The scheduler plug-ins' counters on the gateway's ``/metrics``, one ``engine`` label per engine.

Each engine's plug-in serves its counters from the engine process (:mod:`serving.engine.metrics`); the
gateway fetches them when it is scraped and re-exports them, so one Prometheus target shows the
gateway and every engine's scheduler. An engine that does not answer in time is left out of that
scrape and counted in ``lengthwise_gateway_plugin_scrape_errors_total``.
"""

from __future__ import annotations

import asyncio

import httpx
from prometheus_client.parser import text_string_to_metric_families

PREFIX = "lengthwise_scheduler_"


def _labels(labels: dict[str, str]) -> str:
    esc = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    return "{" + ",".join(f'{k}="{v}"' for k, v in esc.items()) + "}"


def relabel(text: str, engine: str) -> dict[str, tuple[str, str, list[str]]]:
    """Parse one engine's exposition; returns name -> (type, help, sample lines with ``engine`` added)."""
    out: dict[str, tuple[str, str, list[str]]] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(PREFIX):
            continue
        lines = [f"{s.name}{_labels({**s.labels, 'engine': engine})} {s.value!r}" for s in fam.samples
                 if not s.name.endswith("_created")]
        # as generate_latest writes them: a counter's HELP/TYPE name carries _total, like its sample
        out[fam.name + "_total" if fam.type == "counter" else fam.name] = (fam.type, fam.documentation, lines)
    return out


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
    merged: dict[str, tuple[str, str, list[str]]] = {}
    failed = []
    for engine, fams in results:
        if fams is None:
            failed.append(engine)
            continue
        for name, (typ, doc, lines) in fams.items():
            merged.setdefault(name, (typ, doc, []))[2].extend(lines)
    text = []
    for name, (typ, doc, lines) in sorted(merged.items()):
        text += [f"# HELP {name} {doc}", f"# TYPE {name} {typ}", *lines]
    return ("\n".join(text) + "\n").encode() if text else b"", failed
