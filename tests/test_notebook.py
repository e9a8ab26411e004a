"""The predictor-quality notebook runs top to bottom against a registered model."""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "predictor_quality.ipynb"


def test_predictor_quality_notebook_executes(trained, tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    os.environ["LENGTHWISE_MODEL_URI"] = f"models:/length-predictor/{trained['registered_version']}"
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ.pop("LENGTHWISE_MODEL_URI", None)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 4  # bar chart, confusion matrix, reliability, error by prompt length
    text = "".join(o.get("text", "") for o in outputs)
    assert "re-evaluated accuracy" in text
