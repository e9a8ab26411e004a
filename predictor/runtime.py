"""Inference with onnxruntime from a model package directory (what the registry stores and serves).

A package holds ``model.onnx`` (LoRA merged), ``tokenizer.json``, and ``meta.json`` (bucket scheme,
input format, backbone, evaluation summary, and the target: which model's lengths it predicts, see
:mod:`predictor.target`). Nothing here imports torch or transformers, so the
sidecar starts fast and stays small.

A package may also route a slice (a conversation's first turns, or its later turns) to a cheap baseline that ranked
better there in training (:mod:`predictor.slices`): :meth:`OnnxLengthPredictor.predict` sends each prompt to its slice's
predictor and says, per row, which one answered. A package without routes is served by its ONNX model alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from predictor.common import available_cores
from predictor.optimize import fuse
from predictor.package_meta import read_meta, update_meta
from predictor.prompt import Encoded, InputFormat, encode_turns
from predictor.slices import MODEL, load_fast_tier, load_routes, rows_by_slice, slice_of
from predictor.target import check_target

log = logging.getLogger(__name__)
Prompt = str | Sequence[tuple[str, str]]

MODEL_FILE = "model.onnx"
INT8_FILE = "model.int8.onnx"
FUSED_FILE = "model.fused.onnx"
FUSED_INT8_FILE = "model.fused.int8.onnx"
# The graph a predictor runs: the exported one (fp32), its weights quantized to int8, the fused graph
# (predictor.optimize), and the fused graph quantized. Each variant is derived from model.onnx once and kept.
PRECISIONS = ("fp32", "int8", "fused", "fused-int8")
TOKENIZER_FILE = "tokenizer.json"


@dataclass
class RoutedProbs:
    """Bucket probabilities of prompts sent each to its slice's predictor, in the prompts' order."""

    probs: np.ndarray          # [n, buckets]
    predictor: np.ndarray      # [n] who answered: "lengthwise" (the ONNX model) or a routed baseline's name
    truncated: np.ndarray      # [n] cut to the input budget (always False on a routed row: a baseline reads the text)
    prompt_tokens: np.ndarray  # [n] ONNX input tokens after truncation (0 on a routed row: no tokens were made)


@dataclass
class PredictionBatch:
    """Per prompt: argmax bucket, bucket probabilities, expected and quantile length (tokens), whether the prompt was
    cut to the input budget, and which predictor answered (``lengthwise``, or the baseline its slice routes to)."""

    buckets: np.ndarray
    probs: np.ndarray
    expected: np.ndarray
    quantile: np.ndarray
    truncated: np.ndarray
    predictor: np.ndarray | None = None  # [n] str; None from code that builds a batch without saying

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
    n = threads or int(os.environ.get("LENGTHWISE_ORT_THREADS", "0")) or min(4, available_cores())
    opts.intra_op_num_threads = n
    if spin is not None:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return opts


def _derived(package_dir: Path, name: str, kind: str, make: Callable[[Path], None]) -> Path:
    """A model file derived from the package's ``model.onnx`` (by ``make(path)``), made once and kept: beside
    ``model.onnx`` when the package directory is writable (or when the package ships it), else in
    ``$LENGTHWISE_HOME/cache/<kind>/`` keyed by the package model's path and size."""
    src = package_dir / MODEL_FILE
    target = package_dir / name
    if target.exists():
        return target
    if not os.access(package_dir, os.W_OK):
        import hashlib

        key = hashlib.sha256(f"{src.resolve()}:{src.stat().st_size}".encode()).hexdigest()[:16]
        home = Path(os.environ.get("LENGTHWISE_HOME", Path.home() / ".lengthwise"))
        target = home / "cache" / kind / key / name
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    make(tmp)
    os.replace(tmp, target)  # atomic: a concurrent loader sees the old state or the whole file
    return target


def _quantize(src: Path, dst: Path) -> None:
    """int8 weights by onnxruntime dynamic quantization (activations quantized per run)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # onnxruntime's "consider pre-processing" advice is for conv nets, not for us
    try:
        # the fused graph's contrib operators defeat ONNX shape inference: their outputs are float, say so
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                         extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
    finally:
        root.setLevel(level)


def int8_model(package_dir: Path) -> Path:
    """The package's model with int8 weights (onnxruntime dynamic quantization), made once and kept.

    Why: on a CPU the encoder is compute-bound; int8 matrix products raise predictions per second by
    about 1.7x here. It is written beside ``model.onnx`` when the package directory is writable, else in
    ``$LENGTHWISE_HOME/cache/int8/`` keyed by the package's path and model size.
    """
    return _derived(package_dir, INT8_FILE, "int8", lambda dst: _quantize(package_dir / MODEL_FILE, dst))


def fused_model(package_dir: Path) -> Path:
    """The package's fused graph (:mod:`predictor.optimize`): the one ``train-predictor --optimize`` ships in the
    package, else made once from ``model.onnx`` and kept (as :func:`int8_model` keeps its file)."""
    def make(dst: Path) -> None:
        fuse(package_dir / MODEL_FILE, dst)

    return _derived(package_dir, FUSED_FILE, "fused", make)


def fused_int8_model(package_dir: Path) -> Path:
    """The fused graph with int8 weights (``Attention`` becomes ``QAttention``), made once and kept."""
    return _derived(package_dir, FUSED_INT8_FILE, "fused-int8", lambda dst: _quantize(fused_model(package_dir), dst))


def model_file(package_dir: Path, precision: str) -> Path:
    """The model file a predictor of ``precision`` (one of :data:`PRECISIONS`) runs, made on first use."""
    makers = {"fp32": lambda d: d / MODEL_FILE, "int8": int8_model, "fused": fused_model, "fused-int8": fused_int8_model}
    if precision not in makers:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return makers[precision](Path(package_dir))


def add_fused_variant(package_dir: Path, parity_ids: Sequence[Sequence[int]]) -> dict:
    """Write the fused graph into the package (``model.fused.onnx``) so serving it needs no optimizer at start, and
    record it in ``meta.json``: ``variant: "fused"`` and, under ``fused``, what was fused and its parity with
    ``model.onnx`` on ``parity_ids`` (max |logit diff| and the share of equal argmax buckets). Returns that record."""
    package_dir = Path(package_dir)
    tmp = package_dir / f"{FUSED_FILE}.tmp{os.getpid()}"
    report = fuse(package_dir / MODEL_FILE, tmp)
    os.replace(tmp, package_dir / FUSED_FILE)
    ref = OnnxLengthPredictor(package_dir, precision="fp32")
    fused = OnnxLengthPredictor(package_dir, precision="fused")
    record = dict(report.to_dict(), file=FUSED_FILE, **logit_parity(ref, fused, parity_ids))
    update_meta(package_dir, {"variant": "fused", "fused": record})
    return record


def logit_parity(reference: OnnxLengthPredictor, other: OnnxLengthPredictor, ids: Sequence[Sequence[int]]) -> dict:
    """How far ``other`` is from ``reference`` on the same encoded prompts: the largest |logit difference| and the
    share of prompts whose argmax bucket is the same."""
    if not ids:
        return {"parity_max_abs_diff": 0.0, "bucket_agreement": 1.0, "parity_prompts": 0}
    a, b = reference.logits_encoded(ids), other.logits_encoded(ids)
    return {"parity_max_abs_diff": float(np.abs(a - b).max()), "bucket_agreement": float((a.argmax(1) == b.argmax(1)).mean()),
            "parity_prompts": len(ids)}


def input_budget(fmt: InputFormat, max_tokens: int) -> InputFormat:
    """``fmt`` with its input budget capped at ``max_tokens``: an ablation knob, to measure what serving a package with
    fewer prompt tokens than it was trained with costs in ranking quality and saves in CPU, without retraining per
    budget (a model trained at the smaller budget may rank better than this one cut short). A cap at or above the
    trained budget changes nothing: the model never saw longer inputs. A cap with no room for a prompt token is a
    ValueError."""
    room = len(fmt.prefix_ids) + len(fmt.suffix_ids)
    if max_tokens <= room:
        raise ValueError(f"max prompt tokens must exceed the {room} special tokens around a prompt, got {max_tokens}")
    return replace(fmt, max_tokens=min(max_tokens, fmt.max_tokens))


class OnnxLengthPredictor:
    """``predict(prompts) -> buckets, probabilities, expected, quantile`` backed by onnxruntime.

    ``target`` is the package's target-model description (:mod:`predictor.target`: which model's lengths it learned),
    None for a package made before targets were recorded. ``precision`` picks the graph (:data:`PRECISIONS`).
    ``max_prompt_tokens`` is an ablation knob: serve with a smaller input budget than the package was trained with
    (:func:`input_budget`, a cap); ``trained_max_tokens`` keeps the trained one.
    """

    def __init__(self, package_dir: str | os.PathLike, threads: int | None = None, batch_size: int = 32,
                 token_budget: int = 2048, spin: bool | None = None, precision: str = "fp32",
                 max_prompt_tokens: int | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        d = Path(package_dir)
        self.precision = precision
        self.package_dir = d
        self.meta = read_meta(d)
        self.scheme = self.meta.buckets
        self.input_format = self.meta.input_format
        self.trained_max_tokens = self.input_format.max_tokens
        if max_prompt_tokens is not None:
            self.input_format = input_budget(self.input_format, max_prompt_tokens)
        self.target = self._target(self.meta.target)
        # a predictor for several served models reads the model's name before the request (predictor.conditioning)
        self.conditioned_models: list[str] | None = self.meta.conditioned_models or None
        # trained on answers so far (predictor.partial): it also predicts what is left of an answer being written
        self.remaining_length: bool = bool(self.meta.remaining_length)
        self.tokenizer = Tokenizer.from_file(str(d / TOKENIZER_FILE))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.routes = load_routes(d, self.meta.routes, self.scheme.n)  # {slice: baseline}; empty: the model answers every prompt
        self.fast_tier = load_fast_tier(d, self.meta.fast_tier, self.scheme.n)  # {slice: cheap model}; empty: no fast tier
        model = model_file(d, precision)
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
        return self._batch(probs, quantile, np.array([e.truncated for e in encoded]), np.full(len(encoded), MODEL, object))

    def _batch(self, probs: np.ndarray, quantile: float, truncated: np.ndarray, predictor: np.ndarray) -> PredictionBatch:
        return PredictionBatch(buckets=probs.argmax(1), probs=probs, expected=self.scheme.expected(probs),
                               quantile=self.scheme.quantile(probs, quantile), truncated=truncated, predictor=predictor)

    def route(self, prompts: Sequence[Prompt]) -> list[str]:
        """Which predictor answers each prompt: its slice's routed baseline, else the ONNX model (``lengthwise``)."""
        return [self.routes[s].name if (s := slice_of(self._as_turns(p))) in self.routes else MODEL for p in prompts]

    def probs_routed(self, prompts: Sequence[Prompt]) -> RoutedProbs:
        """Bucket probabilities with each prompt sent to its slice's predictor: the routed baselines answer their
        slices' prompts, one call per slice, and the ONNX model the rest in its length-grouped batches; rows come back
        in the prompts' order. Without routes this is exactly the model's :meth:`encode` and :meth:`logits_encoded`."""
        convs = [self._as_turns(p) for p in prompts]
        n = len(convs)
        probs = np.zeros((n, self.scheme.n))
        who = np.full(n, MODEL, dtype=object)
        truncated, tokens = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
        by_slice = rows_by_slice(convs) if self.routes else {}
        onnx_rows = list(range(n)) if not self.routes else []
        for part, rows in by_slice.items():
            if part not in self.routes:
                onnx_rows.extend(rows)
                continue
            baseline = self.routes[part]
            probs[rows] = baseline.probs([convs[i] for i in rows])
            who[rows] = baseline.name
        if onnx_rows:
            onnx_rows.sort()
            encoded = self.encode([convs[i] for i in onnx_rows])
            probs[onnx_rows] = softmax(self.logits_encoded([e.ids for e in encoded]).astype(np.float64))
            truncated[onnx_rows] = [e.truncated for e in encoded]
            tokens[onnx_rows] = [len(e.ids) for e in encoded]
        return RoutedProbs(probs, who, truncated, tokens)

    def has_fast_tier(self, prompts: Sequence[Prompt]) -> bool:
        """Whether the package's fast tier covers the slice of every one of ``prompts``."""
        return bool(self.fast_tier) and all(slice_of(self._as_turns(p)) in self.fast_tier for p in prompts)

    def probs_fast(self, prompts: Sequence[Prompt]) -> RoutedProbs:
        """Bucket probabilities from the package's fast tier alone (each prompt by its slice's model, the encoder never
        runs): what a saturated sidecar answers with. ``KeyError`` for a prompt whose slice the tier does not cover
        (:meth:`has_fast_tier` says beforehand)."""
        convs = [self._as_turns(p) for p in prompts]
        n = len(convs)
        probs, who = np.zeros((n, self.scheme.n)), np.full(n, MODEL, dtype=object)
        for part, rows in rows_by_slice(convs).items():
            model = self.fast_tier[part]
            probs[rows] = model.probs([convs[i] for i in rows])
            who[rows] = model.name
        return RoutedProbs(probs, who, np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64))

    def predict(self, prompts: Sequence[Prompt], quantile: float = 0.9) -> PredictionBatch:
        """Predict for prompts given as strings or as ``[(role, text), ...]`` conversations, each by its slice's
        predictor (:meth:`probs_routed`); ``predictor`` in the result says which answered each row."""
        if not prompts:
            raise ValueError("no prompts to predict")
        r = self.probs_routed(prompts)
        return self._batch(r.probs, quantile, r.truncated, r.predictor)
