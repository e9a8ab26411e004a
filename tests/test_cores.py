"""Core sets for CPU engines: vLLM's bind syntax parsed, and a child pinned whole before it execs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from serving.cores import parse_cores, pin_to

pytestmark = pytest.mark.unit


def test_bind_values_parse_as_vllm_writes_them():
    assert parse_cores("0") == {0}
    assert parse_cores("0,1") == {0, 1}
    assert parse_cores("2-5") == {2, 3, 4, 5}
    assert parse_cores("0-1,4") == {0, 1, 4}


def test_a_pinned_child_and_its_own_children_run_only_on_the_cores_given():
    """The affinity is set before exec, so the child's children (an engine's engine core and worker) inherit it."""
    core = max(os.sched_getaffinity(0))
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
            "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
            "capture_output=True, text=True).stdout.strip())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         preexec_fn=pin_to({core}))
    assert out.stdout.split() == [f"[{core}]", f"[{core}]"]
    free = subprocess.run([sys.executable, "-c", "import os; print(len(os.sched_getaffinity(0)))"], capture_output=True,
                          text=True, check=True, preexec_fn=pin_to(None))
    assert int(free.stdout) == len(os.sched_getaffinity(0))
