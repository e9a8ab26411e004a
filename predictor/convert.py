"""Convert a GGUF checkpoint (e.g. SmolLM2-135M-Instruct) into a Hugging Face directory that both
vLLM and the predictor's backbone loader accept.

vLLM does not load this GGUF directly; transformers can dequantise it (with the ``gguf`` package), and
the result saved as float32 safetensors with ``architectures: [LlamaForCausalLM]`` serves with its real
chat template and EOS. ``lm_head.weight`` is dropped because the embeddings are tied.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, out = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out  # already converted: idempotent
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__ if type(model).__name__.endswith("ForCausalLM") else "LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tok.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lengthwise convert-gguf", description=__doc__)
    p.add_argument("gguf", help="path to a .gguf file")
    p.add_argument("out", help="output directory (skipped if it already holds a converted model)")
    a = p.parse_args(argv)
    try:
        print(convert_gguf(a.gguf, a.out))
    except FileNotFoundError as exc:
        print(f"convert-gguf: error: {exc}", file=sys.stderr)
        return 2
    return 0
