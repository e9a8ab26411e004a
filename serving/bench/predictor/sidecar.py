"""``lengthwise bench sidecar``: latency and throughput of the prediction sidecar under closed-loop load.

The sidecar runs as its own process (started here on a free 127.0.0.1 port, or reached with ``--url``)
and this process is the client: at each concurrency level N, N workers each keep exactly one
``POST /v1/predict`` in flight with real ShareGPT prompts (the latest human turn; the sidecar truncates
to the model's input budget as in training). Reported per level: p50/p99 latency as the client sees it,
predictions per second, the mean micro-batch size (from ``/metrics``) and the sidecar's CPU seconds per
prediction (its process CPU time over the window). Client and server share the machine, as they would
beside an engine; the client's own CPU time is reported too, so the reader can judge the competition.

The fallback rate is what the gateway would see at that load: the share of predictions slower than its prediction
timeout (``lengthwise serve --predictor-timeout-ms``; a request whose prediction is late runs on the fallback length),
failed ones included. Each request carries that timeout as the gateway sends it (``x-lengthwise-timeout-ms``), so the
sidecar drops what it cannot answer in time (504, a fallback) or, with a package that has a fast tier, answers it from
there: the fast-tier column is the share of answers that came from it (``overflow`` in the response).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from predictor.common import default_sharegpt
from serving.launch.process import StartError, free_port, wait_http
from serving.progress import waiting

DEFAULT_LEVELS = "1,8,32,128"
# The gateway's default --predictor-timeout-ms (serving.gateway.settings, which this package may not import; a test
# keeps the two equal).
GATEWAY_PREDICTOR_TIMEOUT_MS = 50.0
# predictor.runtime.PRECISIONS, spelled out so `lengthwise --help` does not import onnxruntime (a test keeps them equal)
PRECISIONS = ("fp32", "int8", "fused", "fused-int8")


class BenchError(RuntimeError):
    """The benchmark cannot run: no data, a sidecar that does not start, an unreachable --url."""


def add_parser(bench_sub) -> argparse.ArgumentParser:
    """Register ``bench sidecar`` under the ``lengthwise bench`` group."""
    p = bench_sub.add_parser(
        "sidecar", help="latency/throughput of predictor-sidecar at several concurrency levels",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start predictor-sidecar as a separate process (or use --url), drive it with closed-loop load of real "
                    "ShareGPT prompts at each concurrency level, and report p50/p99 latency, predictions per second and "
                    "the sidecar's CPU seconds per prediction. Prints a table, writes JSON and a PNG beside it.",
        epilog="examples:\n  lengthwise bench sidecar\n  lengthwise bench sidecar --levels 1,8 --duration 5 --json /tmp/sc.json\n"
               "  lengthwise bench sidecar --url http://127.0.0.1:8100 --levels 32")
    p.add_argument("--model", default="models:/length-predictor@champion", metavar="URI",
                   help="what the started sidecar serves (default: %(default)s)")
    p.add_argument("--url", help="benchmark an already running sidecar instead of starting one (no CPU accounting)")
    p.add_argument("--levels", default=DEFAULT_LEVELS, help="comma-separated concurrency levels (default: %(default)s)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per level (default: %(default)s)")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds before each level (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=2000, help="distinct ShareGPT prompts cycled through (default: %(default)s)")
    p.add_argument("--max-batch", type=int, help="passed to the started sidecar")
    p.add_argument("--max-wait-ms", type=float, help="passed to the started sidecar")
    p.add_argument("--threads", type=int, help="onnxruntime threads per worker of the started sidecar")
    p.add_argument("--workers", type=int, help="inference workers of the started sidecar")
    p.add_argument("--token-budget", type=int, help="padded tokens per onnxruntime run of the started sidecar")
    p.add_argument("--ort-spin", action="store_true", help="passed to the started sidecar")
    p.add_argument("--precision", choices=PRECISIONS, help="passed to the started sidecar")
    p.add_argument("--no-fast-tier", action="store_true", help="passed to the started sidecar: drop late prompts (504) "
                   "instead of answering them from the package's fast tier (the ablation of that tier)")
    p.add_argument("--max-prompt-tokens", type=int, metavar="N",
                   help="passed to the started sidecar (ablation: a smaller input budget than the model was trained with)")
    p.add_argument("--fallback-ms", type=float, default=GATEWAY_PREDICTOR_TIMEOUT_MS, metavar="MS",
                   help="the gateway's prediction timeout, sent with each request as the gateway sends it "
                        "(x-lengthwise-timeout-ms): predictions slower than this, or dropped by the sidecar for it, count "
                        "as fallbacks (default: %(default)s, the gateway's default)")
    p.add_argument("--json", help="write results here (default: bench-results/sidecar/bench_sidecar.json; PNG beside it)")
    p.set_defaults(func=run_cli)
    return p


def parse_levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise BenchError(f"--levels must be comma-separated integers, got {spec!r}") from None
    if not levels or any(n < 1 or n > 1024 for n in levels):
        raise BenchError(f"--levels must be between 1 and 1024, got {spec!r}")
    return levels


def sharegpt_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` latest human turns of real ShareGPT conversations, shuffled deterministically."""
    from training.data import load_examples

    path = default_sharegpt()
    if not path.exists():
        raise BenchError(f"ShareGPT prompts not found at {path}; set LENGTHWISE_DATA")
    texts = [e.latest for e in load_examples(path, "sharegpt") if e.latest.strip()]
    random.Random(seed).shuffle(texts)
    return texts[:n]


def start_sidecar(model: str, port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "predictor.sidecar", "--model", model, "--port", str(port), "--reload-interval", "0",
           "--log-level", "warning", *extra]
    with open(log_path, "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen | None, log_path: Path | None, timeout: float = 180.0) -> dict:
    """The sidecar's ``/ready`` once it answers 200 (:func:`serving.launch.process.wait_http`), as a :class:`BenchError`
    when it exits first or does not answer in time."""
    try:
        return wait_http(f"{url}/ready", timeout, "ready", proc, "the sidecar", log_path, every_s=0.25).json()
    except StartError as exc:
        raise BenchError(str(exc)) from None

def _batch_counters(url: str) -> tuple[float, float]:
    """(sum, count) of the sidecar's batch-size histogram."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    vals = dict(re.findall(r"^lengthwise_sidecar_batch_size_(sum|count) ([0-9.eE+-]+)$", text, flags=re.MULTILINE))
    return float(vals.get("sum", 0.0)), float(vals.get("count", 0.0))


def _machine_busy_seconds() -> float:
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


class _Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough of the protocol for ``POST /v1/predict``.

    A general client (httpx) costs a few milliseconds of CPU per request in Python; on a 2-core machine that
    is CPU taken from the sidecar being measured. Pre-encoded requests over raw asyncio streams cost
    about a tenth of that, so the numbers describe the server rather than the client.
    """

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, request: bytes, timeout: float = 60.0) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(request)
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), timeout)
        status = int(head[9:12])
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        if length is None:  # no length: read to close (never sent by uvicorn for JSON responses)
            body = await self.reader.read()
            self.close()
        else:
            body = await self.reader.readexactly(int(length[1]))
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def encode_requests(url: str, bodies: list[bytes], timeout_ms: float | None = None) -> list[bytes]:
    """Pre-encoded ``POST /v1/predict`` requests; with ``timeout_ms`` each carries ``x-lengthwise-timeout-ms`` as the
    gateway's do, so the sidecar drops (504) or hands to its fast tier what it cannot answer in time."""
    host = url.split("://", 1)[-1].split("/", 1)[0]
    extra = b"" if timeout_ms is None else b"x-lengthwise-timeout-ms: " + f"{timeout_ms:g}".encode() + b"\r\n"
    return [b"POST /v1/predict HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: " + str(len(b)).encode() + b"\r\n\r\n" + b for b in bodies]


def fallback_rate(latencies_ms: np.ndarray, errors: int, timeout_ms: float) -> float | None:
    """The share of predictions the gateway would replace by its fallback length: those slower than ``timeout_ms``
    and those that failed. None when nothing completed or failed."""
    total = len(latencies_ms) + errors
    return float(((latencies_ms > timeout_ms).sum() + errors) / total) if total else None


async def closed_loop(url: str, requests: list[bytes], concurrency: int, duration: float, warmup: float,
                      timeout_ms: float = GATEWAY_PREDICTOR_TIMEOUT_MS) -> dict:
    """``concurrency`` workers, each with one request in flight; completions inside the window are measured."""
    hostport = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = hostport.rpartition(":")
    lat: list[float] = []
    errors = overflow = 0
    t0 = time.perf_counter()
    start, stop = t0 + warmup, t0 + warmup + duration

    async def worker(i: int) -> None:
        nonlocal errors, overflow
        conn = _Connection(host, int(port or 80))
        k = i
        try:
            while time.perf_counter() < stop:
                req = requests[k % len(requests)]
                k += concurrency
                t = time.perf_counter()
                try:
                    status, body = await conn.post(req)
                    ok = status == 200
                except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError):
                    conn.close()
                    ok, body = False, b""
                done = time.perf_counter()
                if start <= done <= stop:
                    if ok:
                        lat.append(done - t)
                        overflow += b'"overflow":true' in body
                    else:
                        errors += 1
        finally:
            conn.close()

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    ms = np.array(lat) * 1000.0
    arr = ms if lat else np.array([np.nan])
    return {"concurrency": concurrency, "requests": len(lat), "errors": errors,
            "p50_ms": float(np.percentile(arr, 50)), "p99_ms": float(np.percentile(arr, 99)),
            "mean_ms": float(arr.mean()), "throughput_rps": len(lat) / duration,
            "fallback_timeout_ms": timeout_ms, "fallback_rate": fallback_rate(ms, errors, timeout_ms),
            "fast_tier_rate": overflow / len(lat) if lat else None}


def run_level(url: str, bodies: list[bytes], concurrency: int, duration: float, warmup: float, pid: int | None,
              timeout_ms: float = GATEWAY_PREDICTOR_TIMEOUT_MS) -> dict:
    # CPU and batch counters cover warm-up too; scale them by requests completed over the same span
    b_sum0, b_n0 = _batch_counters(url)
    busy0 = _machine_busy_seconds()
    cpu0, client0, w0 = _cpu_seconds(pid), time.process_time(), time.perf_counter()
    res = asyncio.run(closed_loop(url, encode_requests(url, bodies, timeout_ms), concurrency, duration, warmup, timeout_ms))
    cpu1, client1, wall = _cpu_seconds(pid), time.process_time(), time.perf_counter() - w0
    busy1 = _machine_busy_seconds()
    b_sum1, b_n1 = _batch_counters(url)
    predictions = b_sum1 - b_sum0  # every prompt predicted in the span, warm-up included
    res["mean_batch"] = (b_sum1 - b_sum0) / (b_n1 - b_n0) if b_n1 > b_n0 else None
    res["cpu_s_per_prediction"] = (cpu1 - cpu0) / predictions if cpu0 is not None and predictions else None
    res["server_cpu_utilisation"] = (cpu1 - cpu0) / wall if cpu0 is not None else None
    res["client_cpu_s_per_request"] = (client1 - client0) / predictions if predictions else None
    # other work on the machine competes for the same cores: how many cores it kept busy meanwhile
    ours = (cpu1 - cpu0 if cpu0 is not None else 0.0) + (client1 - client0)
    res["other_cpu_cores"] = max(0.0, (busy1 - busy0 - ours) / wall) if cpu0 is not None else None
    return res


def bench(model: str, url: str | None, levels: list[int], duration: float, warmup: float, n_prompts: int,
          sidecar_args: list[str], console, timeout_ms: float = GATEWAY_PREDICTOR_TIMEOUT_MS,
          prompts: list[str] | None = None) -> dict:
    """Run every level against one sidecar; returns the JSON report."""
    proc = None
    with tempfile.TemporaryDirectory(prefix="bench-sidecar-") as tmp:
        log_path = Path(tmp) / "sidecar.log"
        if url is None:
            url = f"http://127.0.0.1:{free_port()}"
            proc = start_sidecar(model, int(url.rsplit(":", 1)[1]), log_path, sidecar_args)
        try:
            if prompts is None:
                with waiting(console, "loading ShareGPT prompts ..."):  # while the sidecar starts
                    prompts = sharegpt_prompts(n_prompts)
            bodies = [json.dumps({"prompt": p}).encode() for p in prompts]
            with waiting(console, f"waiting for the sidecar at {url} ..."):
                ready = wait_ready(url, proc, log_path if proc else None, timeout=180.0 if proc else 15.0)
            report = {"model": ready.get("model_uri", model), "model_name": ready.get("model_name"),
                      "model_version": ready.get("model_version"), "url": url, "started_sidecar": proc is not None,
                      "sidecar_args": sidecar_args, "duration_s": duration, "warmup_s": warmup, "prompts": len(bodies),
                      "cpus": os.cpu_count(), "fallback_timeout_ms": timeout_ms, "levels": {}}
            for n in levels:
                with waiting(console, f"concurrency {n}: {warmup + duration:.0f} s of closed-loop load ..."):
                    report["levels"][str(n)] = run_level(url, bodies, n, duration, warmup, proc.pid if proc else None,
                                                         timeout_ms)
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return report


def print_table(report: dict, console) -> None:
    t = Table(title=f"predictor-sidecar: {report['model_name']} v{report['model_version']}, {report['cpus']} CPUs, "
                    f"{report['duration_s']:.0f} s per level")
    t.caption = ("sidecar CPU: its process CPU time per prediction; other cores: CPU used by other processes on the "
                 "machine during the level (competition for the same cores); fallback: share of predictions slower "
                 f"than the gateway's {report.get('fallback_timeout_ms', GATEWAY_PREDICTOR_TIMEOUT_MS):g} ms timeout or "
                 "failed (each request carries it, as the gateway's do); fast tier: share of answers from the package's "
                 "fast tier")
    for c in ("concurrency", "requests", "errors", "p50 ms", "p99 ms", "predictions/s", "fallback", "fast tier", "mean batch",
              "sidecar CPU ms/pred", "client CPU ms/req", "other cores"):
        t.add_column(c, justify="right")
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for lv in report["levels"].values():
        t.add_row(str(lv["concurrency"]), str(lv["requests"]), str(lv["errors"]), fmt(lv["p50_ms"], ".1f"),
                  fmt(lv["p99_ms"], ".1f"), fmt(lv["throughput_rps"], ".0f"), fmt(lv.get("fallback_rate"), ".1%"),
                  fmt(lv.get("fast_tier_rate"), ".1%"), fmt(lv["mean_batch"], ".1f"),
                  fmt(lv["cpu_s_per_prediction"] and lv["cpu_s_per_prediction"] * 1e3, ".2f"),
                  fmt(lv["client_cpu_s_per_request"] and lv["client_cpu_s_per_request"] * 1e3, ".2f"),
                  fmt(lv.get("other_cpu_cores"), ".2f"))
    console.print(t)


def plot(report: dict, path: Path) -> Path:
    from matplotlib.figure import Figure

    lv = list(report["levels"].values())
    x = [v["concurrency"] for v in lv]
    fig = Figure(figsize=(9, 3.6))
    a, b = fig.subplots(1, 2)
    a.plot(x, [v["p50_ms"] for v in lv], "o-", label="p50")
    a.plot(x, [v["p99_ms"] for v in lv], "s-", label="p99")
    answered = any(v["requests"] for v in lv)  # none answered (every one dropped past its timeout): no latency to log-scale
    a.set(xscale="log", yscale="log" if answered else "linear", xlabel="concurrent clients", ylabel="latency (ms)",
          title="latency" if answered else "latency (none answered)")
    a.legend()
    b.plot(x, [v["throughput_rps"] for v in lv], "o-")
    b.set(xscale="log", xlabel="concurrent clients", ylabel="predictions / s", title="throughput")
    for ax in (a, b):
        ax.set_xticks(x, [str(v) for v in x])
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def run_cli(a: argparse.Namespace) -> int:
    console = Console(width=max(Console().width, 140))
    extra = [f for flag, v in (("--max-batch", a.max_batch), ("--max-wait-ms", a.max_wait_ms), ("--threads", a.threads),
                               ("--workers", a.workers), ("--token-budget", a.token_budget), ("--precision", a.precision),
                               ("--max-prompt-tokens", a.max_prompt_tokens))
             if v is not None for f in (flag, str(v))] + (["--ort-spin"] if a.ort_spin else []) \
        + (["--no-fast-tier"] if a.no_fast_tier else [])
    try:
        levels = parse_levels(a.levels)
        if not a.duration > 0 or a.warmup < 0:
            raise BenchError("--duration must be positive and --warmup non-negative")
        if not a.fallback_ms > 0:
            raise BenchError(f"--fallback-ms must be positive, got {a.fallback_ms:g}")
        report = bench(a.model, a.url.rstrip("/") if a.url else None, levels, a.duration, a.warmup, a.prompts, extra, console,
                       a.fallback_ms)
    except BenchError as exc:
        print(f"lengthwise bench sidecar: error: {exc}", file=sys.stderr)
        return 2
    print_table(report, console)
    out = Path(a.json) if a.json else Path("bench-results") / "sidecar" / "bench_sidecar.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    png = plot(report, out.with_suffix(".png"))
    console.print(f"wrote {out} and {png}")
    return 0
