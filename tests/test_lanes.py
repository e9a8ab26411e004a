"""``make test``'s lanes (tests/lanes.py): every module has one, and the users of each part the session shares (the
engine fleet, the trained model, the Ray application, the converted SmolLM2) are in one lane, so each part starts once."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from predictor.common import compute_threads
from tests.lanes import ALONE, LANE_A, lane_of

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
SHARED = ("engine_fleet", "trained", "ray_app", "smollm2")


def _users(fixture: str) -> set[str]:
    """The test modules with a test or fixture that takes ``fixture`` as an argument."""
    found = set()
    for path in TESTS.glob("test_*.py"):
        for params in re.findall(r"def \w+\(([^)]*)\)", path.read_text()):
            if fixture in {p.split(":")[0].strip() for p in params.split(",")}:
                found.add(path.stem)
    return found


def test_lane_a_names_modules_that_exist():
    assert LANE_A <= {p.stem for p in TESTS.glob("test_*.py")}, LANE_A - {p.stem for p in TESTS.glob("test_*.py")}


@pytest.mark.parametrize("fixture", SHARED)
def test_the_users_of_a_shared_part_run_in_one_lane(fixture):
    users = _users(fixture)
    assert users, f"no module takes {fixture}: the parts the lanes keep together have changed"
    assert len({lane_of(m, alone=False) for m in users}) == 1, {m: lane_of(m, alone=False) for m in users}


def test_a_deadline_test_runs_alone_whatever_its_module():
    assert lane_of("test_gateway", alone=True) == lane_of("test_batcher", alone=True) == ALONE
    assert lane_of("test_gateway", alone=False) == "a" and lane_of("a_module_added_later", alone=False) == "b"


def test_compute_threads_follow_omp_num_threads_then_affinity(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert compute_threads() == 3
    for unset in ("", "0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert compute_threads() == len(os.sched_getaffinity(0))
