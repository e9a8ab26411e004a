"""Placement policies side by side on a simulated fleet: instances needed, and the rate a fleet sustains.

For each scenario, in one process (so ratios are measured side by side):

1. one instance's capacity r1: the highest rate a single instance serves at >= 90% attainment;
2. (a) at a fleet-wide rate (default ``instances`` × r1), each placement's **fewest instances keeping
   >= 99% attainment** (Aladdin's metric), found by scanning fleet sizes, with how many of them it
   actually used (best fit leaves instances idle: what Aladdin would not have opened);
3. (b) each placement's **highest rate ``instances`` instances sustain at >= 90%**;
4. with several gateways (``gateways``), (a) again for each count of replicas sharing the fleet;
5. Eq. 7: instances needed at several rates for the scaling placements, and the fitted k5, c5.

Attainment is Aladdin's by default: a request attains its SLO when both its TTFT and its average
token generation time (ATGT) are within target; ``jct`` switches to EcoServe's JCT SLO.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from serving.bench.sim import describe_setup, line_style
from serving.perf.latency import DecodePoolLatency
from serving.placement.floor import fluid_floor
from serving.placement.scaling import fit_scaling
from serving.sim.cluster import ClusterConfig, simulate_cluster
from serving.sim.metrics import RunMetrics
from serving.sim.scenarios import Setup
from serving.sim.sweep import max_rate

ATTAINMENT = {"ttft-atgt": "ttft_tpot_attainment", "jct": "slo_attainment"}
PLACEMENTS = ("round-robin", "jsq", "least-kv", "p2c", "aladdin", "lengthwise-pack", "lengthwise")
MEASURES = ("a", "b", "eq7")


@dataclass
class PlacementBenchConfig:
    placements: Sequence[str] = PLACEMENTS
    instances: int = 4
    rate: float | None = None            # fleet-wide rate for (a); default instances × r1
    local_policy: str = "vllm"
    slo: str = "ttft-atgt"
    target_a: float = 0.99
    target_b: float = 0.9
    gateways: Sequence[int] = (1,)
    refresh_s: float = 1.0
    scaling_placements: Sequence[str] = ("aladdin", "lengthwise", "jsq")
    scaling_rates: Sequence[float] = (0.5, 1.0, 1.5)  # multiples of the (a) rate
    max_instances: int | None = None     # scan limit for (a); default 4 × instances
    measures: Sequence[str] = MEASURES   # which of (a), (b) and Eq. 7 to run; (a) always runs (the others build on it)
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.slo not in ATTAINMENT:
            raise ValueError(f"--slo must be one of {', '.join(ATTAINMENT)}, got {self.slo!r}")
        if self.instances < 1:
            raise ValueError(f"--instances must be at least 1, got {self.instances}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate must be a positive number of requests per second, got {self.rate}")
        unknown = set(self.measures) - set(MEASURES)
        if unknown or "a" not in self.measures:
            raise ValueError(f"--measures takes a comma list of {', '.join(MEASURES)} that includes a (the others reuse its "
                             f"scan), got {','.join(self.measures)}")
        if any(g < 1 for g in self.gateways):
            raise ValueError(f"--gateways are counts of gateway replicas (>= 1), got {list(self.gateways)}")

    @property
    def key(self) -> str:
        return ATTAINMENT[self.slo]


def run_fleet(setup: Setup, cfg: PlacementBenchConfig, placement: str, n: int, rate: float, gateways: int = 1) -> RunMetrics:
    cc = ClusterConfig(n, placement, cfg.local_policy, gateways=gateways, refresh_s=cfg.refresh_s, seed=cfg.seed)
    m = simulate_cluster(setup.at_rate(rate), setup.predictions, cc, setup.config, setup.kv_blocks, setup.latency, setup.slo,
                         repredict=setup.predictor.repredict)
    m.extra["rate"] = rate
    return m


def instances_needed(run: Callable[[int], RunMetrics], key: str, target: float, start: int, limit: int) -> dict:
    """Fewest fleet size whose attainment reaches ``target``: from ``start``, down one at a time while it passes,
    else up geometrically (×1.5) until one passes, then bisection (attainment rises with the fleet)."""
    seen: dict[int, RunMetrics] = {}

    def ok(n: int) -> bool:
        if n not in seen:
            seen[n] = run(n)
        return getattr(seen[n], key) >= target

    n = max(1, min(start, limit))
    best: int | None = None
    if ok(n):
        while n > 1 and ok(n - 1):
            n -= 1
        best = n
    else:
        lo = n
        while n < limit:
            n = min(limit, max(n + 1, math.ceil(n * 1.5)))
            if ok(n):
                best = n
                break
            lo = n
        while best is not None and best - lo > 1:
            mid = (lo + best) // 2
            if ok(mid):
                best = mid
            else:
                lo = mid
    at = seen.get(best) if best else None
    return {"instances_needed": best,
            "instances_used": at.extra["instances_used"] if at else None,
            "attainment": getattr(at, key) if at else None,
            "tried": {k: round(getattr(m, key), 4) for k, m in sorted(seen.items())},
            "at_needed": _brief(at) if at else None}


def _brief(m: RunMetrics) -> dict:
    d = m.to_dict()
    keep = ("slo_attainment", "ttft_tpot_attainment", "throughput_rps", "goodput_rps", "jct_p50_s", "jct_p99_s", "ttft_p50_s",
            "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "preemptions", "kv_utilization", "batch_size", "makespan_s", "wall_s")
    out = {k: d[k] for k in keep}
    out.update({k: m.extra[k] for k in ("instances", "instances_used", "per_instance_requests", "moves", "placement_stats",
                                        "gateways")})
    return out


def bench_scenario(setup: Setup, cfg: PlacementBenchConfig, console: Console, progress=None) -> dict:
    key, t0 = cfg.key, time.perf_counter()
    tick = progress or (lambda *_: None)

    def fleet(placement: str, n: int, rate: float, gateways: int = 1) -> RunMetrics:
        m = run_fleet(setup, cfg, placement, n, rate, gateways)
        tick(f"{placement} x{n} @ {rate:.3g}/s" + (f" {gateways} gw" if gateways > 1 else ""), getattr(m, key))
        return m

    one = max_rate(lambda r: fleet("jsq", 1, r), setup.scenario.start_rate, target=cfg.target_b, key=key)
    r1 = one["max_rate_at_90_slo"]
    native = setup.native_rate() if setup.scenario.arrival == "trace" else float("nan")
    if cfg.rate:
        rate_a = cfg.rate
    elif r1 > 0:
        rate_a = cfg.instances * r1
    elif native > 0:  # bursty traces: one instance never reaches the target; take the trace at its own pace
        rate_a = native
    else:
        raise ValueError(f"one instance cannot reach {cfg.target_b:.0%} attainment at any rate tried in {setup.scenario.name}; "
                         "give --rate")
    limit = cfg.max_instances or 4 * cfg.instances
    start = max(1, math.floor(rate_a / r1)) if r1 > 0 else 1
    start_b = cfg.instances * r1 if r1 > 0 else rate_a
    policies: dict[str, dict] = {}
    for p in cfg.placements:
        a = instances_needed(lambda n, p=p: fleet(p, n, rate_a), key, cfg.target_a, start, limit)
        b = (max_rate(lambda r, p=p: fleet(p, cfg.instances, r), start_b, target=cfg.target_b, key=key)
             if "b" in cfg.measures else {"max_rate_at_90_slo": None, "curve": []})
        gw = {}
        for g in cfg.gateways:
            if g == 1:
                gw["1"] = a["instances_needed"]
                continue
            gw[str(g)] = instances_needed(lambda n, p=p, g=g: fleet(p, n, rate_a, g), key, cfg.target_a,
                                          a["instances_needed"] or start, limit)["instances_needed"]
        policies[p] = {**a, "max_rate_at_90_slo": b["max_rate_at_90_slo"], "curve": b["curve"], "gateways": gw}
    base = policies.get("jsq", {}).get("instances_needed")
    floor = decode_floor(setup, rate_a)
    for p, r in policies.items():
        n = r["instances_needed"]
        r["fewer_instances_than_jsq"] = (1 - n / base) if base and n else None
        used = r["instances_used"]
        r["fewer_used_than_jsq"] = (1 - used / base) if base and used else None
        r["over_floor"] = n / floor["mean"] if floor and n else None
    scaling = {}
    for p in cfg.scaling_placements:
        if p not in policies or "eq7" not in cfg.measures:
            continue
        pts = []
        for mult in cfg.scaling_rates:
            rr = round(rate_a * mult, 4)
            n = policies[p]["instances_needed"] if mult == 1.0 else instances_needed(
                lambda k, p=p, rr=rr: fleet(p, k, rr), key, cfg.target_a, max(1, math.floor(rr / r1)) if r1 > 0 else 1,
                limit)["instances_needed"]
            if n:
                pts.append((rr, n))
        try:
            scaling[p] = fit_scaling(pts).to_dict()
        except ValueError as exc:
            scaling[p] = {"error": str(exc), "points": [{"rate": r, "instances": n} for r, n in pts]}
    meta = {**describe_setup(setup), "local_policy": cfg.local_policy, "attainment": cfg.slo, "target_a": cfg.target_a,
            "target_b": cfg.target_b, "measures": list(cfg.measures), "instances": cfg.instances, "rate_a": rate_a,
            "single_instance_max_rate": r1, "trace_native_rate": native if native > 0 else None, "gateways": list(cfg.gateways),
            "refresh_s": cfg.refresh_s, "wall_s": time.perf_counter() - t0}
    return {"policies": policies, "scaling": scaling, "floor": floor, "_meta": meta}


def decode_floor(setup: Setup, rate: float) -> dict | None:
    """The fluid floor at ``rate`` (serving/placement/floor.py) for a decode pool; None for a colocated fleet, whose
    steps also carry prompt compute under a TTFT limit, which the floor does not model."""
    if not isinstance(setup.latency, DecodePoolLatency):
        return None
    reqs = setup.at_rate(rate)
    f = fluid_floor([r.arrival for r in reqs], [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs],
                    setup.latency, setup.slo.tpot_s)
    return {**f.to_dict(), "rate": rate}


def print_scenario(name: str, res: dict, console: Console) -> None:
    meta = res["_meta"]
    gws = [g for g in meta["gateways"] if g != 1]
    t = Table(title=f"{name}: (a) fewest instances at >= {meta['target_a']:.0%} {meta['attainment']} attainment at "
                    f"{meta['rate_a']:.3g} req/s; (b) max req/s {meta['instances']} instances sustain at "
                    f">= {meta['target_b']:.0%} (one instance: {meta['single_instance_max_rate']:.3g} req/s; "
                    f"local policy {meta['local_policy']}; {meta['requests']} requests)")
    cols = ["placement", "(a) instances", "used", "vs JSQ", "attain.", "p99 JCT (s)", "p99 TTFT (s)", "(b) max req/s", "b vs JSQ",
            *(f"{g} gw: inst." for g in gws), "moves", "would open"]
    for c in cols:
        t.add_column(c, justify="left" if c == "placement" else "right")
    pol = res["policies"]
    jsq_b = pol.get("jsq", {}).get("max_rate_at_90_slo")
    for p, r in pol.items():
        at = r["at_needed"] or {}
        f = r["fewer_instances_than_jsq"]
        b = r["max_rate_at_90_slo"]
        t.add_row(p, str(r["instances_needed"] or "-"), str(r["instances_used"] or "-"),
                  f"{-f:+.0%}" if f is not None else "-", f"{r['attainment']:.3f}" if r["attainment"] is not None else "-",
                  f"{at.get('jct_p99_s', float('nan')):.3g}", f"{at.get('ttft_p99_s', float('nan')):.3g}",
                  f"{b:.3g}" if b is not None else "-", f"{b / jsq_b:.2f}x" if jsq_b and b is not None else "-",
                  *(str(r["gateways"].get(str(g)) or "-") for g in gws),
                  str(at.get("moves", "-")), str((at.get("placement_stats") or {}).get("would_open", 0)))
    Console(width=max(console.width, 180)).print(t)
    if fl := res.get("floor"):
        over = ", ".join(f"{p} {r['over_floor']:.2f}x" for p, r in pol.items() if r.get("over_floor"))
        console.print(f"  fluid floor at {fl['rate']:.3g} req/s (any placement, free migration): "
                      f"mean {fl['mean']:.2f} instances, peak over a {fl['window_s']:.2g} s decode {fl['peak']:.2f}; "
                      f"(a) over the mean: {over or '-'}")
    for p, s in res["scaling"].items():
        if "k5" in s:
            pts = ", ".join(f"{q['rate']:.3g}/s->{q['instances']}" for q in s["points"])
            console.print(f"  Eq. 7 for {p}: instances = ceil({s['k5']:.3f} x rate + {s['c5']:.2f})  (points {pts})")
        else:
            console.print(f"  Eq. 7 for {p}: not fitted ({s['error']})")


def plot_scenario(name: str, res: dict, path: Path) -> Path:
    pol = res["policies"]
    meta = res["_meta"]
    fig = Figure(figsize=(12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    names = list(pol)
    needed = [pol[p]["instances_needed"] or 0 for p in names]
    used = [pol[p]["instances_used"] or 0 for p in names]
    xs = range(len(names))
    ax1.bar([x - 0.2 for x in xs], needed, width=0.4, label="fleet size needed")
    ax1.bar([x + 0.2 for x in xs], used, width=0.4, label="instances it used")
    if fl := res.get("floor"):
        ax1.axhline(fl["mean"], color="black", ls=":", lw=0.9, label=f"fluid floor, mean ({fl['mean']:.1f})")
        ax1.axhline(fl["peak"], color="grey", ls="--", lw=0.9, label=f"fluid floor, peak ({fl['peak']:.1f})")
    ax1.set_xticks(list(xs), names, rotation=20)
    ax1.set_ylabel(f"instances for >= {meta['target_a']:.0%} attainment")
    ax1.set_title(f"(a) at {meta['rate_a']:.3g} req/s")
    ax1.legend(fontsize=7)
    key = ATTAINMENT[meta["attainment"]]
    for i, p in enumerate(names):
        c = pol[p]["curve"]
        ax2.plot([q["rate"] for q in c], [q[key] for q in c], label=p, **line_style(i))
    ax2.axhline(meta["target_b"], color="grey", ls="--", lw=0.8)
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel(f"{meta['attainment']} attainment")
    ax2.set_title(f"(b) {meta['instances']} instances" + ("" if "b" in meta["measures"] else ": not measured"))
    ax2.legend(fontsize=7)
    fig.suptitle(f"placement on {name} (local policy {meta['local_policy']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def write_json(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=float))
