"""Export a trained classifier to an ONNX model package and check it against torch."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from predictor.buckets import BucketScheme
from predictor.model import LengthClassifier, merged_for_export
from predictor.package_meta import META_FILE
from predictor.prompt import InputFormat
from predictor.runtime import MODEL_FILE, TOKENIZER_FILE, OnnxLengthPredictor, pad_ids
from predictor.target import check_target


def input_format_for(tokenizer: Tokenizer, max_tokens: int, pad_id: int | None, length_hints: bool = False) -> InputFormat:
    """Read the special tokens a backbone expects around a prompt from its tokenizer's post-processor."""
    plain = tokenizer.encode("length", add_special_tokens=False).ids
    full = tokenizer.encode("length", add_special_tokens=True).ids
    start = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    prefix, suffix = full[:start], full[start + len(plain) :]
    if pad_id is None:
        pad_id = next((tokenizer.token_to_id(t) for t in ("[PAD]", "<pad>", "<|endoftext|>")
                       if tokenizer.token_to_id(t) is not None), 0)
    return InputFormat(max_tokens, tuple(prefix), tuple(suffix), int(pad_id), length_hints)


def load_backbone_tokenizer(base_model: str | Path) -> Tokenizer:
    path = Path(base_model) / TOKENIZER_FILE
    if not path.exists():
        raise FileNotFoundError(f"{base_model} has no tokenizer.json (save the tokenizer with a fast tokenizer)")
    tok = Tokenizer.from_file(str(path))
    tok.no_truncation()
    tok.no_padding()
    return tok


def export_package(model: LengthClassifier, out_dir: Path, base_model: Path, scheme: BucketScheme,
                   input_format: InputFormat, meta: dict, target: dict | None = None) -> Path:
    """Write model.onnx (LoRA merged, dynamic batch and sequence axes), tokenizer.json and meta.json.

    ``target`` (:mod:`predictor.target`) says which model's lengths the labels are, so the registry and the gateway
    can tell a predictor for the served model from one for another; it is checked before anything is written (a
    malformed one is a ValueError) and stored as ``meta.json``'s ``target`` (null when not given).
    """
    target = check_target(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    merged = merged_for_export(model)
    ids = torch.tensor([list(input_format.prefix_ids) + [input_format.pad_id + 1] * 7 + list(input_format.suffix_ids)] * 2)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with torch.no_grad():
        torch.onnx.export(
            merged, (ids, mask), str(out_dir / MODEL_FILE), input_names=["input_ids", "attention_mask"],
            output_names=["logits"], opset_version=17, dynamo=False,
            dynamic_axes={"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                          "logits": {0: "batch"}},
        )
    shutil.copyfile(Path(base_model) / TOKENIZER_FILE, out_dir / TOKENIZER_FILE)
    full_meta = dict(meta, buckets=scheme.to_dict(), input_format=input_format.to_dict(), target=target)
    (out_dir / META_FILE).write_text(json.dumps(full_meta, indent=2))
    return out_dir


def parity_max_abs_diff(model: LengthClassifier, predictor: OnnxLengthPredictor, ids: Sequence[Sequence[int]],
                        batch: int = 32) -> float:
    """Largest |logit(torch) − logit(onnxruntime)| over the given encoded prompts (padded batches)."""
    model = model.eval()
    onnx_logits = predictor.logits_encoded(ids)
    order = np.argsort([len(x) for x in ids], kind="stable")
    worst = 0.0
    with torch.no_grad():
        for s in range(0, len(order), batch):
            sel = order[s : s + batch]
            x, m = pad_ids([ids[i] for i in sel], predictor.input_format.pad_id)
            ref = model(torch.from_numpy(x), torch.from_numpy(m)).numpy()
            worst = max(worst, float(np.abs(ref - onnx_logits[sel]).max()))
    return worst
