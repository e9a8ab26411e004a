"""``make test-compat``'s pure parts (tests/compat.py): which vLLM it tests, which tests it leaves out, how it counts."""

from __future__ import annotations

import re

import pytest

from serving.bench.gpu.pack import VLLM_VERSION
from tests.compat import EXCLUDED, MODULES, ROOT, builds, excluded_for, fold, gpu_extra_version

pytestmark = pytest.mark.unit


def test_the_builds_are_the_gpu_extras_pin_and_the_packs():
    known = builds()
    assert known["cuda-0.32"].version == gpu_extra_version() == "0.32.0"
    assert known["cuda-0.26"].version == VLLM_VERSION
    assert known["cpu"].version is None


def test_every_left_out_test_exists_in_a_module_the_check_runs_and_says_why():
    files = {m.split("::")[0] for m in MODULES}
    for test, _, why in EXCLUDED:
        path, name = test.split("::")
        assert path in files, test
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.MULTILINE), test
        assert why
    assert excluded_for("0.32.0") == [(t, w) for t, p, w in EXCLUDED if not p]
    assert len(excluded_for("0.26.0")) == len(EXCLUDED)


@pytest.mark.parametrize(("phases", "want"), [
    ([("setup", "passed"), ("call", "passed"), ("teardown", "passed")], "passed"),
    ([("setup", "passed"), ("call", "passed"), ("teardown", "failed")], "failed"),
    ([("setup", "failed"), ("teardown", "passed")], "failed"),
    ([("setup", "skipped"), ("teardown", "passed")], "skipped"),
    ([("setup", "passed"), ("call", "failed"), ("teardown", "passed")], "failed"),
])
def test_a_tests_outcome_folds_its_phases(phases, want):
    outcome = None
    for when, result in phases:
        outcome = fold(outcome, when, result)
    assert outcome == want
