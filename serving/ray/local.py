"""A local Ray cluster with Serve, for the benches and tests that start the application on one machine.

Why a module of its own: ``lengthwise bench ray`` and the live Ray tests both need a throwaway cluster whose workers
import this checkout, and both must take it down again when the application fails to start.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def local_ray(num_cpus: int, env: dict[str, str] | None = None) -> Iterator[None]:
    """Ray with ``num_cpus`` logical CPUs; its workers get ``env`` and this checkout on ``PYTHONPATH``. Serve and Ray are
    shut down after, also on failure."""
    import ray
    from ray import serve

    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    temp = tempfile.mkdtemp(prefix="lwray-")  # short: Ray's socket paths under it must fit in 107 bytes
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False, _temp_dir=temp,
             runtime_env={"env_vars": {"PYTHONPATH": path, **(env or {})}})
    try:
        yield
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(temp, ignore_errors=True)
