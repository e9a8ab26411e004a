"""MuxServe's ChatLMSYS setting: sixteen LLaMA models on 32 A100s at five load levels, the placements MuxServe ran
there, and its own measured results.

Why a module of its own: the fleet benchmark of several models is only worth its ratios once our simulator reproduces
what MuxServe measured on its own cluster. The workload (rates per model and level, and the measured per-model
throughput and latency of MuxServe, spatial partitioning and temporal multiplexing) is a shared data file read in
place; the placements each system ran (which models on which GPU mesh, tensor-parallel sizes, SM shares, KV
fraction) come from MuxServe's benchmark configuration, committed here as ``muxserve_placements.json`` with its
source.

Readings of MuxServe's configuration (its code does not document them):

- ``gpu_memory_utilization`` is the share of the mesh's memory given to the KV cache, not vLLM's share of all
  memory: spatial gives a 30B model on 2 GPUs 0.375 of 160 GB, less than its 65 GB of weights under vLLM's reading,
  so only the KV reading leaves room for the weights.
- ``mps_percentage`` is ``[prefill, decode]``: the SM percentages of the model's two jobs under NVIDIA MPS.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.placement.models.plan import Unit, UnitModel
from serving.sim.scenarios import data_path

TRACE = "traces/muxserve_chatlmsys_day55.json"
PLACEMENTS = Path(__file__).with_name("muxserve_placements.json")
SYSTEMS = ("flexsm", "spatial", "temporal")
MEASURED_KEYS = {"throughput_rps": "throughput", "jct_p99_s": "p99[avg_latency]", "jct_p90_s": "p90[avg_latency]",
                 "ttft_mean_s": "first_token_latency", "tpot_mean_s": "output_per_token_latency"}


class MuxServeDataError(ValueError):
    """The workload file or the placements cannot be read as expected."""


@dataclass(frozen=True)
class ServedLLM:
    """One model of the fleet at one level: its name, LLaMA size and Poisson request rate."""

    name: str
    size: str
    rate: float


@dataclass(frozen=True)
class Level:
    """One load level: its models, the average lengths MuxServe reports, and each system's measured results."""

    name: str
    models: tuple[ServedLLM, ...]
    cluster_gpus: int
    avg_prompt_len: float
    avg_output_len: float
    measured: dict[str, dict[str, dict[str, Any]]]  # system -> model -> MuxServe's fields

    @property
    def total_rate(self) -> float:
        return sum(m.rate for m in self.models)

    def tokens_per_request(self, model: str) -> float:
        """The mean prompt + output tokens of ``model``'s requests: MuxServe's tokens/s over its requests/s. Each model
        answers its own share of the ChatLMSYS conversations, so the means differ (209 to 443 here); the figure is
        the same at every level and under every system, a property of the requests and not of how they were
        served. (Its benchmark, as vLLM's of the time, counts prompt and output tokens in its tokens/s.)"""
        raw = self.measured["spatial"][model]
        return float(raw["tokens_throughput"]) / float(raw["throughput"])

    def measured_row(self, system: str, model: str) -> dict[str, float]:
        """MuxServe's measured figures of ``model`` under ``system``, in our names (:data:`MEASURED_KEYS`)."""
        raw = self.measured[system][model]
        return {ours: float(raw[theirs]) for ours, theirs in MEASURED_KEYS.items()} | {"requests": int(raw["request_num"])}


def load_levels(path: str | Path | None = None) -> dict[str, Level]:
    """Every level of the workload file, in ascending load."""
    p = data_path(TRACE) if path is None else Path(path)
    try:
        raw = json.loads(p.read_text())["workloads"]
        levels = {
            name: Level(name, tuple(ServedLLM(m["name"], m["size"], float(m["rate"])) for m in w["models"]),
                        int(w["cluster_gpus"]), float(w["avg_prompt_len"]), float(w["avg_output_len"]), w["measured"])
            for name, w in raw.items()
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MuxServeDataError(f"{p}: not MuxServe's ChatLMSYS workload file ({type(exc).__name__}: {exc}); set "
                                "LENGTHWISE_DATA to the shared data directory") from None
    return dict(sorted(levels.items(), key=lambda kv: kv[1].total_rate))


def load_placement(level: str, system: str, path: Path = PLACEMENTS) -> tuple[Unit, ...]:
    """The units ``system`` ran at ``level``, as MuxServe's configuration gives them."""
    data = json.loads(path.read_text())["levels"]
    if level not in data or system not in data[level]:
        raise MuxServeDataError(f"no {system} placement for {level} in {path} (levels: {', '.join(data)}; systems: "
                                f"{', '.join(SYSTEMS)})")
    return tuple(
        Unit(u["gpus"], float(u["gpu_memory_utilization"]),
             tuple(UnitModel(m["name"], m["size"], m["tp"], m["mps_percentage"][0] / 100, m["mps_percentage"][1] / 100,
                             m["max_num_seqs"]) for m in u["models"]))
        for u in data[level][system]
    )
