"""``lengthwise replay``: send real prompts to an OpenAI-compatible endpoint at their arrival times and report.

The client side of the serving endpoint. Prompts come from a text workload (default: the ShareGPT first turns in
``$LENGTHWISE_DATA``, loaded with :func:`serving.sim.workload.load_workload`, which keeps the prompt text); each
request asks for ``max_tokens = min(the trace's real output length, --max-tokens-cap)`` and is sent at its arrival
time (Poisson at ``--rate``, or all at once without it), as a chat completion with the prompt as the user message
(``--no-chat``: a plain completion), streamed so that the time to the first token is measured.

Against ``lengthwise serve`` the report also reads what the gateway decided for each request from its response
headers: the deadline (``x-lengthwise-deadline``, Unix seconds; a request meets its SLO when its last byte arrived
by then), where the predicted length came from (``x-lengthwise-prediction``: ``sidecar``, ``sidecar:fast-tier`` or
``fallback:<reason>``) and the predicted length itself (``x-lengthwise-pred-len``), compared with the tokens actually
generated. Any other OpenAI-compatible server (vLLM's own, for instance) gets the same latency report without those parts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from predictor.common import default_tokenizer
from serving.gateway.sse import sse_data
from serving.progress import logged, waiting

CONTEXT_MARGIN = 64  # tokens kept free for the chat template and tokenizer differences when fitting the context
DEFAULT_MAX_REQUESTS = 100

EPILOG = """\
examples:
  # 24 ShareGPT prompts at 0.5 req/s against a running gateway, answers capped at 128 tokens, report in JSON too
  lengthwise replay --url http://127.0.0.1:8000 --rate 0.5 --max-requests 24 --max-tokens-cap 128 --json replay.json
  # all at once (no --rate), plain completions without streaming, against any OpenAI-compatible server
  lengthwise replay --url http://127.0.0.1:8001 --no-chat --no-stream --max-requests 50
  # another prompt set (AlpacaEval), with SLO targets sent to the gateway as x-slo-* headers
  lengthwise replay --url http://127.0.0.1:8000 --workload $LENGTHWISE_DATA/prompts/alpaca_eval_model_outputs.62models.jsonl.xz \\
      --rate 1 --slo-ttft-ms 2000 --slo-tpot-ms 200

max_tokens per request = --max-tokens (what a client sends; the model decides where its answer ends), or
min(the workload's real output length, --max-tokens-cap) (the trace's lengths, counted with --tokenizer, default:
the served model's own tokenizer when its name is a local directory, else GPT-2). Requests whose prompt and answer do
not fit the model's context (max_model_len from /v1/models, or --max-model-len) are skipped before sending and counted.
SLO: met when the answer ended by the x-lengthwise-deadline the gateway returned; without that header (not a
lengthwise gateway) the report says so. Exit status: 0 when at least one request completed, 1 when none did,
2 for bad input (unreachable --url, bad --rate, missing workload file).
"""


KEY_ENV = "OPENAI_API_KEY"  # where the OpenAI SDK, and so a client of the endpoint, keeps its key


class ReplayError(ValueError):
    """Bad input that stops the replay before it sends anything; the message is one line saying what to fix."""


# --- the workload -------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """One request to send: when, what, and how many tokens to ask for."""

    index: int
    arrival: float  # seconds after the start of the replay
    turns: tuple  # ((role, text), ...) from the workload
    prompt_tokens: int
    trace_output_tokens: int
    max_tokens: int

    def messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": text} for role, text in self.turns]

    def prompt(self) -> str:
        return "\n".join(text for _, text in self.turns)


@dataclass
class Plan:
    jobs: list[Job]
    workload: str
    tokenizer: str
    skipped_context: int  # prompts too long for the model's context, left out before sending
    dropped: int  # rows the loader dropped (zero-length prompt or answer)


def poisson_arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Arrival offsets of a Poisson process at ``rate`` req/s (first at 0), the simulator's for the same seed, so a
    replay and its simulation see the same arrivals; all at 0 without a rate."""
    if rate is None or n == 0:
        return [0.0] * n
    from serving.sim.engine import poisson_arrivals as times

    return [float(t) for t in times(n, rate, seed)]


def plan_jobs(workload: str | Path, *, max_requests: int, max_tokens_cap: int | None, rate: float | None, seed: int,
              tokenizer: str | Path, max_model_len: int | None, max_tokens: int | None = None) -> Plan:
    """The first ``max_requests`` prompts of the workload that fit the context, with arrival times and max_tokens.

    ``max_tokens`` set: every request asks for that many tokens, as a client would, and the answer ends where the
    served model stops; the trace's own output length (another model's answer) then plays no part. Otherwise a
    request asks for ``min(trace length, max_tokens_cap)``, which ends every answer at the trace's length: right for
    replaying a trace's token counts on dummy weights, wrong for judging a length predictor, whose prediction would
    be clamped to the truth."""
    from serving.sim.workload import WorkloadError, load_workload

    if not Path(workload).exists():
        raise ReplayError(f"--workload {workload}: no such file")
    loaded = max_requests
    while True:
        try:  # the loader needs a rate for prompt sets without timestamps; arrivals are drawn again below
            wl = load_workload(workload, arrival="poisson", rate=1.0, max_requests=loaded, tokenizer=str(tokenizer))
        except WorkloadError as exc:
            raise ReplayError(f"--workload: {' '.join(str(exc).split())}") from None
        if not wl.has_text:
            raise ReplayError(f"--workload {workload}: a {wl.kind} file has token counts but no prompt text to send; "
                              "use a ShareGPT or AlpacaEval file")
        fits, skipped = [], 0
        for r in wl.requests:
            want = max_tokens or (min(r.output_tokens, max_tokens_cap) if max_tokens_cap else r.output_tokens)
            if max_model_len is not None and r.prompt_tokens + want + CONTEXT_MARGIN > max_model_len:
                skipped += 1
                continue
            fits.append((r, want))
        if len(fits) >= max_requests or len(wl.requests) < loaded:  # enough, or the file has no more
            break
        loaded *= 2
    fits = fits[:max_requests]
    if not fits:
        raise ReplayError(f"--workload {workload}: no prompt fits the model's context of {max_model_len} tokens")
    arrivals = poisson_arrivals(len(fits), rate, seed)
    jobs = [Job(i, arrivals[i], tuple(r.turns), r.prompt_tokens, r.output_tokens, want) for i, (r, want) in enumerate(fits)]
    return Plan(jobs, wl.name, str(tokenizer), skipped, wl.dropped)


def default_tokenizer_for(model: str) -> Path:
    """The served model's own tokenizer when the model name is a local directory holding one, else GPT-2."""
    p = Path(model).expanduser()
    if p.is_dir() and ((p / "tokenizer.json").exists() or (p / "tokenizer.model").exists()):
        return p
    return default_tokenizer()


# --- the endpoint -------------------------------------------------------------------------------------------------
def probe_endpoint(url: str, timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[str, int | None]:
    """The first model the endpoint serves and its context length (vLLM's ``max_model_len``), from ``/v1/models``."""
    try:
        r = httpx.get(url + "/v1/models", timeout=timeout, headers=headers)
    except httpx.HTTPError as exc:
        raise ReplayError(f"--url {url}: cannot reach {url}/v1/models ({type(exc).__name__}: {exc or 'no answer'})") from None
    if r.status_code == 401:
        raise ReplayError(f"--url {url}: GET /v1/models answered 401: the endpoint wants a key; give it with --api-key "
                          f"or {KEY_ENV}")
    if r.status_code != 200:
        raise ReplayError(f"--url {url}: GET /v1/models answered {r.status_code}: {' '.join(r.text.split())[:200]}")
    try:
        models = r.json()["data"]
        model = models[0]
        return str(model["id"]), (int(model["max_model_len"]) if model.get("max_model_len") else None)
    except (ValueError, KeyError, IndexError, TypeError):
        raise ReplayError(f"--url {url}: /v1/models lists no model (is this an OpenAI-compatible server?)") from None


@dataclass
class Result:
    """What happened to one request (times in seconds; ``sent`` relative to the start of the replay)."""

    index: int
    arrival: float
    max_tokens: int
    trace_output_tokens: int
    prompt_tokens: int
    sent: float = math.nan
    ok: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    jct: float | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    finished_at: float | None = None  # Unix seconds, to compare with the deadline
    deadline: float | None = None  # x-lengthwise-deadline, Unix seconds
    prediction: str | None = None  # x-lengthwise-prediction
    pred_len: int | None = None  # x-lengthwise-pred-len
    engine: str | None = None  # x-lengthwise-engine
    request_id: str | None = None  # x-lengthwise-request-id
    chunks: int = 0

    @property
    def met_slo(self) -> bool | None:
        if self.deadline is None:
            return None
        return bool(self.ok and self.finished_at is not None and self.finished_at <= self.deadline)


@dataclass
class Settings:
    url: str
    model: str
    chat: bool = True
    stream: bool = True
    ignore_eos: bool = False
    temperature: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    timeout_s: float = 600.0
    extra_headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)  # more body fields, set over the ones above


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, KeyError, TypeError):
        return " ".join(body.decode(errors="replace").split())[:300] or "(empty body)"


def _read_headers(res: Result, headers: httpx.Headers) -> None:
    def num(name: str, cast):
        try:
            return cast(headers[name]) if name in headers else None
        except ValueError:
            return None

    res.deadline = num("x-lengthwise-deadline", float)
    res.pred_len = num("x-lengthwise-pred-len", int)
    res.prediction = headers.get("x-lengthwise-prediction")
    res.engine = headers.get("x-lengthwise-engine")
    res.request_id = headers.get("x-lengthwise-request-id")


def request_body(job: Job, s: Settings) -> dict[str, Any]:
    body: dict[str, Any] = {"model": s.model, "max_tokens": job.max_tokens, "stream": s.stream}
    if s.chat:
        body["messages"] = job.messages()
    else:
        body["prompt"] = job.prompt()
    if s.stream:
        body["stream_options"] = {"include_usage": True}
    if s.ignore_eos:
        body["ignore_eos"] = True
    if s.temperature is not None:
        body["temperature"] = s.temperature
    body.update(s.extra_body)
    return body


async def send_one(client: httpx.AsyncClient, job: Job, s: Settings, t_start: float) -> Result:
    """Send one request now and wait for its whole answer; never raises for a failed request."""
    res = Result(job.index, job.arrival, job.max_tokens, job.trace_output_tokens, job.prompt_tokens)
    path = "/v1/chat/completions" if s.chat else "/v1/completions"
    headers = dict(s.extra_headers)
    if s.slo_ttft_ms is not None:
        headers["x-slo-ttft-ms"] = f"{s.slo_ttft_ms:g}"
    if s.slo_tpot_ms is not None:
        headers["x-slo-tpot-ms"] = f"{s.slo_tpot_ms:g}"
    t0 = time.perf_counter()
    res.sent = t0 - t_start
    try:
        if s.stream:
            await _stream(client, s.url + path, request_body(job, s), headers, res, s.chat, t0)
        else:
            r = await client.post(s.url + path, json=request_body(job, s), headers=headers)
            res.status = r.status_code
            _read_headers(res, r.headers)
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {_error_message(r.content)}"
            else:
                data = r.json()
                res.output_tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
                choices = data.get("choices") or [{}]
                res.finish_reason = choices[0].get("finish_reason")
                res.ok = True
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}".strip().rstrip(":") or type(exc).__name__
        res.ok = False
    res.jct = time.perf_counter() - t0
    res.finished_at = time.time()
    if not res.ok:
        res.finished_at = None
    return res


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, res: Result, chat: bool, t0: float) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as r:
        res.status = r.status_code
        _read_headers(res, r.headers)
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {_error_message(await r.aread())}"
            return
        done = False
        async for event_data in sse_data(r.aiter_lines()):  # the gateway's reader, by the SSE spec
            data = event_data.strip()
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if isinstance(event.get("error"), dict):
                res.error = f"stream error: {event['error'].get('message')}"
                return
            if event.get("usage"):
                res.output_tokens = int(event["usage"].get("completion_tokens") or 0)
            for choice in event.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if text:
                    res.chunks += 1
                    if res.ttft is None:
                        res.ttft = time.perf_counter() - t0
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
        if not done:
            res.error = "the stream ended without [DONE]"
            return
        if res.output_tokens is None:  # a server that ignores stream_options: count the chunks
            res.output_tokens = res.chunks
        res.ok = True


async def replay(jobs: list[Job], s: Settings, progress=None) -> tuple[list[Result], float]:
    """Send every job at its arrival time, concurrently; returns the results (in job order) and the wall time."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(s.timeout_s, connect=10.0), limits=limits) as client:
        t_start = time.perf_counter()

        async def at_arrival(job: Job) -> Result:
            delay = job.arrival - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            res = await send_one(client, job, s, t_start)
            if progress is not None:
                progress(res)
            return res

        results = await asyncio.gather(*(at_arrival(j) for j in jobs))
        return list(results), time.perf_counter() - t_start


# --- the report ---------------------------------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    import numpy as np

    return float(np.percentile(values, q))


def _mean(values: list[float]) -> float | None:
    return float(statistics.fmean(values)) if values else None


def summarize(results: list[Result], duration_s: float) -> dict[str, Any]:
    """The report's numbers (JSON-ready). Latencies in seconds; ``None`` where nothing was measured."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = [r.output_tokens or 0 for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    jct = [r.jct for r in ok if r.jct is not None]
    tpot = [(r.jct - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.ttft is not None and r.jct is not None and (r.output_tokens or 0) > 1]
    with_deadline = [r for r in results if r.deadline is not None]
    no_deadline = [r for r in ok if r.deadline is None]
    # SLO attainment over every request that got a deadline, plus failed ones (a failure misses its SLO)
    slo_pool = with_deadline + [r for r in failed if r.deadline is None]
    met = sum(1 for r in with_deadline if r.met_slo)
    predicted = [r for r in ok if r.pred_len is not None and r.output_tokens is not None]
    err = [r.pred_len - r.output_tokens for r in predicted]
    sidecar = [r for r in predicted if (r.prediction or "").startswith("sidecar")]
    sources = Counter(r.prediction or "(no header)" for r in results if r.status is not None)
    errors = Counter((r.error or "").split("\n")[0][:160] for r in failed)
    late = [r.finished_at - r.deadline for r in with_deadline if r.ok and r.finished_at is not None]
    return {
        "requests": {"sent": len(results), "completed": len(ok), "failed": len(failed)},
        "duration_s": duration_s,
        "throughput": {"requests_per_s": len(ok) / duration_s if duration_s > 0 else None,
                       "output_tokens_per_s": sum(out_tokens) / duration_s if duration_s > 0 else None},
        "ttft_s": {"mean": _mean(ttft), "p50": _pct(ttft, 50), "p99": _pct(ttft, 99), "n": len(ttft)},
        "jct_s": {"mean": _mean(jct), "p50": _pct(jct, 50), "p99": _pct(jct, 99), "n": len(jct)},
        "tpot_s": {"mean": _mean(tpot), "p50": _pct(tpot, 50), "p99": _pct(tpot, 99), "n": len(tpot)},
        "output_tokens": {"total": sum(out_tokens), "mean": _mean([float(x) for x in out_tokens]),
                          "asked_max_tokens": sum(r.max_tokens for r in ok),
                          "finish_reasons": dict(Counter(r.finish_reason or "(none)" for r in ok))},
        "slo": {
            "with_deadline": len(with_deadline), "without_deadline": len(no_deadline), "met": met,
            "attainment": met / len(slo_pool) if with_deadline else None,
            "slack_p50_s": -_pct(late, 50) if late else None,  # positive: finished this long before the deadline
        },
        "prediction": {
            "sources": dict(sources), "n": len(predicted),
            "mae_tokens": _mean([abs(e) for e in err]), "bias_tokens": _mean([float(e) for e in err]),
            "under_predicted_share": (sum(1 for e in err if e < 0) / len(err)) if err else None,
            "sidecar_mae_tokens": _mean([abs(r.pred_len - r.output_tokens) for r in sidecar]),
            "clamped_to_max_tokens": sum(1 for r in predicted if r.pred_len == r.max_tokens),
        },
        "errors": dict(errors),
    }


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:,.0f} ms"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:,.2f} s"


def report_table(summary: dict[str, Any], title: str):
    """The report as a rich table (two columns: what, value)."""
    t = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    rq, thr = summary["requests"], summary["throughput"]
    t.add_row("requests sent / completed / failed", f"{rq['sent']} / {rq['completed']} / {rq['failed']}")
    t.add_row("duration", _s(summary["duration_s"]))
    t.add_row("throughput", "-" if thr["requests_per_s"] is None else
              f"{thr['requests_per_s']:.2f} req/s, {thr['output_tokens_per_s']:.1f} output tok/s")
    for name, key in (("TTFT", "ttft_s"), ("JCT (to the last token)", "jct_s")):
        m = summary[key]
        fmt = _ms if key == "ttft_s" else _s
        t.add_row(f"{name} p50 / p99", "- (not streamed)" if not m["n"] else f"{fmt(m['p50'])} / {fmt(m['p99'])}")
    tp = summary["tpot_s"]
    t.add_row("TPOT mean / p50 / p99", "-" if not tp["n"] else f"{_ms(tp['mean'])} / {_ms(tp['p50'])} / {_ms(tp['p99'])}")
    ot = summary["output_tokens"]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(ot["finish_reasons"].items()))
    t.add_row("output tokens (total, mean)", f"{ot['total']:,} of {ot['asked_max_tokens']:,} asked"
              + (f", {ot['mean']:.1f} per request" if ot["mean"] is not None else ""))
    t.add_row("finish reasons", reasons or "-")
    slo = summary["slo"]
    if slo["with_deadline"]:
        missing = f"; {slo['without_deadline']} completed without one" if slo["without_deadline"] else ""
        t.add_row("SLO attainment (done by x-lengthwise-deadline)",
                  f"{slo['attainment']:.0%} ({slo['met']} of {slo['with_deadline']}{missing})")
        if slo["slack_p50_s"] is not None:
            t.add_row("median slack to the deadline", _s(slo["slack_p50_s"]))
    else:
        t.add_row("SLO attainment", "n/a: no x-lengthwise-deadline header (not a lengthwise gateway?)")
    pr = summary["prediction"]
    t.add_row("prediction sources", ", ".join(f"{k} {v}" for k, v in sorted(pr["sources"].items())) or "-")
    if pr["n"]:
        t.add_row("predicted vs actual output tokens",
                  f"MAE {pr['mae_tokens']:.1f}, bias {pr['bias_tokens']:+.1f}, under-predicted {pr['under_predicted_share']:.0%}"
                  + (f" (n={pr['n']})"))
        if pr["clamped_to_max_tokens"]:
            t.add_row("  predictions clamped to max_tokens", f"{pr['clamped_to_max_tokens']} of {pr['n']}")
        if pr["sidecar_mae_tokens"] is not None and pr["sources"].get("sidecar", 0) != pr["n"]:
            t.add_row("  MAE of sidecar predictions only", f"{pr['sidecar_mae_tokens']:.1f}")
    else:
        t.add_row("predicted vs actual output tokens", "n/a: no x-lengthwise-pred-len header")
    for msg, n in summary["errors"].items():
        t.add_row(f"failed x{n}", msg)
    return t


def build_report(plan: Plan, s: Settings, rate: float | None, seed: int, max_tokens_cap: int | None,
                 results: list[Result], duration_s: float, max_tokens: int | None = None) -> dict[str, Any]:
    return {
        "config": {"url": s.url, "model": s.model, "workload": plan.workload, "tokenizer": plan.tokenizer,
                   "rate": rate, "seed": seed, "max_tokens_cap": max_tokens_cap, "max_tokens": max_tokens,
                   "chat": s.chat, "stream": s.stream,
                   "ignore_eos": s.ignore_eos, "slo_ttft_ms": s.slo_ttft_ms, "slo_tpot_ms": s.slo_tpot_ms,
                   "skipped_context": plan.skipped_context},
        "summary": summarize(results, duration_s),
        "requests": [asdict(r) | {"met_slo": r.met_slo} for r in results],
    }


def run_with_progress(jobs: list[Job], s: Settings, console=None) -> tuple[list[Result], float]:
    """:func:`replay` with a progress bar on stderr."""
    console = console or Console(stderr=True)
    failed = 0
    with Progress(TextColumn("[bold]replay[/]"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar, logged(bar, "replay"):
        task = bar.add_task("", total=len(jobs))

        def tick(res: Result) -> None:
            nonlocal failed
            failed += not res.ok
            bar.update(task, advance=1, description=f"failed {failed}" if failed else "")

        return asyncio.run(replay(jobs, s, tick))


# --- the command --------------------------------------------------------------------------------------------------
def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "replay", help="replay real prompts against an OpenAI-compatible endpoint (e.g. lengthwise serve) and report",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Send the prompts of a real workload (default: ShareGPT first turns) to an OpenAI-compatible endpoint at "
                    "their arrival times and report throughput, TTFT, JCT and TPOT percentiles, output tokens and, "
                    "against lengthwise serve, SLO attainment by the gateway's deadlines, prediction sources and "
                    "predicted against actual output lengths.")
    p.add_argument("--url", required=True, help="the endpoint's base URL, e.g. http://127.0.0.1:8000 (without /v1)")
    p.add_argument("--workload", metavar="PATH",
                   help="ShareGPT JSON(.xz) or AlpacaEval JSONL(.xz) prompts (default: the ShareGPT file in $LENGTHWISE_DATA)")
    p.add_argument("--rate", type=float, metavar="R", help="Poisson arrivals at R requests/s (default: all at once)")
    p.add_argument("--max-requests", type=int, default=DEFAULT_MAX_REQUESTS, metavar="N",
                   help="replay the first N prompts that fit the context (default: %(default)s)")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--max-tokens-cap", type=int, metavar="N",
                     help="ask for min(the trace's output length, N) tokens per request (default: no cap)")
    cap.add_argument("--max-tokens", type=int, metavar="N",
                     help="ask for N tokens per request, as a client would: the answer ends where the model stops, "
                          "not at the trace's length (use this to judge a length predictor)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="chat completions with the prompt as the user message (default); --no-chat: /v1/completions")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="stream the answers, which measures TTFT and TPOT (default); --no-stream: whole answers")
    p.add_argument("--model", help="model name to request (default: the first one /v1/models lists)")
    p.add_argument("--tokenizer", metavar="PATH", help="counts prompt and trace output tokens (default: see below)")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="the model's context, to skip prompts that do not fit (default: max_model_len from /v1/models)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="ask vLLM to generate exactly max_tokens (ignore_eos), e.g. for dummy-weight engines")
    p.add_argument("--temperature", type=float, help="sampling temperature (default: the server's)")
    p.add_argument("--slo-ttft-ms", type=float, metavar="MS", help="sent as x-slo-ttft-ms: the gateway's deadline uses it")
    p.add_argument("--slo-tpot-ms", type=float, metavar="MS", help="sent as x-slo-tpot-ms: the gateway's deadline uses it")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default: %(default)s)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get(KEY_ENV),
                   help=f"sent as 'Authorization: Bearer KEY' with every request, for an endpoint with keys (default: "
                        f"${KEY_ENV}, as the OpenAI SDK reads it; a flag shows in ps)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="longest wait for an answer or, streaming, for its next chunk (default: %(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the report (config, summary, every request) here")
    p.set_defaults(func=run)
    return p


def check_args(a: argparse.Namespace) -> None:
    def positive(name: str, value, integer: bool = False) -> None:
        if value is None:
            return
        if not (math.isfinite(value) and value > 0):
            raise ReplayError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value:g}")

    positive("--rate", a.rate)
    positive("--max-requests", a.max_requests, True)
    positive("--max-tokens-cap", a.max_tokens_cap, True)
    positive("--max-tokens", a.max_tokens, True)
    positive("--max-model-len", a.max_model_len, True)
    positive("--timeout", a.timeout)
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        v = getattr(a, name)
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ReplayError(f"--{name.replace('_', '-')} must be a positive number of milliseconds, got {v:g}")
    if not a.url.startswith(("http://", "https://")):
        raise ReplayError(f"--url {a.url}: not an http(s) URL, e.g. http://127.0.0.1:8000")
    a.url = a.url.rstrip("/").removesuffix("/v1")
    if a.json:
        parent = Path(a.json).expanduser().resolve().parent
        if not parent.is_dir():
            raise ReplayError(f"--json {a.json}: directory {parent} does not exist")
    if a.workload and not Path(a.workload).expanduser().exists():
        raise ReplayError(f"--workload {a.workload}: no such file")
    if a.tokenizer and not Path(a.tokenizer).expanduser().exists():
        raise ReplayError(f"--tokenizer {a.tokenizer}: no such file or directory")


def run(a: argparse.Namespace) -> int:
    err = Console(stderr=True)
    try:
        check_args(a)
        from predictor.common import default_sharegpt

        workload = Path(a.workload).expanduser() if a.workload else default_sharegpt()
        if not workload.exists():
            raise ReplayError(f"ShareGPT prompts not found at {workload}; set LENGTHWISE_DATA or give --workload")
        auth = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        model, max_len = probe_endpoint(a.url, headers=auth)
        model = a.model or model
        tokenizer = Path(a.tokenizer).expanduser() if a.tokenizer else default_tokenizer_for(model)
        with waiting(err, f"loading {workload.name} (tokens counted with {tokenizer})..."):
            plan = plan_jobs(workload, max_requests=a.max_requests, max_tokens_cap=a.max_tokens_cap, rate=a.rate,
                             seed=a.seed, tokenizer=tokenizer, max_model_len=a.max_model_len or max_len,
                             max_tokens=a.max_tokens)
    except ReplayError as exc:
        print(f"lengthwise replay: error: {exc}", file=sys.stderr)
        return 2
    s = Settings(a.url, model, chat=a.chat, stream=a.stream, ignore_eos=a.ignore_eos, temperature=a.temperature,
                 slo_ttft_ms=a.slo_ttft_ms, slo_tpot_ms=a.slo_tpot_ms, timeout_s=a.timeout, extra_headers=auth)
    skipped = f", {plan.skipped_context} skipped: too long for the context" if plan.skipped_context else ""
    err.print(f"replaying {len(plan.jobs)} prompts of {plan.workload} to {a.url} ({model}) "
              f"{'at ' + format(a.rate, 'g') + ' req/s (Poisson)' if a.rate else 'all at once'}{skipped}")
    try:
        results, duration = run_with_progress(plan.jobs, s, err)
    except KeyboardInterrupt:
        print("lengthwise replay: interrupted", file=sys.stderr)
        return 130
    report = build_report(plan, s, a.rate, a.seed, a.max_tokens_cap, results, duration, a.max_tokens)
    Console().print(report_table(report["summary"], f"lengthwise replay: {plan.workload} -> {a.url}"))
    if a.json:
        Path(a.json).expanduser().write_text(json.dumps(report, indent=1))
        err.print(f"report written to {a.json}")
    return 0 if report["summary"]["requests"]["completed"] else 1
