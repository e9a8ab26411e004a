"""Inference with onnxruntime from a model package directory (what the registry stores and serves).

A package holds ``model.onnx`` (LoRA merged), ``tokenizer.json``, and ``meta.json`` (bucket scheme,
input format, backbone, evaluation summary, and the target: which model's lengths it predicts, see
:mod:`predictor.target`). Nothing here imports torch or transformers, so the
sidecar starts fast and stays small.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from predictor.buckets import BucketScheme
from predictor.prompt import Encoded, InputFormat, encode_turns
from predictor.target import check_target

log = logging.getLogger(__name__)
Prompt = str | Sequence[tuple[str, str]]

MODEL_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
PRECISIONS = ("fp32", "int8")
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "meta.json"


@dataclass
class PredictionBatch:
    """Per prompt: argmax bucket, bucket probabilities, expected and quantile length (tokens)."""

    buckets: np.ndarray
    probs: np.ndarray
    expected: np.ndarray
    quantile: np.ndarray
    truncated: np.ndarray

    def __iter__(self):  # buckets, probs, expected, quantile = predictor.predict(...)
        return iter((self.buckets, self.probs, self.expected, self.quantile))


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def pad_ids(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to the longest sequence; returns (input_ids, attention_mask) as int64."""
    width = max(len(x) for x in ids)
    out = np.full((len(ids), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), width), dtype=np.int64)
    for r, x in enumerate(ids):
        out[r, : len(x)] = x
        mask[r, : len(x)] = 1
    return out, mask


def length_batches(lengths: Sequence[int], batch_size: int, token_budget: int) -> list[np.ndarray]:
    """Group prompt indices by similar length: at most ``batch_size`` prompts and, beyond the first,
    at most ``token_budget`` padded tokens per group. On a CPU the forward pass is compute-bound, so
    padding a 20-token prompt to 128 costs as much as a real 128-token prompt."""
    order = np.argsort(lengths, kind="stable")
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * lengths[i] > token_budget):
            groups.append(np.array(cur))
            cur = []
        cur.append(i)
    if cur:
        groups.append(np.array(cur))
    return groups


def session_options(threads: int | None = None, spin: bool | None = None) -> ort.SessionOptions:
    """``spin=False`` stops idle intra-op threads from busy-waiting: on a machine shared with other work (a sidecar
    beside engines) spinning threads burn CPU others need; ``None`` keeps onnxruntime's default."""
    opts = ort.SessionOptions()
    n = threads or int(os.environ.get("LENGTHWISE_ORT_THREADS", "0")) or min(4, os.cpu_count() or 1)
    opts.intra_op_num_threads = n
    if spin is not None:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return opts


def int8_model(package_dir: Path) -> Path:
    """The package's model with int8 weights (onnxruntime dynamic quantization), made once and kept.

    Why: on a CPU the encoder is compute-bound; int8 matrix products raise predictions per second by
    about 1.7x here. It is written beside ``model.onnx`` when the package directory is writable, else in
    ``$LENGTHWISE_HOME/cache/int8/`` keyed by the package's path and model size.
    """
    src = package_dir / MODEL_FILE
    target = package_dir / INT8_FILE
    if target.exists():
        return target
    if not os.access(package_dir, os.W_OK):
        import hashlib

        key = hashlib.sha256(f"{src.resolve()}:{src.stat().st_size}".encode()).hexdigest()[:16]
        home = Path(os.environ.get("LENGTHWISE_HOME", Path.home() / ".lengthwise"))
        target = home / "cache" / "int8" / key / INT8_FILE
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    tmp = target.with_suffix(f".tmp{os.getpid()}")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # onnxruntime's "consider pre-processing" advice is for conv nets, not for us
    try:
        quantize_dynamic(str(src), str(tmp), weight_type=QuantType.QInt8)
    finally:
        root.setLevel(level)
    os.replace(tmp, target)  # atomic: a concurrent loader sees the old state or the whole file
    return target


class OnnxLengthPredictor:
    """``predict(prompts) -> buckets, probabilities, expected, quantile`` backed by onnxruntime.

    ``target`` is the package's target-model description (:mod:`predictor.target`: which model's lengths it learned),
    None for a package made before targets were recorded.
    """

    def __init__(self, package_dir: str | os.PathLike, threads: int | None = None, batch_size: int = 32,
                 token_budget: int = 2048, spin: bool | None = None, precision: str = "fp32"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        d = Path(package_dir)
        self.precision = precision
        self.package_dir = d
        self.meta = json.loads((d / META_FILE).read_text())
        self.scheme = BucketScheme.from_dict(self.meta["buckets"])
        self.input_format = InputFormat.from_dict(self.meta["input_format"])
        self.target = self._target(self.meta.get("target"))
        self.tokenizer = Tokenizer.from_file(str(d / TOKENIZER_FILE))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        model = int8_model(d) if precision == "int8" else d / MODEL_FILE
        self.session = ort.InferenceSession(str(model), session_options(threads, spin), providers=["CPUExecutionProvider"])
        self.batch_size = batch_size
        self.token_budget = token_budget

    @staticmethod
    def _target(raw: object) -> dict | None:
        """The package's target model (:mod:`predictor.target`); None for packages made before targets were recorded,
        and for a malformed record, which must not stop a predictor from loading: the gateway then calls it unknown."""
        try:
            return check_target(raw)  # type: ignore[arg-type]
        except ValueError as exc:
            log.warning("the package's target is not understood, so it counts as unknown: %s", exc)
            return None

    @staticmethod
    def _as_turns(p: Prompt) -> Sequence[tuple[str, str]]:
        return [("user", p)] if isinstance(p, str) else p

    def encode(self, prompts: Sequence[Prompt]) -> list[Encoded]:
        return encode_turns(self.tokenizer, self.input_format, [self._as_turns(p) for p in prompts])

    def logits_encoded(self, ids: Sequence[Sequence[int]]) -> np.ndarray:
        """Logits for already-encoded prompts."""
        out = np.zeros((len(ids), self.scheme.n), dtype=np.float32)
        for sel in length_batches([len(x) for x in ids], self.batch_size, self.token_budget):
            x, m = pad_ids([ids[i] for i in sel], self.input_format.pad_id)
            out[sel] = self.session.run(None, {"input_ids": x, "attention_mask": m})[0]
        return out

    def predict_encoded(self, encoded: Sequence[Encoded], quantile: float = 0.9) -> PredictionBatch:
        if not encoded:
            raise ValueError("no prompts to predict")
        probs = softmax(self.logits_encoded([e.ids for e in encoded]).astype(np.float64))
        return PredictionBatch(
            buckets=probs.argmax(1),
            probs=probs,
            expected=self.scheme.expected(probs),
            quantile=self.scheme.quantile(probs, quantile),
            truncated=np.array([e.truncated for e in encoded]),
        )

    def predict(self, prompts: Sequence[Prompt], quantile: float = 0.9) -> PredictionBatch:
        """Predict for prompts given as strings or as ``[(role, text), ...]`` conversations."""
        return self.predict_encoded(self.encode(prompts), quantile)
