"""A real ONNX length-predictor package, small enough to export in seconds: a one-layer BERT with random weights and
the GPT-2 tokenizer, three buckets (tests of what a package carries, not of what it predicts)."""

from __future__ import annotations

import shutil
from pathlib import Path


def tiny_base(path: Path, tokenizer_json: Path, seed: int = 0, layers: int = 1) -> Path:
    """The backbone directory: config, random weights and ``tokenizer.json`` (vocabulary rounded up past the pad id).

    The weights come from ``seed``, not from torch's global generator: drawn from that, they depended on whatever ran
    before in the process, and a test that trains on this backbone passed alone and failed after another module's
    training had moved the generator."""
    import torch
    from transformers import BertConfig, BertModel

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        BertModel(BertConfig(vocab_size=50304, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
                             intermediate_size=32, max_position_embeddings=128)).save_pretrained(path)
    shutil.copyfile(tokenizer_json, path / "tokenizer.json")
    return path


def tiny_packages(work: Path, tokenizer_json: Path, targets: dict[str, dict | None],
                  head_bias: list[float] | None = None) -> dict[str, Path]:
    """One classifier exported once per entry of ``targets`` (name -> target), into ``work/<name>``. ``head_bias``
    sets the bucket logits' bias: ``[0, 0, 10]`` makes a predictor that puts every prompt in the longest bucket."""
    import torch

    from predictor.buckets import BucketScheme
    from predictor.model import build_classifier
    from training.export import export_package, input_format_for, load_backbone_tokenizer

    base = tiny_base(work / "base", tokenizer_json)
    scheme = BucketScheme.from_edges([64, 256], max_tokens=1024)
    model = build_classifier(base, scheme.n, lora=None)
    if head_bias is not None:
        with torch.no_grad():
            model.head.bias.copy_(torch.tensor(head_bias))
    fmt = input_format_for(load_backbone_tokenizer(base), 32, None)
    return {name: export_package(model, work / name, base, scheme, fmt, {"backbone": "tiny"}, target=target)
            for name, target in targets.items()}
