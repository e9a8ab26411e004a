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

from typing import Any

import numpy as np

from serving.launch.models import length_summary, stable_seed
from serving.policy.request import Prediction
from serving.sim.predictions import bucket_accuracy
from training.evaluate import kendall_tau


def request_seed(seed: int, rid: int) -> int:
    """The sampling seed of request ``rid`` in a bench run seeded ``seed``."""
    return stable_seed(seed, rid)


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
    p = np.minimum(np.array([x.length for x in preds], dtype=float), max_tokens)
    t = np.array(truth, dtype=float)
    tau = kendall_tau(p, t)
    return {"kendall_tau": float(tau), "top1": bucket_accuracy(t, p), "mae": float(np.mean(np.abs(p - t))),
            "bias": float(np.mean(p - t))}
