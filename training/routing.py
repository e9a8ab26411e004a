"""Ship per slice whichever predictor ranked best there: the routing table of a model package.

The report names the best predictor of each slice (``report["recommended"]``, by pairwise ranking accuracy, a tie
kept by the model). Where that is a baseline that can serve (predictor.slices.SERVABLE), its fitted model for that
slice goes into the package as ``slices/<slice>.skops`` and ``meta.json`` records ``routes``; the sidecar then
answers that slice's prompts with it. So the LoRA model ships for a slice only where it beats the strongest cheap
baseline. ``--route-slices off`` ships the model for every slice and writes no routes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from predictor.runtime import META_FILE
from predictor.slices import MODEL, ROUTES_KEY, SERVABLE, SLICES, SLICES_DIR, save_model

RouteMode = Literal["auto", "off"]
ROUTE_MODES = ("auto", "off")


def ship_routes(package: Path, report: Mapping, fitted: Mapping[str, Mapping[str, object]],
                mode: RouteMode = "auto") -> dict | None:
    """Write each slice's winning servable baseline into ``package`` and its routing table into ``meta.json``.

    ``fitted`` is ``{baseline name: {slice: fitted baseline}}`` (what :func:`training.baselines.fit_sliced` fitted);
    each route records the predictor, its file (for a baseline) and its test metrics on that slice. A slice whose
    winner cannot serve, or was not fitted for it, or that the test split did not hold, is the model's. Returns the
    table (None with ``mode="off"``: nothing written, the package serves the model alone).
    """
    if mode not in ROUTE_MODES:
        raise ValueError(f"route mode must be one of {', '.join(ROUTE_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    slices, recommended = report.get("slices", {}), report.get("recommended", {})
    routes: dict[str, dict] = {}
    for part in SLICES:
        best = recommended.get(part, MODEL)
        model = fitted.get(best, {}).get(part) if best in SERVABLE else None
        if model is None:
            best = MODEL
        route: dict = {"predictor": best}
        if model is not None:
            route["file"] = f"{SLICES_DIR}/{part}.skops"
            save_model(model.servable(), Path(package) / route["file"])  # type: ignore[attr-defined]
        if best in slices.get(part, {}):
            route["test_metrics"] = dict(slices[part][best])
        routes[part] = route
    meta_path = Path(package) / META_FILE
    meta = json.loads(meta_path.read_text())
    meta[ROUTES_KEY] = routes
    meta["routes_by"] = report.get("recommended_by")
    meta_path.write_text(json.dumps(meta, indent=2, default=float))
    return routes


def served_slice_metrics(report: Mapping, routes: Mapping | None) -> dict[str, dict]:
    """Per slice, the test metrics of the predictor that serves it (the model's where nothing is routed): what the
    registry records as the slice's offline figure, which online feedback on that slice is compared with."""
    out = {}
    for part, block in report.get("slices", {}).items():
        if part == "all":
            continue
        who = (routes or {}).get(part, {}).get("predictor", MODEL)
        if who in block:
            out[part] = block[who]
    return out
