"""``make test`` in two lanes: two pytest processes at once, each with its own share of the modules, then the tests that
time a deadline, alone.

Why: one pytest process kept the two cores of the machine the suite is measured on about 64% busy (tests waiting on
engines, streams at a set pace, a soak's arrivals), so half the suite runs beside the other half. Why not pytest-xdist:
the session's shared parts (the engine fleet, the trained model, the Ray application) must each start once, in one
process, and xdist's ``loadgroup`` has no effect under pytest 9.2, so each worker started its own (docs/development.md).

A lane takes whole modules, so a module's fixtures start once. ``LANE_A`` holds the modules of the engine fleet, Ray
and the converted SmolLM2, and others to even the two out (balanced on their measured times); every other module,
the trained model's among them, runs in lane B. A test marked ``alone`` measures a deadline in wall time (a batcher's
spill within 100 ms): in a lane it would also measure the other lane, so it runs after both, by itself.

Usage: ``python -m tests.lanes [pytest arguments]``, e.g. ``python -m tests.lanes -q -m "not slow" tests``: each phase
gets the same arguments and ``--lane``; a lane's lines are printed as they come, prefixed with its name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

LANES = ("a", "b")
ALONE = "alone"

# the engine fleet's modules, Ray's, SmolLM2's, then lighter ones to even the lanes out (measured module times)
LANE_A = frozenset({
    "test_gateway", "test_gateway_auth", "test_gateway_hostile", "test_gateway_overload", "test_replay",  # the fleet
    "test_ray_serve", "test_ray_router", "test_ray_bench", "test_ray_deploy",  # one Ray cluster at a time
    "test_engine_real", "test_target", "test_refine_benches",  # the session's SmolLM2 conversion
    "test_engine_bench", "test_engine_bench_exactlen", "test_engine_bench_steps", "test_relabel",
    "test_relabel_torch", "test_relabel_ceiling", "test_slice_routing", "test_loop", "test_demo_steps", "test_bench_sidecar",
    "test_policy", "test_policy_hostile", "test_policy_host_preempt", "test_placement_hostile",
    "test_baselines_sliced", "test_buckets", "test_evaluate_slices", "test_feedback_store", "test_architecture",
    "test_serve_flags", "test_sidecar_settings", "test_train_config", "test_catalogue",  # the fleet, in its slow test
    "test_sim_workload", "test_placement_engines", "test_fleet_bench",
    "test_calibrate", "test_adopt_guide",  # the fleet; SmolLM2 in the guide's slow test
})


def lane_of(module: str, alone: bool) -> str:
    """The phase a test runs in: ``alone`` for a test that times a deadline, else its module's lane."""
    if alone:
        return ALONE
    return "a" if module in LANE_A else "b"


def _pump(name: str, proc: subprocess.Popen, lock: threading.Lock, t0: float, ended: dict[str, tuple[int, float]]) -> None:
    """Print a phase's lines as they come, prefixed with its name; record its exit status and when it ended."""
    for line in iter(proc.stdout.readline, ""):
        with lock:
            sys.stdout.write(f"{name} | {line}")
            sys.stdout.flush()
    ended[name] = (proc.wait(), time.monotonic() - t0)


# each lane's torch and BLAS math on one thread: two lanes of two threads each on two cores made every thread wait for a
# core (the shared training run took 222 s beside the other lane, 130 s so, 94 s alone; the notebook 158, 41 and 48 s).
# vLLM's CPU engines bind their own threads to the cores they are given; onnxruntime keeps its own count
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


# where lane a lists the tests marked alone it collected: the last phase collects those modules only, not the whole suite
ALONE_FILE = "LENGTHWISE_LANES_ALONE_FILE"


def _run(args: list[str], lane: str, base: Path) -> subprocess.Popen:
    env = {**os.environ, **(ONE_THREAD if lane in LANES else {}), ALONE_FILE: str(base / "alone.txt")}
    return subprocess.Popen([sys.executable, "-m", "pytest", f"--lane={lane}", f"--basetemp={base / lane}", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env)


def main(args: list[str]) -> int:
    """Both lanes at once, then the ``alone`` phase; the exit status is pytest's worst (5, nothing collected, is fine)."""
    base = Path(tempfile.mkdtemp(prefix="lengthwise-tests-"))
    lock, ended = threading.Lock(), {}
    t0 = time.monotonic()
    pumps = [threading.Thread(target=_pump, args=(lane, _run(args, lane, base), lock, t0, ended)) for lane in LANES]
    for t in pumps:
        t.start()
    for t in pumps:
        t.join()
    alone = (base / "alone.txt").read_text().split() if (base / "alone.txt").exists() else []
    if alone:  # the same arguments, the paths replaced by the tests themselves
        paths = [a for a in args if not a.startswith("-") and Path(a.split("::")[0]).exists()]
        _pump(ALONE, _run([a for a in args if a not in paths] + alone, ALONE, base), lock, time.monotonic(), ended)
    bad = {k: rc for k, (rc, _) in ended.items() if rc not in (0, 5)}
    if not bad:  # a failed run's directories are kept to look into
        shutil.rmtree(base, ignore_errors=True)
    print("lanes: " + ", ".join(f"{k} exit {rc} after {s:.0f} s" for k, (rc, s) in ended.items())
          + (f"; FAILED: {', '.join(bad)}" if bad else "; all passed"))
    return max(bad.values(), default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
