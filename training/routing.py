"""Ship per slice whichever predictor ranked best there: the routing table of a model package.

The report names the best predictor of each slice (``report["recommended"]``, by pairwise ranking accuracy, a tie
kept by the model). Where that is a baseline that can serve (predictor.slices.SERVABLE), its fitted model for that
slice goes into the package as ``slices/<slice>.skops`` and ``meta.json`` records ``routes``; the sidecar then
answers that slice's prompts with it. So the LoRA model ships for a slice only where it beats the strongest cheap
baseline. ``--route-slices fastest`` ships instead the cheapest predictor whose top-1 and Kendall tau on the slice are
within an agreed loss of the slice's best (1 point and 0.02 by default, the same loss a distilled student may give up):
a TF-IDF route costs about 0.4 ms of CPU per prediction against 10-35 ms for the encoder, so where it ranks a slice
nearly as well it serves that slice at a tenth of the cost. ``--route-slices off`` ships the model for every slice and
writes no routes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from predictor.package_meta import update_meta
from predictor.slices import (
    CONSTANT,
    FAST_TIER_DIR,
    FAST_TIER_KEY,
    MODEL,
    ROUTES_KEY,
    SERVABLE,
    SLICES,
    SLICES_DIR,
    TFIDF,
    save_model,
)

RouteMode = Literal["auto", "fastest", "off"]
ROUTE_MODES = ("auto", "fastest", "off")
# What serves a slice, cheapest first: one stored distribution, a sparse linear model, the encoder.
BY_COST = (CONSTANT, TFIDF, MODEL)


def fastest_within(block: Mapping[str, Mapping], max_top1_drop: float, max_tau_drop: float) -> str:
    """The cheapest predictor of one slice's ``block`` (``{name: metrics}``) whose top-1 and Kendall tau are within
    ``max_top1_drop`` and ``max_tau_drop`` of the best of each there (any predictor's, servable or not); the model when
    no cheaper one is, or when the slice has no metrics. A NaN never qualifies."""
    def value(m: Mapping, key: str) -> float:
        v = float(m.get(key, float("nan")))
        return float("-inf") if math.isnan(v) else v

    if not block:
        return MODEL
    best_top1 = max(value(m, "accuracy") for m in block.values())
    best_tau = max(value(m, "kendall_tau") for m in block.values())
    for name in BY_COST:
        m = block.get(name)
        if name == MODEL or (m is not None and value(m, "accuracy") >= best_top1 - max_top1_drop
                             and value(m, "kendall_tau") >= best_tau - max_tau_drop):
            return name
    return MODEL


def ship_routes(package: Path, report: Mapping, fitted: Mapping[str, Mapping[str, object]],
                mode: RouteMode = "auto", max_top1_drop: float = 0.01, max_tau_drop: float = 0.02) -> dict | None:
    """Write each slice's chosen servable baseline into ``package`` and its routing table into ``meta.json``: the
    slice's best ranker (``auto``) or the cheapest within the agreed loss of the best (``fastest``,
    :func:`fastest_within` with ``max_top1_drop`` and ``max_tau_drop``).

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
        best = (recommended.get(part, MODEL) if mode == "auto"
                else fastest_within(slices.get(part, {}), max_top1_drop, max_tau_drop))
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
    by = (report.get("recommended_by") if mode == "auto"
          else f"fastest within top-1 -{max_top1_drop:g} and tau -{max_tau_drop:g} of the slice's best")
    update_meta(package, {ROUTES_KEY: routes, "routes_by": by})
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


def ship_fast_tier(package: Path, report: Mapping, fitted: Mapping[str, Mapping[str, object]]) -> dict | None:
    """Write the TF-IDF model fitted for each slice into ``package`` as its fast tier (``fast/<slice>.skops``) and record
    it in ``meta.json`` with its test metrics per slice: what a saturated sidecar answers with instead of the caller's
    constant fallback (predictor.slices). None when no TF-IDF model was fitted (``--no-baselines``)."""
    models = {part: m for part, m in fitted.get(TFIDF, {}).items() if part in SLICES}
    if not models:
        return None
    files = {}
    for part, model in models.items():
        files[part] = f"{FAST_TIER_DIR}/{part}.skops"
        save_model(model.servable(), Path(package) / files[part])  # type: ignore[attr-defined]
    slices = report.get("slices", {})
    tier = {"predictor": TFIDF, "files": files,
            "test_metrics": {part: dict(slices[part][TFIDF]) for part in files if TFIDF in slices.get(part, {})}}
    update_meta(package, {FAST_TIER_KEY: tier})
    return tier
