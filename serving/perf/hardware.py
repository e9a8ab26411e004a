"""Model and accelerator descriptions for the simulator, and the KV-capacity arithmetic built on them.

Why this exists: the simulator's two physical questions are "how many tokens of KV fit" and "how long does
one engine step take". Both follow from a handful of architecture numbers (layers, KV heads, head size,
parameter count) and accelerator limits (peak FLOP/s, HBM bandwidth, memory size), so they live here once,
as frozen pydantic models, instead of as magic numbers in each policy or benchmark.

Units: bytes, FLOP/s and bytes/s throughout. "GB" in papers is read as 10**9 bytes unless said otherwise:
EcoServe's 12 GB of KV for OPT-13B at block size 32 is 12e9 bytes = 457 whole blocks = 14,624 tokens, the
figure EcoServe §2.1 uses (12 GiB would give 15,712 tokens).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

GiB = 2**30
MiB = 2**20


class HardwareError(ValueError):
    """An unknown model or GPU name, or a model that does not fit the memory it is given."""


class ModelSpec(BaseModel):
    """The architecture numbers that set a decoder-only transformer's KV size, weight bytes and FLOPs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    n_layers: int = Field(gt=0)
    hidden: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0, description="KV heads (GQA); equals n_heads for multi-head attention")
    head_dim: int = Field(gt=0)
    intermediate: int = Field(gt=0, description="MLP inner size")
    vocab: int = Field(gt=0)
    params: float = Field(gt=0, description="parameter count (from the model card / safetensors index)")
    dtype_bytes: int = Field(2, gt=0, description="bytes per weight and per KV element (bf16/fp16 = 2)")
    max_model_len: int = Field(gt=0, description="the model's context limit; callers cap it for their traces")
    gated_mlp: bool = Field(True, description="SwiGLU-style MLP with three matrices (Llama, Qwen); OPT has two")
    tied_embeddings: bool = Field(False, description="LM head shares the input embedding (OPT, SmolLM2)")

    @model_validator(mode="after")
    def _gqa_divides(self) -> ModelSpec:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        return self

    def kv_bytes_per_token(self) -> int:
        """K and V for every layer and KV head: what one token of context costs in cache memory and reads."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes

    def weight_bytes(self) -> float:
        """Bytes of weights; a decode step streams all of them from HBM once."""
        return self.params * self.dtype_bytes

    def flops_per_token(self) -> float:
        """Dense matmul FLOPs per processed token (2 per parameter); attention's context term is separate."""
        return 2.0 * self.params

    def attn_flops_per_context_token(self) -> float:
        """FLOPs one query token spends per context token it attends to: QK^T and AV, 2 FLOPs per MAC, all layers."""
        return 4.0 * self.n_layers * self.n_heads * self.head_dim

    def param_estimate(self) -> float:
        """Parameters implied by the shape alone (no norms or biases); a check against typos in the registry."""
        q = self.n_heads * self.head_dim
        kv = self.n_kv_heads * self.head_dim
        attn = self.hidden * q * 2 + self.hidden * kv * 2
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return float(self.n_layers * (attn + mlp) + emb)


class GPUSpec(BaseModel):
    """Peak limits of one accelerator plus the fractions of them a serving engine actually reaches."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    flops: float = Field(gt=0, description="dense bf16 FLOP/s (no sparsity)")
    mem_bw: float = Field(gt=0, description="HBM bandwidth, bytes/s")
    mem_bytes: float = Field(gt=0, description="device memory, bytes")
    mfu: float = Field(0.6, gt=0, le=1, description="achievable fraction of peak FLOP/s in large prefills")
    mbu: float = Field(0.8, gt=0, le=1, description="achievable fraction of peak bandwidth in decode")


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # facebook/opt-13b: MHA, 2-matrix ReLU MLP, learned positions, tied LM head. EcoServe's model.
        ModelSpec(name="opt-13b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40, head_dim=128, intermediate=20480,
                  vocab=50272, params=12.9e9, max_model_len=2048, gated_mlp=False, tied_embeddings=True),
        # meta-llama/Llama-3.1-8B(-Instruct): BLIS's reference model.
        ModelSpec(name="llama-3.1-8b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, intermediate=14336,
                  vocab=128256, params=8.03e9, max_model_len=131072),
        # meta-llama/Llama-3.3-70B-Instruct.
        ModelSpec(name="llama-3.3-70b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=8, head_dim=128, intermediate=28672,
                  vocab=128256, params=70.55e9, max_model_len=131072),
        # Qwen/Qwen2.5-7B-Instruct: config max_position_embeddings 32768 (131072 only with YaRN).
        ModelSpec(name="qwen2.5-7b", n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, head_dim=128, intermediate=18944,
                  vocab=152064, params=7.62e9, max_model_len=32768),
        # microsoft/phi-4.
        ModelSpec(name="phi-4", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=10, head_dim=128, intermediate=17920,
                  vocab=100352, params=14.66e9, max_model_len=16384),
        # LLaMA (the first; huggyllama/llama-7b, -13b, -30b, -65b): MuxServe's sixteen-model fleet. Multi-head
        # attention, 2,048-token context, untied LM head; parameters from the papers' model cards.
        ModelSpec(name="llama-7b", n_layers=32, hidden=4096, n_heads=32, n_kv_heads=32, head_dim=128, intermediate=11008,
                  vocab=32000, params=6.74e9, max_model_len=2048),
        ModelSpec(name="llama-13b", n_layers=40, hidden=5120, n_heads=40, n_kv_heads=40, head_dim=128, intermediate=13824,
                  vocab=32000, params=13.02e9, max_model_len=2048),
        ModelSpec(name="llama-30b", n_layers=60, hidden=6656, n_heads=52, n_kv_heads=52, head_dim=128, intermediate=17920,
                  vocab=32000, params=32.53e9, max_model_len=2048),
        ModelSpec(name="llama-65b", n_layers=80, hidden=8192, n_heads=64, n_kv_heads=64, head_dim=128, intermediate=22016,
                  vocab=32000, params=65.29e9, max_model_len=2048),
        # HuggingFaceTB/SmolLM2-135M(-Instruct): the model our CPU engine runs.
        ModelSpec(name="smollm2-135m", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, intermediate=1536,
                  vocab=49152, params=134.5e6, max_model_len=8192, tied_embeddings=True),
    )
}

# Peak numbers from the vendors' data sheets. Memory: 80 GiB for the 80 GB parts (with vLLM's default
# gpu_memory_utilization 0.9 this reproduces BLIS's TP=1 block counts), 143,771 MiB for H200 as nvidia-smi reports.
GPUS: dict[str, GPUSpec] = {
    g.name: g
    for g in (
        GPUSpec(name="a100-80gb", flops=312e12, mem_bw=2.0e12, mem_bytes=80 * GiB),
        GPUSpec(name="h100", flops=989e12, mem_bw=3.35e12, mem_bytes=80 * GiB),
        GPUSpec(name="h200", flops=989e12, mem_bw=4.8e12, mem_bytes=143771 * MiB),
    )
}

_GPU_ALIASES = {"a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-sxm": "a100-80gb", "h100-sxm": "h100",
                "h100-80gb": "h100", "h100-sxm5": "h100", "h200-sxm": "h200", "h200-141gb": "h200"}


def _model_key(name: str) -> str:
    """Accept registry names and Hugging Face ids: 'meta-llama/Llama-3.1-8B-Instruct' -> 'llama-3.1-8b'."""
    key = name.strip().lower().rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-it", "-chat"):
        key = key.removesuffix(suffix)
    return key


def get_model(name: str) -> ModelSpec:
    """Look a model up by registry name or Hugging Face id; unknown names list what is known."""
    key = _model_key(name)
    if key not in MODELS:
        raise HardwareError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return MODELS[key]


def get_gpu(name: str) -> GPUSpec:
    """Look a GPU up by registry name or a common alias ('A100', 'H100-SXM'); unknown names list what is known."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    key = _GPU_ALIASES.get(key, key)
    if key not in GPUS:
        raise HardwareError(f"unknown GPU {name!r}; known GPUs: {', '.join(sorted(GPUS))}")
    return GPUS[key]


def kv_capacity_tokens(model: ModelSpec, kv_bytes: float, block_size: int = 1) -> int:
    """Tokens of KV that fit in ``kv_bytes``; with ``block_size`` > 1, only whole blocks count (paged allocators).

    OPT-13B, 12e9 bytes: 14,648 tokens raw, 14,624 at block size 32 (EcoServe §2.1's figure).
    """
    return kv_blocks(model, kv_bytes, block_size) * block_size


def kv_blocks(model: ModelSpec, kv_bytes: float, block_size: int) -> int:
    """Whole KV blocks of ``block_size`` tokens that fit in ``kv_bytes``: the pool a block ledger manages."""
    if block_size <= 0:
        raise HardwareError(f"block_size must be positive, got {block_size}")
    if kv_bytes < 0 or not math.isfinite(kv_bytes):
        raise HardwareError(f"kv_bytes must be a finite non-negative number, got {kv_bytes}")
    return int(kv_bytes // (model.kv_bytes_per_token() * block_size))


def kv_bytes_available(model: ModelSpec, gpu: GPUSpec, tp: int = 1, gpu_memory_utilization: float = 0.9,
                       reserve_bytes: float = 0.0) -> float:
    """KV memory a vLLM-like engine gets on ``tp`` GPUs: the utilised share of memory minus weights and a reserve.

    Why: the SPEC wants KV capacity "from model config and memory size". Activation/graph memory is left to
    ``reserve_bytes`` (default 0) because BLIS's published TP=1 block counts match this formula without it.
    """
    if tp <= 0:
        raise HardwareError(f"tp must be positive, got {tp}")
    if not 0 < gpu_memory_utilization <= 1:
        raise HardwareError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free = tp * gpu.mem_bytes * gpu_memory_utilization - model.weight_bytes() - reserve_bytes
    if free <= 0:
        raise HardwareError(
            f"{model.name} ({model.weight_bytes() / 1e9:.1f} GB of weights) leaves no KV memory on {tp} x {gpu.name} "
            f"at gpu_memory_utilization {gpu_memory_utilization}; use more GPUs (tp) or a larger one"
        )
    return free
