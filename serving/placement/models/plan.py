"""A placement of a fleet's models: GPU meshes (MuxServe's LLM units) and the models each one serves.

A model may be served by several meshes (replicas of a popular model): each holds a ``rate_share`` of its
requests. Within a mesh each model runs as its own engine with its MPS percentages of the SMs and a share of the
mesh's KV pool (``kv_share``; None: by expected demand, where ADBS's quotas would settle).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class UnitModel:
    """A model as a mesh serves it: tensor-parallel size, SM percentages of its prefill and decode jobs, batch cap,
    the share of the model's requests this mesh takes and its share of the mesh's KV pool."""

    name: str
    size: str
    tp: int
    prefill_sm: float
    decode_sm: float
    max_num_seqs: int
    rate_share: float = 1.0
    kv_share: float | None = None


@dataclass(frozen=True)
class Unit:
    """An LLM unit (MuxServe §3.2): a GPU mesh and the models that share it, with the share of the mesh's memory
    given to KV."""

    gpus: int
    kv_fraction: float
    models: tuple[UnitModel, ...]


@dataclass(frozen=True)
class Plan:
    """A placement's answer: its units, the GPUs they hold, and how long the decision took (seconds)."""

    placement: str
    units: tuple[Unit, ...]
    decision_s: float = 0.0
    notes: dict = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return sum(u.gpus for u in self.units)

    def served(self) -> set[str]:
        return {m.name for u in self.units for m in u.models}
