"""Every scheduling policy by name: the one list that CLI help, error messages and tests read (Vidur's registry).

``base.py`` defines the interface and knows no policy; this module imports them all, so adding a policy is one
module under ``serving/policy/`` and one line in :data:`FACTORIES`. Beside the fixed names, ``ecoserve-<flags>``
builds EcoServe with any subset of its ablation switches (D, S, O, P; EcoServe §5.4) and ``oracle`` is the full
``ecoserve`` whose host feeds it true lengths.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from serving.policy.base import Policy, PolicyError, Repredict
from serving.policy.baselines import MaxAllocPolicy, SarathiPolicy, SJFPolicy, VLLMPolicy, VLLMV0Policy
from serving.policy.config import PolicyConfig
from serving.policy.ecoserve import EcoServe
from serving.policy.lengthwise import LengthwisePolicy
from serving.policy.muxserve import MuxServePolicy
from serving.policy.posterior import PosteriorPolicy
from serving.policy.seallm import SeaLLMPolicy

Factory = Callable[[PolicyConfig, int, Repredict | None], Policy]


def _orca(cfg: PolicyConfig, kv_blocks: int, repredict: Repredict | None = None) -> Policy:
    """Orca: max allocation at a fixed batch size, whole prompts (no chunking)."""
    p = MaxAllocPolicy(cfg, kv_blocks, repredict, batch_size=cfg.orca_batch_size, chunked=False)
    p.name = "orca"
    return p


def _lengthwise_point(cfg: PolicyConfig, kv_blocks: int, repredict: Repredict | None = None) -> Policy:
    """``lengthwise`` by another name (the policy of one point prediction), for a bench whose main arm is labelled
    ``lengthwise`` and runs another policy."""
    p = LengthwisePolicy(cfg, kv_blocks, repredict)
    p.name = "lengthwise-point"
    return p


FACTORIES: dict[str, Factory] = {
    "vllm": VLLMPolicy,
    "vllm-v0": VLLMV0Policy,
    "orca": _orca,
    "sarathi": SarathiPolicy,
    "sjf": SJFPolicy,
    "seallm": SeaLLMPolicy,
    "muxserve": MuxServePolicy,
    "fcfs-max-alloc": MaxAllocPolicy,
    "ecoserve": EcoServe,
    "lengthwise": LengthwisePolicy,
    "lengthwise-point": _lengthwise_point,
    "lengthwise-sjf": partial(LengthwisePolicy, late_tier=False),
    "lengthwise-fcfs": partial(LengthwisePolicy, fcfs=True),
    "lengthwise-posterior": PosteriorPolicy,
    "lengthwise-own": partial(PosteriorPolicy, use_prior=False),
    "lengthwise-prior": partial(PosteriorPolicy, use_prediction=False),
    "lengthwise-gittins": partial(PosteriorPolicy, index="gittins"),
}
PREDICTION_FREE = frozenset({"vllm", "vllm-v0", "orca", "sarathi", "seallm", "muxserve", "fcfs-max-alloc"})
"""Policies that read no per-request length prediction: the baselines a gain of prediction must beat."""
ECOSERVE_FLAGS = "ecoserve-<flags>"
ORACLE = "oracle"


def policy_names() -> list[str]:
    """Every name :func:`make_policy` accepts, ``ecoserve-<flags>`` standing for the ablation variants."""
    return sorted(FACTORIES) + [ECOSERVE_FLAGS, ORACLE]


def policy_help() -> str:
    """The names as CLI help and error messages print them."""
    return ", ".join(policy_names()) + f" ({ECOSERVE_FLAGS}: any of the letters D S O P, e.g. ecoserve-SDO)"


def make_policy(name: str, config: PolicyConfig, kv_blocks: int, repredict: Repredict | None = None) -> Policy:
    """Build a policy by name; a name not in :func:`policy_names` is a :class:`PolicyError` listing them."""
    key = name.strip().lower()
    if key == ORACLE:  # the host feeds true lengths; the policy is the full ecoserve
        key = "ecoserve"
    if key in FACTORIES:
        return FACTORIES[key](config, kv_blocks, repredict)
    if key.startswith("ecoserve-"):
        return EcoServe.from_flags(key.split("-", 1)[1], config, kv_blocks, repredict)
    raise PolicyError(f"unknown policy {name!r}; choose one of: {policy_help()}")
