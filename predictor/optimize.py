"""A fused encoder graph: onnxruntime's transformer optimizer run on a package's ``model.onnx``.

Why: on a CPU the predictor's encoder (a 6-layer MiniLM) spends much of its time outside the matrix products, in
the dozens of small operators that make up each attention block, layer norm and GELU. onnxruntime's transformer
optimizer (``onnxruntime.transformers.optimizer.optimize_model``, model type ``bert``) replaces each of them by one
fused kernel (``Attention``, ``SkipLayerNormalization``, ``BiasGelu``), and int8 quantisation of the fused graph
then also turns ``Attention`` into ``QAttention``.

The optimizer matches the attention that Hugging Face's eager implementation exports. Our packages are exported with
PyTorch's scaled-dot-product attention, whose ONNX decomposition differs in two ways the matcher does not know:
the softmax is guarded against all-masked rows (``Where(IsNaN(softmax), 0, softmax)``) and the 1/sqrt(d) scale is
split into two factors applied to the query and the key before their product. :func:`eager_attention` rewrites both
into the eager form first (the guard never fires here: every prompt keeps at least its first token unmasked, so no
row is all masked; the two scalar factors multiply into one after the product), and then the optimizer's own
fusions apply. What was fused is returned, so a caller can see an attention block that was not.

Nothing here imports another module of the project, so the runtime can import it lazily when a fused variant is
first asked for.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

# What the fused graph counts, in the order they are reported.
FUSED_OPS = ("Attention", "SkipLayerNormalization", "LayerNormalization", "BiasGelu", "Gelu", "FastGelu",
             "EmbedLayerNormalization")


class FusionError(RuntimeError):
    """The model is not an encoder this optimizer understands (no attention heads or hidden size found)."""


@dataclass(frozen=True)
class EncoderShape:
    """What the optimizer needs to know about the encoder, read from the graph itself."""

    num_heads: int
    hidden_size: int
    layers: int


@dataclass(frozen=True)
class FusionReport:
    """The encoder's shape and how many of each fused operator the optimized graph holds."""

    shape: EncoderShape
    fused: dict[str, int]

    @property
    def complete(self) -> bool:
        """Every attention block became one ``Attention`` operator."""
        return self.fused.get("Attention", 0) == self.shape.layers

    def to_dict(self) -> dict:
        return {"num_heads": self.shape.num_heads, "hidden_size": self.shape.hidden_size, "layers": self.shape.layers,
                "fused": dict(self.fused), "complete": self.complete}


class _Graph:
    """Lookups over one ONNX graph: producers, consumers and constant values of tensors."""

    def __init__(self, model):
        self.graph = model.graph
        self.producer = {out: n for n in self.graph.node for out in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.graph.node:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)
        self.initializers = {t.name: t for t in self.graph.initializer}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of a tensor that is an initializer or a ``Constant`` node's output, else None."""
        from onnx import numpy_helper

        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value":
                    return numpy_helper.to_array(attr.t)
        return None

    def shape_tail(self, reshape) -> tuple[int, int] | None:
        """The last two entries of a Reshape's target shape when both are constants: (heads, head size) for the
        reshape that splits a projection into heads. The shape is a constant or a Concat whose last two parts are."""
        whole = self.constant(reshape.input[1])
        if whole is not None and whole.size >= 2:
            return int(whole.reshape(-1)[-2]), int(whole.reshape(-1)[-1])
        concat = self.producer.get(reshape.input[1])
        if concat is None or concat.op_type != "Concat" or len(concat.input) < 2:
            return None
        parts = [self.constant(x) for x in concat.input[-2:]]
        if any(p is None or p.size != 1 for p in parts):
            return None
        return int(parts[0].reshape(-1)[0]), int(parts[1].reshape(-1)[0])


def encoder_shape(model) -> EncoderShape:
    """Attention heads, hidden size and layer count of a BERT-like encoder, read from the graph: the hidden size is
    the width of the embedding table the input ids index; the heads are what the query projection is reshaped into
    before its (0, 2, 1, 3) transpose; the layers are the softmaxes. FusionError when any is missing."""
    g = _Graph(model)
    hidden = 0
    for node in g.consumers.get("input_ids", []):
        if node.op_type == "Gather" and node.input[0] in g.initializers:
            hidden = int(g.initializers[node.input[0]].dims[-1])
            break
    heads = 0
    for node in g.graph.node:
        if node.op_type != "Reshape" or not hidden:
            continue
        perms = [next((list(a.ints) for a in c.attribute if a.name == "perm"), None) for c in g.consumers.get(node.output[0], [])
                 if c.op_type == "Transpose"]
        tail = g.shape_tail(node)
        if [0, 2, 1, 3] not in perms or not tail or tail[1] <= 0 or hidden % tail[1]:
            continue
        if tail[0] in (-1, hidden // tail[1]):  # PyTorch exports the head count as -1 (inferred)
            heads = hidden // tail[1]
            break
    layers = sum(1 for n in g.graph.node if n.op_type == "Softmax")
    if not hidden or not heads or not layers:
        raise FusionError(f"not a BERT-like encoder this optimizer understands (hidden size {hidden or '?'}, "
                          f"heads {heads or '?'}, attention layers {layers})")
    return EncoderShape(heads, hidden, layers)


def eager_attention(model) -> int:
    """Rewrite PyTorch's scaled-dot-product attention decomposition into the eager form the optimizer fuses, in
    place; returns how many attention blocks were rewritten (0 for a graph already in the eager form)."""
    from onnx import helper, numpy_helper

    g = _Graph(model)
    drop: list = []
    add: list = []
    rewritten = 0
    for softmax in [n for n in g.graph.node if n.op_type == "Softmax"]:
        # 1. the guard against all-masked rows: Where(IsNaN(p), 0, p) -> p
        for guard in [c for c in g.consumers.get(softmax.output[0], []) if c.op_type == "Where"]:
            isnan = g.producer.get(guard.input[0])
            if isnan is None or isnan.op_type != "IsNaN" or guard.input[2] != softmax.output[0]:
                continue
            zero = g.constant(guard.input[1])
            if zero is None or zero.size != 1 or float(zero.reshape(-1)[0]) != 0.0:
                continue
            for user in g.consumers.get(guard.output[0], []):
                for i, name in enumerate(user.input):
                    if name == guard.output[0]:
                        user.input[i] = softmax.output[0]
            drop += [guard, isnan]
        # 2. the scale split over query and key: MatMul(q * a, k * b) -> MatMul(q, k) * (a * b)
        add_mask = g.producer.get(softmax.input[0])
        if add_mask is None or add_mask.op_type != "Add":
            continue
        matmul = next((g.producer[x] for x in add_mask.input if x in g.producer and g.producer[x].op_type == "MatMul"), None)
        if matmul is None:
            continue
        muls = [g.producer.get(x) for x in matmul.input]
        if any(m is None or m.op_type != "Mul" for m in muls):
            continue
        scales = [g.constant(m.input[1]) for m in muls]
        if any(s is None or s.size != 1 for s in scales):
            continue
        matmul.input[0], matmul.input[1] = muls[0].input[0], muls[1].input[0]
        scale_name = f"{matmul.name}/eager_scale"
        scaled = f"{matmul.output[0]}/scaled"
        g.graph.initializer.append(numpy_helper.from_array(
            np.array(float(scales[0].reshape(-1)[0]) * float(scales[1].reshape(-1)[0]), dtype=np.float32), scale_name))
        add.append((matmul, helper.make_node("Mul", [matmul.output[0], scale_name], [scaled], name=f"{matmul.name}/eager_mul")))
        for i, name in enumerate(add_mask.input):
            if name == matmul.output[0]:
                add_mask.input[i] = scaled
        drop += [m for m in muls if len(g.consumers.get(m.output[0], [])) == 1]
        rewritten += 1
    for node in drop:
        g.graph.node.remove(node)
    used = {name for n in g.graph.node for name in n.input} | {o.name for o in g.graph.output}
    for node in [n for n in g.graph.node if n.op_type == "Constant" and n.output[0] not in used]:
        g.graph.node.remove(node)  # the factors and the guard's zero, now unused
    for after, node in add:  # keep the graph topologically sorted: the new Mul right after its MatMul
        nodes = list(g.graph.node)
        g.graph.node.insert(nodes.index(after) + 1, node)
    return rewritten


def fuse(src: Path, dst: Path) -> FusionReport:
    """Write the fused graph of the model at ``src`` to ``dst``; returns what was fused.

    The optimizer runs onnxruntime's basic graph optimizations first (constant folding, cast elimination; level 1,
    which leaves a graph that still runs on any CPU), then its Python fusions. The fused operators are onnxruntime
    contrib ops: the graph runs on onnxruntime only, as every package does.
    """
    import onnx
    import onnxruntime as ort
    from onnxruntime.transformers.optimizer import optimize_model

    model = onnx.load(str(src))
    shape = encoder_shape(model)
    eager_attention(model)
    root = logging.getLogger()
    level = root.level
    root.setLevel(max(level, logging.WARNING))  # the optimizer reports each fusion at INFO
    ort.set_default_logger_severity(3)  # and onnxruntime each constant it folds away, as a warning
    try:
        opt = optimize_model(model, model_type="bert", num_heads=shape.num_heads, hidden_size=shape.hidden_size)
    finally:
        root.setLevel(level)
        ort.set_default_logger_severity(2)
    counts = Counter(n.op_type for n in opt.model.graph.node)
    report = FusionReport(shape, {op: counts[op] for op in FUSED_OPS if counts[op]})
    if not report.complete:
        log.warning("the fused graph has %d Attention operators for %d attention layers: the rest run unfused",
                    report.fused.get("Attention", 0), shape.layers)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.tmp{os.getpid()}")
    opt.save_model_to_file(str(tmp))
    os.replace(tmp, dst)
    return report
