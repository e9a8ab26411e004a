"""The real-model mode of ``lengthwise bench engine``: the served model's prompts, seeds and lengths.

With random weights the bench replays ShareGPT's answer lengths; with a real model (SmolLM2-135M-Instruct here) a
request's length is whatever the model does, so the truth must be measured, not read from the trace:

- **Prompts** are each request's turns in the model's chat template, tokenized by the model's tokenizer (the token
  ids the engine gets, so prompt lengths are exact).
- **Sampling** is what the model is served with (temperature, top_p, a repetition penalty; greedy decoding makes
  SmolLM2 loop to the cap) and a **seed per request**, derived from the bench seed and the request id.
- **The served lengths** come from a seeded relabel through stock vLLM: the same prompts, settings and seeds. With
  :mod:`serving.engine.seeded` a request draws once per kept token whatever the chunking, so a replay under another
  scheduler reproduces the relabelled length unless batching's floating-point effects flip a sample (the bench counts
  those). A request that ran to ``max_tokens`` is a censored length: kept, and counted.
- **Predictor quality** is scored against those lengths (Kendall tau, top-1 bucket accuracy, MAE), the only truth
  that matters to a scheduler serving this model.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from serving.policy.request import Prediction
from serving.sim.workload import TraceRequest


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


_ROLES = {"gpt": "assistant", "assistant": "assistant", "model": "assistant", "chatgpt": "assistant", "system": "system"}


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """The model's tokenizer, loaded once per directory (a relabel renders its prompts chunk by chunk)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def chat_prompt_ids(model_dir: Path, requests: list[TraceRequest]) -> dict[int, list[int]]:
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


def request_seed(seed: int, rid: int) -> int:
    """The sampling seed of request ``rid`` in a bench run seeded ``seed``."""
    return stable_seed(seed, rid)


def length_summary(lengths: list[int], capped: int) -> dict[str, Any]:
    """What a set of served lengths says: how many ran to the cap (censored) and how the lengths spread."""
    v = np.asarray(lengths, dtype=float)
    spread = {"mean": float(v.mean()), "median": float(np.median(v)), "p90": float(np.percentile(v, 90))} if len(v) else {}
    return {"capped": capped, "capped_share": capped / max(len(v), 1), **spread}


def served_lengths(outs: list[dict[str, Any]], max_tokens: int) -> tuple[dict[int, int], dict[str, Any]]:
    """The relabel's lengths per request id, and what they say: how many ran to ``max_tokens`` (censored)."""
    lengths, capped = {}, 0
    for out in outs:
        for x in out["records"]:
            if x["finished"] is None:
                raise RuntimeError(f"the relabel lost request {x['id']}")
            lengths[int(x["id"])] = int(x["tokens"])
            capped += int(x["tokens"]) >= max_tokens
    return lengths, {"requests": len(lengths), **length_summary(list(lengths.values()), capped)}


def predictor_quality(preds: list[Prediction], truth: list[int], max_tokens: int) -> dict[str, float]:
    """How well predictions (clamped to ``max_tokens``, as the plug-in clamps them) rank and size the served lengths."""
    from scipy.stats import kendalltau

    from serving.sim.predictions import bucket_accuracy

    p = np.minimum(np.array([x.length for x in preds], dtype=float), max_tokens)
    t = np.array(truth, dtype=float)
    tau = kendalltau(p, t).statistic
    return {"kendall_tau": float(tau), "top1": bucket_accuracy(t, p), "mae": float(np.mean(np.abs(p - t))),
            "bias": float(np.mean(p - t))}
