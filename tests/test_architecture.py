"""The layers are a checked contract (pyproject.toml, [tool.importlinter]): no cycles, no upward imports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")
PACKAGES = ("predictor", "training", "registry", "monitoring", "serving")


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
@pytest.mark.parametrize(("module", "line", "broken"), [
    ("serving/policy/kv.py", "from serving.sim.engine import simulate", "serving.policy.kv -> serving.sim.engine"),
    # the registry stores predictor packages: an import the other way, even inside a function, is refused
    ("predictor/sidecar/cache.py", "def _late():\n    from registry.store import configure",
     "predictor.sidecar.cache -> registry.store"),
    ("monitoring/online.py", "import mlflow", "monitoring.online -> mlflow"),
], ids=["policy-imports-simulator", "predictor-imports-registry", "monitoring-imports-mlflow"])
def test_an_upward_import_breaks_the_contract(tmp_path, module: str, line: str, broken: str):
    """The check can fail: a copy of the tree with one forbidden import added is rejected, naming that import."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402,F401\n")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert broken in r.stdout
