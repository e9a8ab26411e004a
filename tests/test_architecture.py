"""The layers are a checked contract (pyproject.toml, [tool.importlinter]): no cycles, no upward imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")
PACKAGES = ("predictor", "training", "registry", "serving")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--config", str(cwd / "pyproject.toml"), "--no-cache"], cwd=cwd, check=False,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(cwd)}, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.unit
def test_layer_contracts_hold():
    r = _lint(ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


@pytest.mark.unit
def test_an_upward_import_breaks_the_contract(tmp_path):
    """The check can fail: a copy of the tree whose policy core imports the simulator is rejected."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    kv = tmp_path / "serving" / "policy" / "kv.py"
    kv.write_text(kv.read_text() + "\nfrom serving.sim.engine import simulate  # noqa: E402,F401\n")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "serving.policy.kv -> serving.sim.engine" in r.stdout
