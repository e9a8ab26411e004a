"""Response-length labels: token counts under the *target* model's tokenizer.

The scheduler reserves KV in tokens of the served model, so labels must be counted with that model's
tokenizer, not the predictor's. Accepted: a HF ``tokenizer.json``, a SentencePiece ``.model``, a
tiktoken BPE ranks file (Llama-3 style ``tokenizer.model``), or a HF tokenizer directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from training.data.example import DataError, Example

# Llama-3's pre-tokenisation pattern (public in meta-llama/llama-models).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenCounter(Protocol):
    name: str

    def count(self, texts: Sequence[str]) -> np.ndarray: ...


class _HFTokenizersCounter:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_truncation()
        self._tok.no_padding()

    def count(self, texts: Sequence[str]) -> np.ndarray:
        enc = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return np.array([len(e.ids) for e in enc], dtype=np.int64)


class _SentencePieceCounter:
    def __init__(self, path: Path):
        import sentencepiece as spm

        self.name = str(path)
        self._sp = spm.SentencePieceProcessor(model_file=str(path))

    def count(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([len(ids) for ids in self._sp.encode(list(texts))], dtype=np.int64)


class _TiktokenCounter:
    def __init__(self, path: Path):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        self.name = str(path)
        ranks = load_tiktoken_bpe(str(path))
        self._enc = tiktoken.Encoding(name=path.stem, pat_str=_LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens={})

    def count(self, texts: Sequence[str]) -> np.ndarray:
        return np.array([len(x) for x in self._enc.encode_ordinary_batch(list(texts))], dtype=np.int64)


class _AutoTokenizerCounter:
    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        self.name = str(path)
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def count(self, texts: Sequence[str]) -> np.ndarray:
        out = self._tok(list(texts), add_special_tokens=False)["input_ids"]
        return np.array([len(x) for x in out], dtype=np.int64)


def load_counter(path: str | os.PathLike) -> TokenCounter:
    """Open a tokenizer file or directory for counting; :class:`DataError` if it cannot be used."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"tokenizer not found: {p} (give a tokenizer.json, a SentencePiece/tiktoken tokenizer.model, "
                        "or a HF tokenizer directory)")
    try:
        if p.is_dir():
            if (p / "tokenizer.json").exists() and not (p / "tokenizer_config.json").exists():
                return _HFTokenizersCounter(p / "tokenizer.json")
            return _AutoTokenizerCounter(p)
        if p.suffix == ".json":
            return _HFTokenizersCounter(p)
        try:
            return _SentencePieceCounter(p)
        except Exception:  # noqa: BLE001 - not SentencePiece: try tiktoken
            return _TiktokenCounter(p)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - any load failure is a bad --tokenizer
        raise DataError(f"unknown or unreadable tokenizer {p}: "
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def attach_labels(examples: list[Example], counter: TokenCounter, batch: int = 2048) -> list[Example]:
    """Fill ``response_tokens`` from ``response`` text where the source did not give counts."""
    todo = [e for e in examples if e.response_tokens is None]
    for i in range(0, len(todo), batch):
        chunk = todo[i : i + batch]
        for e, n in zip(chunk, counter.count([e.response or "" for e in chunk])):
            e.response_tokens = int(n)
    return examples


def labels_of(examples: Sequence[Example]) -> np.ndarray:
    return np.array([e.response_tokens for e in examples], dtype=np.int64)


def censored_of(examples: Sequence[Example]) -> np.ndarray:
    """Which labels are lower bounds (the answer was cut), aligned with :func:`labels_of`."""
    return np.array([e.censored for e in examples], dtype=bool)
