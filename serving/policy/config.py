"""Typed knobs of every scheduling policy, with EcoServe's published defaults (ShareGPT column)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

SloKind = Literal["jct", "ttft+tpot", "normalised"]
SLO_KINDS: tuple[str, ...] = ("jct", "ttft+tpot", "normalised")


class PolicyConfig(BaseModel):
    """One config for all policies; each policy reads the fields it needs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int = Field(32, gt=0, description="KV block size in tokens (EcoServe §2.1 and vLLM: 32)")
    max_num_seqs: int = Field(256, gt=0, description="most requests in one step (vLLM max_num_seqs)")
    max_num_batched_tokens: int = Field(2048, gt=0, description="token budget per step (vLLM max_num_batched_tokens)")
    max_model_len: int = Field(2048, gt=0, description="context limit; max-allocation policies reserve this much")
    tfs: int = Field(2048, gt=0, description="target forward size: tokens per step that saturate the accelerator "
                                             "(EcoServe, Sarathi)")
    padding: float = Field(0.15, ge=0, description="exact allocation pads the predicted RL by this fraction "
                                                   "(EcoServe §2.3: 10/15/20%)")
    reserve: float = Field(0.03, ge=0, lt=1, description="fraction of KV blocks GTs may not take, kept for PTs "
                                                         "and overruns (1.2-5%)")
    buffer: float = Field(0.15, ge=0, lt=0.5, description="KVC pipelining buffer b as a fraction of the host's "
                                                          "predicted RL (10-15%)")
    slo_scale: float = Field(2.0, gt=0, description="JCT SLO = slo_scale x (t_p + t_g x RL) (EcoServe §4)")
    deadline_bin_s: float = Field(0.5, gt=0, description="ordering: width of a deadline range in seconds")
    kv_bin_tokens: int = Field(128, gt=0, description="ordering: width of an occupied-KV range in tokens")
    orca_batch_size: int = Field(8, gt=0, description="ORCA's fixed batch size (EcoServe §2.1)")
    aging_s: float = Field(60.0, gt=0, description="sjf: a request waiting this long outranks any new arrival")
    late_margin: float = Field(1.0, gt=0, description="lengthwise: a waiting request is late when now + margin x (its "
                                                      "steps to go x measured TBT) passes its deadline")
    group_tokens: int = Field(32, gt=0, description="time-synced batching: GTs whose remaining predicted RL rounds up to "
                                                    "the same multiple form one group")
    pipeline_depth: int = Field(4, ge=1, description="KVC pipelining: nesting levels (halves, quarters, ...)")
    max_loras: int = Field(0, ge=0, description="LoRA adapters the engine holds at once (vLLM max_loras): no step runs "
                                                "requests of more distinct adapters; 0: no adapters, no limit")
    slo_kind: SloKind = Field("jct", description="what the operator's SLO values, which the posterior policy optimises: "
                                                 "'jct' (EcoServe: the request done within its deadline), 'ttft+tpot' "
                                                 "(DistServe, vllm bench serve --goodput: first token and every later "
                                                 "one on time), 'normalised' (SeaLLM: mean latency per output token)")
    ttft_s: float | None = Field(None, gt=0, description="ttft+tpot: the TTFT target in seconds; a waiting request past it "
                                                         "has missed and yields to those that can still make it")
    kv_quantile: float = Field(0.3, gt=0, lt=1, description="posterior policy: the quantile of each request's remaining "
                                                            "length that projected-peak KV admission plans for")
    prior_window: int = Field(512, ge=16, description="posterior policy: finished requests each service's length prior "
                                                      "and predictor-skill window keep")
    prior_client_share: float = Field(0.25, gt=0, le=1, description="posterior policy: the most of a service prior's "
                                                                    "window one client key may fill")
    posterior_index: Literal["mean", "gittins"] = Field(
        "mean", description="posterior policy: rank by the posterior mean's c-mu rule (expected remaining x expected "
                            "length; SeaLLM's rule with the belief in place of the budget) or by the Gittins index of the "
                            "whole belief")
