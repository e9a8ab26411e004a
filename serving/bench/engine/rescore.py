"""Score engine replays again from their files: ``python -m serving.bench.engine.rescore``.

A GPU run is scarce and may be cut short, or finish in pieces (a replay re-run alone on another machine). Every replay
leaves its job and its output in the bench's work dir; this scores any of them the way ``bench engine`` scores its
own: the SLO and TFS from a calibration profile, the predictions rebuilt from the same preset, trace and seed (and
checked against the ones the job carried), each run set beside its simulation on the fitted step model.

    python -m serving.bench.engine.rescore --preset h200-llama8b --profile WORK/step_profile.csv \\
        --run stock=WORK/stock-r3.97.out.json --run lengthwise=WORK/lengthwise-r3.97-0.out.json --json scored.json

Each ``--run POLICY=OUT.json`` (``POLICY`` ``stock``, or a plug-in policy: ``lengthwise``, ``sarathi``) is read with
its job file beside it (``X.out.json`` → ``X.job.json``); ``--predictor`` names the arm's predictions when they are
not the preset's main ones (``oracle``). A replay of the first N requests of a rate is scored against those N.

A planned run (``--seeds``, ``--stock-again``) also writes every request of every replay beside its JSON; that file
alone is scored again on every SLO kind, at the run's SLO or at another scale:

    python -m serving.bench.engine.rescore --records bench_engine.records.json.gz --slo-scale 4 --json rescored.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from serving.bench.engine import bench, plan
from serving.bench.engine.presets import PRESETS
from serving.perf.latency import FittedLatency


def score(preset: str, profile: Path, runs: list[tuple[str, str, Path]], console: Console,
          arrivals: str = "poisson") -> list[dict[str, Any]]:
    """Each ``(policy, predictor spec or "", OUT.json)`` scored; returns one row per run. ``arrivals``: the bench's
    ``--arrivals`` (the replays' arrival times are rebuilt from it, the preset and the seed)."""
    cfg = bench.EngineBenchConfig(**{k: v for k, v in PRESETS[preset].items() if k in bench.EngineBenchConfig.model_fields},
                                  arrivals=arrivals)
    wl, _ = bench._trace(cfg, console)
    cfg = bench._with_cap(cfg, wl)
    setup, arms = bench._setup(cfg, wl, FittedLatency.from_csv(profile), console)
    by_spec = {a.predictor.spec if hasattr(a.predictor, "spec") else cfg.predictor: a for a in arms}
    rows = []
    for policy, spec, out_path in runs:
        job = json.loads(out_path.with_name(out_path.name.replace(".out.json", ".job.json")).read_text())
        out = json.loads(out_path.read_text())
        arm = by_spec.get(spec) if spec else arms[0]
        if arm is None:
            raise SystemExit(f"rescore: no arm with predictor {spec!r} in preset {preset}: {', '.join(by_spec)}")
        ids = {r["id"] for r in job["requests"]}
        rate = _rate_of(job)
        at = [r for r in setup.at_rate(rate) if r.rid in ids]
        preds = [p for r, p in zip(setup.requests, arm.predictions) if r.rid in ids]
        carried = [r["extra_args"]["pred_len"] for r in sorted(job["requests"], key=lambda r: r["id"])]
        rebuilt = [p.length for r, p in sorted(zip(at, preds), key=lambda x: x[0].rid)]
        same = len(carried) == len(rebuilt) and all(abs(a - b) < 1e-6 for a, b in zip(carried, rebuilt))
        arm_setup = dataclasses.replace(setup, predictor=arm.predictor, predictions=preds)
        m = bench._compared(out, at, arm_setup, policy, "vllm" if policy == "stock" else policy, cfg.max_tokens)
        rows.append({"run": str(out_path), "policy": policy, "predictor": spec or arm.label, "rate": rate,
                     "requests": len(at), "predictions_match_job": same, **m.to_dict()})
    return rows


def _rate_of(job: dict[str, Any]) -> float:
    """The rate a job's arrivals were drawn at (its tag says ``r<rate>``)."""
    return float(re.findall(r"r(\d+(?:\.\d+)?)", job["tag"])[-1])


def table(rows: list[dict[str, Any]], console: Console) -> None:
    t = Table(title="engine replays scored from their files")
    for col in ("rate", "requests", "policy", "predictor", "goodput r/s", "JCT SLO att.", "TTFT+TPOT att.",
                "norm. lat. s/tok", "JCT mean s", "JCT p99 s", "preempt", "lost", "sim JCT err", "sim thru err", "preds = job"):
        t.add_column(col, justify="right")
    for r in rows:
        e = r["extra"]["sim_error"]
        t.add_row(f"{r['rate']:g}", str(r["requests"]), r["policy"], r["predictor"], f"{r['goodput_rps']:.3f}",
                  f"{r['slo_attainment']:.1%}", f"{r['ttft_tpot_attainment']:.1%}", f"{r['normalized_latency_s']:.4f}",
                  f"{r['jct_mean_s']:.2f}", f"{r['jct_p99_s']:.2f}", f"{r['preemptions']:g}",
                  str(r["extra"]["wrong_or_lost"]), f"{e['jct_mean_s']:+.1%}", f"{e['throughput_rps']:+.1%}",
                  str(r["predictions_match_job"]))
    console.print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.engine.rescore", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="with --run: the preset the run used")
    ap.add_argument("--profile", type=Path, help="with --run: the calibration's step_profile.csv")
    ap.add_argument("--records", type=Path, metavar="FILE",
                    help="instead of --run: a planned run's records file (.records.json.gz), every replay scored again")
    ap.add_argument("--slo-scale", type=float, metavar="S",
                    help="with --records: judge every SLO kind at EcoServe's scale S instead of the run's")
    ap.add_argument("--run", action="append", default=[], metavar="POLICY[+SPEC]=OUT.json",
                    help="a replay's output (its job beside it); +SPEC for another predictor than the preset's main")
    ap.add_argument("--arrivals", default="poisson", metavar="SPEC",
                    help="the run's --arrivals (poisson, gamma:CV, trace-times:TRACE; default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write the rows here")
    a = ap.parse_args(argv)
    console = Console(width=170)
    if a.records:
        if not a.records.is_file():
            ap.error(f"--records {a.records}: no such file")
        if a.slo_scale is not None and not a.slo_scale > 0:
            ap.error(f"--slo-scale must be > 0, got {a.slo_scale}")
        rows = plan.rescore(a.records, a.slo_scale)
        plan.print_table(rows, console)
        _save(rows, a.json, console)
        return 0
    if not (a.preset and a.profile and a.run):
        ap.error("give --records FILE, or --preset, --profile and at least one --run")
    runs = []
    for item in a.run:
        who, _, path = item.partition("=")
        policy, _, spec = who.partition("+")
        if not path or not Path(path).exists():
            ap.error(f"--run {item!r}: give POLICY=OUT.json of an existing output")
        runs.append((policy, spec, Path(path)))
    rows = score(a.preset, a.profile, runs, console, a.arrivals)
    table(rows, console)
    _save(rows, a.json, console)
    return 0


def _save(rows: list[dict[str, Any]], path: Path | None, console: Console) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2, default=float))
        console.print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
