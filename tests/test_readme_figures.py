"""The README's headline figures against the JSON each came from: a figure cannot drift from its source unseen.

Each headline row either names the committed JSON its figures come from, and every figure quoted here is recomputed
from that JSON and found, formatted the same way, in the row; or it says "JSON not kept", so a reader knows the figure
rests on a results page alone.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
NOT_KEPT = "JSON not kept"

pytestmark = pytest.mark.unit


@dataclass(frozen=True)
class Figure:
    """``text`` with its ``{}`` filled by ``value`` (one value, or a tuple for several) of the JSON ``source``."""

    source: str  # under docs/results
    text: str
    value: Callable[[Any], Any]


@cache
def _load(source: str) -> Any:
    return json.loads((RESULTS / source).read_text())


def _seeds(policy: str, ratio: str) -> Callable[[Any], float]:
    return lambda d: d["summary"][policy][ratio]["mean"]


def _tau_at(d: dict, k: int) -> float:
    """The refined Kendall tau at ``k`` of a remaining-length table."""
    return next(r["tau_refined"] for r in d["rows"] if r["k"] == k)


def _goodput(arm: str, side: str = "run") -> Callable[[Any], float]:
    return lambda d: d["points"][0]["arms"][arm][side]["goodput_rps"]


def _gpus_vs(d: dict, theirs: Callable[[dict], int | None]) -> list[float]:
    """Ours against another placement's GPUs, per level where both found a plan."""
    out = []
    for level in d["levels"].values():
        p = level["placements"]
        other = theirs(p)
        if p["lengthwise"]["gpus"] is not None and other is not None:
            out.append(p["lengthwise"]["gpus"] / other - 1)
    return out


def _best_of_theirs(p: dict) -> int | None:
    gpus = [p[s]["gpus"] for s in ("muxserve", "seallm") if p[s]["gpus"] is not None]
    return min(gpus) if gpus else None


def _range_over(sources: tuple[str, ...], theirs: Callable[[dict], int | None]) -> Callable[[Any], tuple[float, float]]:
    def value(_d: Any) -> tuple[float, float]:
        ratios = [r for s in sources for r in _gpus_vs(_load(s), theirs)]
        return min(ratios), max(ratios)
    return value


def _fidelity_range(d: dict) -> tuple[float, float]:
    errors = [lv["flexsm"]["calibrated"]["summary"]["throughput_rps"]["total_error"] for lv in d["levels"].values()]
    return min(errors), max(errors)


def _h200(rate: float, arm: str = "lengthwise") -> Callable[[Any], float]:
    def value(d: dict) -> float:
        point = next(p for p in d["points"] if p["rate"] == rate)
        a = point["arms"][arm]
        return a["run"]["goodput_rps"] / a["stock"]["goodput_rps"]
    return value


def _h200_preemptions(d: dict) -> tuple[int, int]:
    a = next(p for p in d["points"] if p["rate"] == 14.3)["arms"]["lengthwise"]
    return a["stock"]["preemptions"], a["run"]["preemptions"]


GPUS = ("models_gpus.json", "models_gpus_alpaca.json")
ECO = "posterior_seeds_ecoserve-paper_jct.json"

# the first cell of each row that names its JSON -> the figures recomputed from it
ROWS: dict[str, list[Figure]] = {
    "Scheduling, simulated (EcoServe's setting": [
        Figure(ECO, "`lengthwise-posterior` {:.2f}× `sarathi`'s knee", _seeds("lengthwise-posterior", "x_sarathi")),
        Figure(ECO, "`lengthwise` {:.2f}×", _seeds("lengthwise", "x_sarathi")),
        Figure("posterior_seeds_ecoserve-paper_ttft_tpot.json", "TTFT+TPOT {:.2f}×",
               _seeds("lengthwise-posterior", "x_sarathi")),
        Figure("posterior_seeds_ecoserve-paper_ttft_tpot_gamma3.json", "bursty arrivals {:.2f}×",
               _seeds("lengthwise-posterior", "x_sarathi")),
    ],
    "Predictions refined as the answer is written": [
        Figure("remaining_smollm2.json", "tau of what is left {:.2f} at 128 tokens", lambda d: _tau_at(d, 128)),
        Figure("remaining_smollm2.json", "+{:.2f} over prompt-only",
               lambda d: next(r["tau_gap"][0] for r in d["rows"] if r["k"] == 128)),
        Figure("remaining_chatgpt.json", "ChatGPT's {:.2f}", lambda d: _tau_at(d, 128)),
        Figure("sim_refined_jct.json", "JCT {:.2f}×/{:.2f}× unrefined",
               lambda d: (_seeds("lengthwise+refined", "x_lengthwise")(d),
                          _seeds("lengthwise-posterior+refined", "x_lengthwise-posterior")(d))),
        Figure("refine_cost.json", "update p50 {:.0f} ms",
               lambda d: 1e3 * statistics.fmean(a["delay_s"]["p50"] for a in d["arms"] if a["arm"] == "on")),
        Figure("refine_cost.json", "gateway CPU/request {:.2f}×", lambda d: d["summary"]["gateway_cpu_ms_per_request"]["ratio"]),
    ],
    "Several services in one engine (SeaLLM's)": [
        Figure("posterior_seeds_seallm-services_normalised.json", "`lengthwise-posterior` {:.2f}× `seallm`'s knee",
               _seeds("lengthwise-posterior", "x_seallm")),
        Figure("posterior_seeds_seallm-services_normalised.json", "`lengthwise` {:.2f}×",
               _seeds("lengthwise", "x_seallm")),
        Figure("engine_services_posterior.json", "goodput {:.2f} r/s", _goodput("lengthwise")),
        Figure("engine_services_posterior.json", "`seallm`'s {:.2f}", _goodput("seallm")),
        Figure("engine_services_posterior.json", "`sarathi` {:.2f}", _goodput("sarathi")),
    ],
    "Several models on a fleet": [
        Figure("models_fidelity.json", "total throughput {:+.0%} to {:+.0%} of MuxServe's runs", _fidelity_range),
        Figure(GPUS[0], "ours {:+.0%} to {:+.0%} vs `spatial`", _range_over(GPUS, lambda p: p["spatial"]["gpus"])),
        Figure(GPUS[0], "{:+.0%} to {:+.0%} vs the better of MuxServe's and SeaLLM's", _range_over(GPUS, _best_of_theirs)),
        Figure("models_drift.json", "re-placing {:.3f} attained", lambda d: d["arms"]["lengthwise"]["attainment"]),
        Figure("models_drift.json", "once {:.3f}", lambda d: d["arms"]["lengthwise-static"]["attainment"]),
        Figure("models_drift.json", "SeaLLM's {:.3f}", lambda d: d["arms"]["seallm"]["attainment"]),
        Figure("models_on_engines.json", "plan {:.2f}", lambda d: d["plans"]["lengthwise"]["real"]["slo_attainment"]),
        Figure("models_on_engines.json", "none {:.2f}", lambda d: d["plans"]["everywhere"]["real"]["slo_attainment"]),
    ],
    "Predictor on the served model's lengths": [
        Figure("demo/make_demo_predictor.json", "tau {:.3f} pre-trained", lambda d: d["kendall_tau"]),
        Figure("demo/make_demo_predictor.json", "TF-IDF {:.3f}", lambda d: d["baselines"]["tfidf-logreg"]["kendall_tau"]),
    ],
    "The endpoint end to end": [
        Figure("demo/make_demo_serving.json", "{} of {} ShareGPT requests",
               lambda d: (d["replay"]["summary"]["requests"]["completed"], d["replay"]["summary"]["requests"]["sent"])),
        Figure("demo/make_demo_serving.json", "{:.0%} within the gateway's JCT deadline",
               lambda d: d["replay"]["summary"]["slo"]["attainment"]),
    ],
    "KV-bound, 8B shape, one H200": [
        Figure("gpu/h200_llama8b_graphs_bench.json", "{:.2f}× stock's goodput at the knee", _h200(9.51)),
        Figure("gpu/h200_llama8b_graphs_bench.json", "{:.2f}× at 1.5×", _h200(14.3)),
        Figure("gpu/h200_llama8b_graphs_calibrated_prediction.json", "(simulator {:.2f}×, {:.2f}×)",
               lambda d: (_h200(9.51)(d), _h200(14.3)(d))),
        Figure("gpu/h200_llama8b_graphs_bench.json", "preemptions {} → {}", _h200_preemptions),
    ],
}


def _headline_rows() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Headline results"):].split("\n## ", 1)[0]
    return [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith(("| result ", "|---"))]


def _row(start: str) -> str:
    rows = [r for r in _headline_rows() if r.startswith(f"| {start}")]
    assert len(rows) == 1, f"README's headline table has {len(rows)} rows starting {start!r}"
    return rows[0]


def _plain(s: str) -> str:
    return s.replace("\u2212", "-")  # the README writes a minus sign; Python formats a hyphen


@pytest.mark.parametrize("start", list(ROWS))
def test_each_figure_is_what_its_json_gives(start):
    row = _plain(_row(start))
    for fig in ROWS[start]:
        assert f"(docs/results/{fig.source})" in row, f"the row {start!r} does not link {fig.source}"
        value = fig.value(_load(fig.source))
        expected = fig.text.format(*value) if isinstance(value, tuple) else fig.text.format(value)
        assert _plain(expected) in row, f"README row {start!r}: expected {expected!r} from {fig.source}"


def test_every_row_names_its_json_or_says_it_was_not_kept():
    bare = [r[:70] for r in _headline_rows() if NOT_KEPT not in r and not any(r.startswith(f"| {s}") for s in ROWS)]
    assert not bare, f"rows that name no JSON and do not say {NOT_KEPT!r}: {bare}"
    for r in _headline_rows():
        for link in (part.split(")")[0] for part in r.split("](")[1:]):
            if link.endswith(".json"):
                assert (ROOT / link).is_file(), f"{link} linked from the README does not exist"


def test_the_seed_figures_are_means_of_their_seeds():
    """What "3 seeds" means in the rows above: the mean of the three per-seed ratios, not one draw."""
    d = _load(ECO)["summary"]["lengthwise-posterior"]["x_sarathi"]
    assert len(d["values"]) == 3 and d["mean"] == pytest.approx(statistics.fmean(d["values"]))
