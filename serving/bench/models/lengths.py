"""Request lengths for MuxServe's fleet: ShareGPT's first turns, kept as MuxServe keeps its ChatLMSYS conversations;
or, so that models differ as they do in a real fleet, each model answering as a different LLM of AlpacaEval.

MuxServe's benchmark keeps a conversation's first request and answer, counted with the LLaMA tokenizer, when the
prompt has 4 to 1,024 tokens, the answer at least 4 and both together at most 2,048 (the models' context). Its
ChatLMSYS requests are not in our data; ShareGPT's first turns, filtered the same way, stand in (MuxServe's own
synthetic workloads draw from ShareGPT), and the bench reports both means beside each other.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from serving.sim.scenarios import ALPACA_EVAL, SHAREGPT, data_path

LLAMA_TOKENIZER = "tokenizers/llama2/tokenizer.model"  # LLaMA and Llama 2 share this 32,000-piece SentencePiece model
MIN_TOKENS, MAX_PROMPT, MAX_TOTAL = 4, 1024, 2048


@lru_cache(maxsize=2)
def muxserve_lengths(source: str = SHAREGPT, limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, output tokens) of every kept first turn, in the file's order; ``limit``: of the first that many
    first turns only (counting all 14,736 takes about 16 s here)."""
    from training.data.labels import load_counter
    from training.data.loaders import load_sharegpt

    examples = [e for e in load_sharegpt(data_path(source), first_turn_only=True) if e.response][:limit]
    counter = load_counter(data_path(LLAMA_TOKENIZER))
    prompt = counter.count([e.latest for e in examples])
    out = counter.count([e.response for e in examples])
    keep = (prompt >= MIN_TOKENS) & (out >= MIN_TOKENS) & (prompt <= MAX_PROMPT) & (prompt + out <= MAX_TOTAL)
    return prompt[keep].astype(np.int64), out[keep].astype(np.int64)


def sample_lengths(n: int, seed: int, source: str = SHAREGPT, limit: int | None = None,
                   generator: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (prompt, output) pairs drawn with replacement from :func:`muxserve_lengths`, or from one AlpacaEval
    ``generator``'s (:func:`alpaca_lengths`)."""
    prompt, out = muxserve_lengths(source, limit) if generator is None else alpaca_lengths(generator)
    idx = np.random.default_rng(seed).integers(0, len(prompt), size=n)
    return prompt[idx], out[idx]


@lru_cache(maxsize=2)
def alpaca_generators(n: int) -> tuple[str, ...]:
    """``n`` of AlpacaEval's generators spread evenly over their mean answer length (in characters, so that only the
    chosen ones are tokenised): the shortest, the longest and evenly between, shuffled with a fixed seed so that a
    fleet's order of models says nothing of their lengths."""
    from training.data.loaders import alpaca_eval_by_generator

    by = alpaca_eval_by_generator(data_path(ALPACA_EVAL))
    ranked = sorted(by, key=lambda g: (float(np.mean([len(e.response or "") for e in by[g]])), g))
    picked = [ranked[round(i * (len(ranked) - 1) / max(1, n - 1))] for i in range(n)]
    order = np.random.default_rng(0).permutation(n)
    return tuple(picked[i] for i in order)


@lru_cache(maxsize=32)
def alpaca_lengths(generator: str) -> tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, output tokens) of ``generator``'s AlpacaEval answers, counted with the LLaMA tokenizer and
    kept as :func:`muxserve_lengths` keeps ShareGPT's."""
    from training.data.labels import load_counter
    from training.data.loaders import alpaca_eval_by_generator

    examples = [e for e in alpaca_eval_by_generator(data_path(ALPACA_EVAL), [generator])[generator] if e.response]
    counter = load_counter(data_path(LLAMA_TOKENIZER))
    prompt = counter.count([e.latest for e in examples])
    out = counter.count([e.response for e in examples])
    keep = (prompt >= MIN_TOKENS) & (out >= MIN_TOKENS) & (prompt <= MAX_PROMPT) & (prompt + out <= MAX_TOTAL)
    return prompt[keep].astype(np.int64), out[keep].astype(np.int64)
