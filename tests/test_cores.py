"""Core sets for CPU engines: vLLM's bind syntax parsed, a child pinned whole before it execs, and cores claimed by
processes that start on their own (Ray Serve replicas) without two holding the same ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from serving.launch.cores import claim_cores, parse_cores, pin_to

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


def test_claims_take_disjoint_cores_until_none_is_left_and_a_dead_holders_cores_come_free(tmp_path):
    """One core a claim: each claim gets a core no open claim holds, the next after the last gets None; a claim closed,
    or held by a process that was killed, frees its core for the next claimant (the kernel drops the lock)."""
    cores = sorted(os.sched_getaffinity(0))
    held = [claim_cores(1, tmp_path) for _ in cores]
    assert all(h is not None for h in held)
    assert sorted(c for h in held for c in h.cores) == cores  # disjoint, every core once
    assert claim_cores(1, tmp_path) is None
    held[0].release()
    again = claim_cores(1, tmp_path)
    assert again is not None and again.cores == held[0].cores
    for h in held[1:] + [again]:
        h.release()

    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from serving.launch.cores import claim_cores
        got = claim_cores(len({cores!r}), Path({str(tmp_path)!r}))
        print(sorted(got.cores), flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert holder.stdout.readline().strip() == str(cores)  # it holds every core
        assert claim_cores(1, tmp_path) is None and claim_cores(len(cores), tmp_path) is None
    finally:
        holder.kill()
        holder.wait()
    freed = claim_cores(len(cores), tmp_path)
    assert freed is not None and sorted(freed.cores) == cores
    freed.release()
    assert claim_cores(len(cores) + 1, tmp_path) is None and claim_cores(0, tmp_path) is None


def test_pin_process_pins_threads_already_running_and_their_children():
    """Linux pins one thread at a time: every thread of the process is pinned, including one started before, and a
    process that thread starts afterwards inherits the cores."""
    core = max(os.sched_getaffinity(0))
    code = textwrap.dedent(f"""
        import os, subprocess, sys, threading
        from serving.launch.cores import pin_process
        seen, go = [], threading.Event()
        def other():
            go.wait()
            seen.append(sorted(os.sched_getaffinity(0)))
            seen.append(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'],
                                       capture_output=True, text=True).stdout.strip())
        t = threading.Thread(target=other)
        t.start()
        pin_process({{{core}}})
        go.set()
        t.join()
        print(sorted(os.sched_getaffinity(0)), *seen)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=os.getcwd())
    assert out.stdout.split() == [f"[{core}]"] * 3
