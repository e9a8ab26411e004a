"""One GPU's replays as a plan: arms × rates × seeds, chosen in order of value to fit a time budget, run one engine
at a time, every request's record kept.

A GPU is lent for minutes. An 8B engine takes about a minute to start and a replay of 300 requests about 40 s, so a
run holds a handful of engines and a dozen replays, and what it can hold is known before it starts: the calibrated
simulator says how long each replay's requests take to drain. So the replays are chosen in order of value while their
estimated time, engine starts included, fits the budget: rate by rate in the order given (the first the most wanted),
seed by seed, the **core** arms — stock, the main arm, the prediction-free baselines (a gain must beat them), stock
again — then the plug-in's other arms on every rate and seed, then the main policy with other predictors (the oracle:
a ceiling, not a baseline a gain must beat). They run engine by engine, so that each engine starts once: stock, the
plug-in's arms, then **stock again** in a second process, whose replays at the same rates and seeds measure how far two
stock runs on this machine part (the noise a ratio carries, measured rather than assumed; stock's two processes
bracket the arms in time), then the other predictors.

A run cut short (a time limit's SIGINT, an engine that died) keeps what finished; a replay the budget cannot hold when
its turn comes is skipped and named.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from serving.bench.engine.sessions import SessionError
from serving.sim.engine import simulate
from serving.sim.scenarios import Setup

STOCK, STOCK_AGAIN = "stock", "stock-again"
DRAIN_MARGIN = 1.15
"""A replay's estimated time: the simulated stock run's makespan times this (the engine's steps vary around the fit)
plus :data:`REPLAY_OVERHEAD_S` (warm-up, emptying the prefix cache, writing the output)."""
REPLAY_OVERHEAD_S = 3.0
KINDS = {"jct": ("slo_attainment", "goodput_rps"), "ttft+tpot": ("ttft_tpot_attainment", "ttft_tpot_goodput_rps")}
"""Each SLO kind's attainment and goodput fields in a run's metrics (SeaLLM's normalised latency has no target: its
mean is reported, lower better)."""
RECORD_COLUMNS = ("rid", "arrival_s", "first_token_s", "finished_s", "tokens", "preemptions")


@dataclasses.dataclass(frozen=True)
class Slot:
    """One replay of the plan: an arm (``stock``, ``stock-again`` or an arm's label) at a rate on a seed."""

    arm: str
    index: int | None  # the arm's index in the bench's arms; None for the two stock processes
    rate: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.arm} at {self.rate:g} req/s, seed {self.seed}"


def value_order(labels: list[str], policies: list[str], ceilings: set[str], rates: list[float], seeds: list[int],
                stock_again: bool) -> list[Slot]:
    """Every replay in order of value (the module doc): rate by rate and seed by seed the core arms (stock, the main
    arm ``labels[0]``, the arms whose policy reads no prediction, stock again); then the plug-in's other arms, then
    the ``ceilings`` (the main policy with other predictors), each rate by rate and seed by seed."""
    from serving.policy.registry import PREDICTION_FREE

    def slot(arm: str, rate: float, seed: int) -> Slot:
        return Slot(arm, None if arm in (STOCK, STOCK_AGAIN) else labels.index(arm), rate, seed)

    core = [STOCK, labels[0], *(a for a, p in zip(labels[1:], policies[1:]) if p in PREDICTION_FREE and a not in ceilings),
            *([STOCK_AGAIN] if stock_again else [])]
    others = [a for a in labels if a not in core and a not in ceilings]
    tiers = [core, others, [a for a in labels if a in ceilings]]
    return [slot(a, r, s) for tier in tiers for r in rates for s in seeds for a in tier]


def run_order(chosen: list[Slot], labels: list[str], ceilings: set[str]) -> list[Slot]:
    """``chosen`` engine by engine: stock, the arms that are not ceilings, stock again, the ceilings; each engine's
    replays in their order of value."""
    engines = [STOCK, *(a for a in labels if a not in ceilings), STOCK_AGAIN, *(a for a in labels if a in ceilings)]
    return sorted(chosen, key=lambda s: (engines.index(s.arm), chosen.index(s)))


def choose(slots: list[Slot], budget_s: float | None, start_s: float, replay_s) -> tuple[list[Slot], list[Slot]]:
    """The replays that fit ``budget_s`` taken in order of value (each engine's first replay also pays ``start_s``),
    and the ones left out. An arm's replay is kept only with stock's at the same rate and seed (its ratio needs it)."""
    chosen: list[Slot] = []
    left: list[Slot] = []
    spent = 0.0
    for slot in slots:
        needs_stock = slot.arm != STOCK and not any(c.arm == STOCK and (c.rate, c.seed) == (slot.rate, slot.seed)
                                                     for c in chosen)
        cost = replay_s(slot) + (0.0 if any(c.arm == slot.arm for c in chosen) else start_s)
        if needs_stock or (budget_s is not None and spent + cost > budget_s):
            left.append(slot)
            continue
        chosen.append(slot)
        spent += cost
    return chosen, left


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every replay in order of value, the ones that fit the budget (in the order they run) and the ones left out."""

    slots: list[Slot]
    order: list[Slot]
    left: list[Slot]
    total_s: float  # the chosen replays' estimated time, engine starts included


def make_plan(labels: list[str], policies: list[str], rates: list[float], seeds: list[int], stock_again: bool,
              budget_s: float | None, start_s: float, replay_s) -> Plan:
    """The plan of a run whose arms are ``labels`` (the main arm first) running ``policies``: the ceilings are the arms
    of the main policy with other predictors; :func:`value_order`, :func:`choose`, :func:`run_order`."""
    ceilings = {a for a, p in zip(labels[1:], policies[1:]) if p == policies[0]}
    slots = value_order(labels, policies, ceilings, rates, seeds, stock_again)
    chosen, left = choose(slots, budget_s, start_s, replay_s)
    total = sum(replay_s(x) for x in chosen) + start_s * len({x.arm for x in chosen})
    return Plan(slots, run_order(chosen, labels, ceilings), left, total)


class ReplayTimes:
    """Each replay's estimated time (:func:`replay_estimate`), once per rate and seed: ``times(slot)``."""

    def __init__(self, setups: dict[int, Setup], max_tokens: int | None) -> None:
        self.setups, self.max_tokens = setups, max_tokens
        self.estimates: dict[tuple[float, int], float] = {}

    def __call__(self, slot: Slot) -> float:
        key = (slot.rate, slot.seed)
        if key not in self.estimates:
            self.estimates[key] = replay_estimate(self.setups[slot.seed], slot.rate, self.max_tokens)
        return self.estimates[key]

    def to_dict(self) -> dict[str, float]:
        return {f"{r:g} req/s, seed {s}": round(v, 1) for (r, s), v in self.estimates.items()}


def replay_estimate(setup: Setup, rate: float, max_tokens: int | None) -> float:
    """How long a replay at ``rate`` takes here: the calibrated simulator's stock makespan with a margin."""
    at = setup.at_rate(rate)
    m = simulate(at, setup.predictions, "vllm", setup.config, setup.kv_blocks, setup.latency, setup.slo,
                 repredict=setup.predictor.repredict, max_tokens=max_tokens)
    return m.makespan_s * DRAIN_MARGIN + REPLAY_OVERHEAD_S


def execute(order: list[Slot], job_of, run, console: Console, deadline: float | None, start_s: float,
            replay_s) -> tuple[dict[Slot, dict[str, Any]], list[dict[str, str]], str | None]:
    """Run ``order``; before each replay, skip it if it would end past ``deadline`` (a monotonic time) by its
    estimate. Returns each finished replay's output, the skipped ones with why, and what cut the run (or None)."""
    outs: dict[Slot, dict[str, Any]] = {}
    skipped: list[dict[str, str]] = []
    started: set[str] = set()
    try:
        for slot in order:
            cost = replay_s(slot) + (0.0 if slot.arm in started else start_s)
            if deadline is not None and time.monotonic() + cost > deadline:
                left = deadline - time.monotonic()
                skipped.append({"replay": slot.name, "why": f"about {cost:.0f} s needed, {left:.0f} s left"})
                console.print(f"[yellow]skipping[/] {slot.name}: about {cost:.0f} s needed, {left:.0f} s of the budget left")
                continue
            console.print(f"[bold]{slot.arm}[/] at {slot.rate:g} req/s, seed {slot.seed}")
            outs[slot] = run([job_of(slot)])[0]
            started.add(slot.arm)
    except (KeyboardInterrupt, SessionError) as exc:
        cut = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        console.print(f"[red]replays cut short[/] ({cut}); keeping the {len(outs)} that finished")
        return outs, skipped, cut
    return outs, skipped, None


def kind_figures(m: dict[str, Any]) -> dict[str, float]:
    """A run's figures on every SLO kind: JCT and TTFT+TPOT attainment and goodput, normalised latency."""
    out = {f"{k}_{what}": m.get(field, float("nan")) for k, fields in KINDS.items()
           for what, field in zip(("attainment", "goodput_rps"), fields)}
    out["normalised_latency_s"] = m.get("normalized_latency_s", float("nan"))
    out["preemptions"] = m.get("preemptions", 0)
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b and np.isfinite(a) and np.isfinite(b) else None


def table_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per arm × rate × seed of the bench's points (:func:`kind_rows`)."""
    runs = []
    for p in points:
        runs.append((STOCK, p["rate"], p.get("seed", 0), "vllm", None, p["stock"]))
        runs += [(label, p["rate"], p.get("seed", 0), a["policy"], a["predictor"], a["run"]) for label, a in p["arms"].items()]
        if p.get("stock_again") is not None:
            runs.append((STOCK_AGAIN, p["rate"], p.get("seed", 0), "vllm", None, p["stock_again"]))
    return kind_rows(runs)


def kind_rows(runs: list[tuple[str, float, int, str, str | None, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per ``(arm, rate, seed, policy, predictor, metrics)`` with every SLO kind, each goodput beside the
    same rate and seed's stock (for ``stock-again``: the noise between two stock processes) and normalised latency as
    stock's over the arm's (above 1: the arm's is lower)."""
    stock = {(rate, seed): kind_figures(m) for arm, rate, seed, _, _, m in runs if arm == STOCK}
    rows = []
    for arm, rate, seed, policy, predictor, m in runs:
        f, base = kind_figures(m), stock.get((rate, seed))
        if base is None:
            continue
        ratios = {f"{k}_goodput_ratio": _ratio(f[f"{k}_goodput_rps"], base[f"{k}_goodput_rps"]) for k in KINDS}
        ratios["normalised_latency_ratio"] = _ratio(base["normalised_latency_s"], f["normalised_latency_s"])
        rows.append({"arm": arm, "rate": rate, "seed": seed, "policy": policy, "predictor": predictor, **f, **ratios})
    return rows


def rescore(path: Path, scale: float | None = None) -> list[dict[str, Any]]:
    """Every replay of a records file scored again on every SLO kind (:func:`kind_rows`): at the SLO the run was judged
    by, or with every target (JCT, TTFT and TPOT alike) rescaled to EcoServe's ``scale``. A request's length is the
    tokens it produced (the bench ends each at its true length, and checks it did)."""
    from serving.perf.slo import SLO
    from serving.sim.metrics import RequestRecord, kinds_and_goodputs

    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    slo = SLO(**doc["slo"])
    if scale is not None:
        k = scale / slo.scale
        slo = SLO(scale, slo.t_p, slo.t_g, slo.ttft_s * k, slo.tpot_s * k)
    runs = []
    for run in doc["runs"]:
        recs = [RequestRecord(rid, arrival, 0, max(1, tokens), slo.jct_limit(max(1, tokens)), first_token=first,
                              last_token=done, finished=done, tokens=tokens)
                for rid, arrival, first, done, tokens, _ in run["rows"]]
        span = max(max((r.finished for r in recs if r.finished is not None), default=0.0)
                   - min((r.arrival for r in recs), default=0.0), 1e-9)
        m = {**kinds_and_goodputs(recs, slo, span), "preemptions": run["preemptions"]}
        runs.append((run["arm"], run["rate"], run["seed"], run.get("policy", run["scheduler"]), run.get("predictor"), m))
    return kind_rows(runs)


def spread(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Stock again against stock, per kind: the largest departure from 1 of the goodput ratio over every rate and
    seed (a gain smaller than that is within this machine's noise), and each pair's ratios."""
    again = [r for r in rows if r["arm"] == STOCK_AGAIN]
    out: dict[str, Any] = {"pairs": [{k: r[k] for k in ("rate", "seed", "jct_goodput_ratio", "ttft+tpot_goodput_ratio",
                                                        "normalised_latency_ratio")} for r in again]}
    for k in (*(f"{k}_goodput_ratio" for k in KINDS), "normalised_latency_ratio"):
        vals = [r[k] for r in again if r[k] is not None]
        out[f"max_departure_{k}"] = max((abs(v - 1.0) for v in vals), default=None)
    return out


def print_table(rows: list[dict[str, Any]], console: Console) -> None:
    """The arm × rate × seed table, every SLO kind."""
    t = Table(title="every arm, rate and seed on every SLO kind (ratios: against stock at the same rate and seed)")
    for col in ("arm", "rate", "seed", "JCT att.", "JCT goodput", "ratio", "TTFT+TPOT att.", "goodput", "ratio",
                "norm. lat. s", "ratio", "preempt."):
        t.add_column(col, justify="left" if col == "arm" else "right")

    def fmt(x: float | None, spec: str) -> str:
        return "n/a" if x is None or not np.isfinite(x) else format(x, spec)

    for r in rows:
        t.add_row(r["arm"], f"{r['rate']:g}", str(r["seed"]), fmt(r["jct_attainment"], ".1%"),
                  fmt(r["jct_goodput_rps"], ".3f"), fmt(r["jct_goodput_ratio"], ".3f"),
                  fmt(r["ttft+tpot_attainment"], ".1%"), fmt(r["ttft+tpot_goodput_rps"], ".3f"),
                  fmt(r["ttft+tpot_goodput_ratio"], ".3f"), fmt(r["normalised_latency_s"], ".4f"),
                  fmt(r["normalised_latency_ratio"], ".3f"), str(r["preemptions"]))
    console.print(t)


def write_records(path: Path, runs: list[tuple[Slot, dict[str, Any]]], predictions: dict[str, dict[str, Any]],
                  slo: dict[str, float], arms: dict[str, tuple[str, str | None]]) -> Path:
    """Every replay's per-request records (arrival, first token, finish, tokens, preemptions; times in seconds from
    the replay's start), every arm's predicted distributions per seed and the SLO the run was judged by, gzipped JSON:
    enough to score any run again on any SLO (:func:`rescore`). ``arms``: each label's policy and predictor."""
    doc = {"columns": list(RECORD_COLUMNS), "slo": slo, "runs": [], "predictions": predictions}
    for slot, out in runs:
        rows = [[x["id"], round(x["arrival"], 4), None if x["first"] is None else round(x["first"], 4),
                 None if x["finished"] is None else round(x["finished"], 4), x["tokens"], x.get("preemptions", 0)]
                for x in sorted(out["records"], key=lambda x: x["id"])]
        policy, predictor = arms.get(slot.arm, ("vllm", None))
        doc["runs"].append({"arm": slot.arm, "rate": slot.rate, "seed": slot.seed, "scheduler": out["scheduler"],
                            "policy": policy, "predictor": predictor,
                            "preemptions": out["preemptions"], "wall_s": out["wall_s"], "rows": rows})
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        json.dump(doc, f, separators=(",", ":"))
    return path


def prediction_rows(requests, preds) -> dict[str, Any]:
    """An arm's predictions as the records file keeps them: the bucket edges once, then per request its id, its point
    prediction and (when it has one) its bucket distribution."""
    edges = next((list(p.edges) for p in preds if p.edges), None)
    return {"edges": edges, "columns": ["rid", "length", "probs"],
            "rows": [[r.rid, round(p.length, 2), [round(q, 4) for q in p.probs] if p.probs else None]
                     for r, p in zip(requests, preds)]}
