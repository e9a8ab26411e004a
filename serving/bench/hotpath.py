"""``lengthwise bench hotpath``: what one scheduling step costs a policy at 256 running and 1,000 waiting requests.

The policy runs inside vLLM's step loop, so its decision time is added to every step. This drives each policy the
way a host does (add, schedule, update) with the engine's state held at a fixed size: 256 requests running (vLLM's
default ``max_num_seqs``), at least 1,000 waiting, a KV pool that holds them, and every finished request replaced by
a new arrival, so the cost is measured in steady state, completions (and a learning policy's updates) included. The
requests' lengths and predictions are drawn from a fixed seed: a bucket distribution on half of them, a point on the
rest, three services. The policies are interleaved round by round so a noisy machine slows them alike.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from serving.policy.config import PolicyConfig
from serving.policy.registry import make_policy
from serving.policy.request import Prediction, Request

EDGES = (32, 64, 128, 256, 512, 1024)
SETTLE = 1200  # finished requests before the clock starts (each service prior has seen a few hundred lengths)


def _request(rid: int, rng: random.Random, now: float) -> tuple[Request, int]:
    truth = max(1, int(rng.lognormvariate(5.0, 1.0)))
    guess = max(1.0, truth * rng.lognormvariate(0.0, 0.6))
    if rid % 2:
        probs = [rng.random() for _ in range(len(EDGES) + 1)]
        total = sum(probs)
        pred = Prediction(guess, edges=EDGES, probs=tuple(p / total for p in probs))
    else:
        pred = Prediction(guess)
    return Request(rid, now, rng.randint(20, 600), pred, deadline=now + 60.0, service=f"s{rid % 3}",
                   client=f"key-{rid % 7}"), truth


def measure(policy_name: str, steps: int, running: int = 256, waiting: int = 1000, seed: int = 0) -> dict:
    """Mean and median microseconds per step (schedule + update) over ``steps`` steady-state steps."""
    cfg = PolicyConfig(max_num_seqs=running, max_model_len=4096, tfs=2048, max_num_batched_tokens=2048, block_size=16)
    policy = make_policy(policy_name, cfg, kv_blocks=running * 4096 // 16)
    rng = random.Random(seed)
    truth: dict[int, int] = {}
    rid = 0
    now = 0.0

    def arrive() -> None:
        nonlocal rid
        req, n = _request(rid, rng, now)
        truth[rid] = n
        policy.add(req, now)
        rid += 1

    def step() -> tuple[float, int]:
        """One step as a host runs it, timed from schedule to update; a new arrival for each finish, so the queue
        stays at its size. Returns the seconds and the finishes."""
        nonlocal now
        t0 = time.perf_counter()
        plan = policy.schedule(now)
        done = [r for r in plan.tokens if policy.requests[r].generated + 1 >= truth[r]
                and policy.requests[r].computed + plan.tokens[r] == policy.requests[r].seq_len]
        policy.update(plan, done, now)
        dt = time.perf_counter() - t0
        now += 0.02
        for _ in done:
            arrive()
        return dt, len(done)

    for _ in range(running + waiting):
        arrive()
    finished = 0
    while finished < SETTLE:  # past the learning policies' early refreshes: steady state is what every step pays
        finished += step()[1]
    samples = [step()[0] for _ in range(steps)]
    return {"policy": policy_name, "us_mean": statistics.fmean(samples) * 1e6, "us_p50": statistics.median(samples) * 1e6,
            "steps": steps, "running": running, "waiting_at_start": waiting}


def bench_hotpath(policies: list[str], steps: int, rounds: int, json_path: Path, console: Console) -> dict:
    by: dict[str, list[dict]] = {p: [] for p in policies}
    for r in range(rounds):
        for p in policies if r % 2 == 0 else reversed(policies):  # alternate the order: drift hits every policy alike
            by[p].append(measure(p, steps, seed=r))
    t = Table(title=f"scheduling step cost at 256 running, >= 1,000 waiting ({rounds} rounds of {steps} steps)")
    for col in ("policy", "us/step (mean)", "us/step (median)", "x first"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    out = {}
    first = None
    for p, runs in by.items():
        mean = statistics.median(x["us_mean"] for x in runs)
        p50 = statistics.median(x["us_p50"] for x in runs)
        first = first or mean
        out[p] = {"us_per_step_mean": mean, "us_per_step_p50": p50, "rounds": runs}
        t.add_row(p, f"{mean:.0f}", f"{p50:.0f}", f"{mean / first:.2f}")
    console.print(t)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(out, indent=1))
    console.print(f"JSON: {json_path}")
    return out
