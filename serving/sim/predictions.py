"""Response-length predictions for a workload, from perfect to realistic, so the simulator can chart
what a scheduler gains as prediction quality changes.

A predictor spec names where predictions come from:

* ``oracle`` — the true output length (upper bound on any benefit);
* ``noise:ACC`` — the truth times log-normal noise, its spread set so that top-1 accuracy at 200-token
  buckets is ``ACC`` on this very workload (our trained predictor reaches about 0.55 on ShareGPT);
* ``gauss:SIGMA`` — ``truth * (1 + N(0, SIGMA))``, the robustness test of SeaLLM-style papers;
* ``models:/NAME@ALIAS``, ``models:/NAME/VERSION``, ``runs:/...`` or a predictor package directory —
  the real ONNX length predictor run on the requests' prompt turns;
* ``tfidf`` or ``tfidf:K`` — a trained predictor for any workload with text, where no ONNX model is at hand: the project's
  TF-IDF + logistic-regression baseline (training.baselines), cross-fitted on the workload's own requests over ``K``
  folds (default 2) so that no request is predicted by a model that saw its length, one model per service;
* ``blind`` — another request's true length for each request: the workload's spread, no information (Kendall tau about 0);
* ``point:SPEC`` — SPEC's predictions without their bucket distribution (a request that outlives its
  prediction is then re-predicted by doubling): what the distribution is worth, measured;
* ``given:PATH`` — predictions a trained predictor made elsewhere for exactly this workload, read from a file
  (:mod:`serving.bench.gpu.predictions` writes one for the GPU run, whose machine has neither text nor predictor).

Noise is drawn from a hash of ``(seed, rid, generated)``, so a request's prediction does not depend on
which other requests are in the workload, and re-running gives the same numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from predictor.buckets import BucketScheme
from serving.policy.request import Prediction
from serving.sim.workload import TraceRequest, WorkloadError

# The accuracy that ``noise:ACC`` matches is measured at these buckets: 200-token wide up to 2048
# tokens, the scheme our predictor is trained and reported with (lengths >= 2000 share the last bucket).
ACCURACY_SCHEME = BucketScheme.equal_width(200, 2048)
PROGRESS_MIN = 500  # show a progress bar when the real model predicts more prompts than this

_VALID = ("oracle, noise:ACC (0 < ACC <= 1, e.g. noise:0.55), gauss:SIGMA (SIGMA >= 0, e.g. gauss:0.2), "
          "models:/NAME@ALIAS, models:/NAME/VERSION, runs:/RUN_ID/PATH, a predictor package directory, "
          "tfidf[:K] (K >= 2 folds, e.g. tfidf:5), blind, point:SPEC, or given:PATH (a predictions file)")
_SALT_PREDICT = 0


class PredictorSpecError(ValueError):
    """A predictor spec that names no known predictor or has an out-of-range parameter."""


class LengthOracle(Protocol):
    """What the simulator needs from a length predictor."""

    spec: str

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        """One prediction per request, in order."""
        ...

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        """Tokens still expected once ``generated`` were produced and the request is still running."""
        ...


# --- deterministic noise ----------------------------------------------------------------------------

_U64 = np.uint64


def _splitmix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser, vectorised (uint64 arithmetic wraps, which is the point)."""
    with np.errstate(over="ignore"):
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        return x ^ (x >> _U64(31))


def standard_normal(seed: int, rids, salt=0) -> np.ndarray:
    """N(0, 1) draws keyed by ``(seed, rid, salt)``: the same key always gives the same draw."""
    rid = np.atleast_1d(np.asarray(rids, dtype=np.int64)).astype(np.uint64)
    s = np.broadcast_to(np.atleast_1d(np.asarray(salt, dtype=np.int64)).astype(np.uint64), rid.shape)
    key = _splitmix(_splitmix(_splitmix(np.full(rid.shape, seed % 2**64, dtype=np.uint64)) ^ rid) ^ s)
    u1 = ((_splitmix(key ^ _U64(1)) >> _U64(11)).astype(np.float64) + 0.5) / 2.0**53
    u2 = ((_splitmix(key ^ _U64(2)) >> _U64(11)).astype(np.float64) + 0.5) / 2.0**53
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)


def bucket_accuracy(truth: np.ndarray, pred: np.ndarray, scheme: BucketScheme = ACCURACY_SCHEME) -> float:
    """Share of predictions in the same bucket as the truth (top-1 bucket accuracy)."""
    return float(np.mean(scheme.assign(truth) == scheme.assign(pred)))


def calibrate_sigma(truth: np.ndarray, z: np.ndarray, accuracy: float, scheme: BucketScheme = ACCURACY_SCHEME) -> float:
    """The log-normal spread σ at which ``truth * exp(σ z)`` has top-1 bucket accuracy ``accuracy``.

    With ``z`` fixed, a prediction that left its bucket never comes back as σ grows, so accuracy is
    monotone in σ and bisection finds the closest achievable value (steps of 1/len(truth)).
    Raises :class:`PredictorSpecError` when even very large noise keeps accuracy above the target:
    on workloads where most lengths share one bucket, random guesses are often right.
    """
    truth = np.asarray(truth, dtype=np.float64)
    if accuracy >= 1.0:
        return 0.0
    true_b = scheme.assign(truth)

    def acc(sigma: float) -> float:
        return float(np.mean(scheme.assign(truth * np.exp(sigma * z)) == true_b))

    hi = 1.0
    while acc(hi) > accuracy:
        hi *= 2.0
        if hi > 64.0:
            floor = acc(hi)
            if floor - accuracy > 0.01:
                raise PredictorSpecError(
                    f"noise:{accuracy:g} is below what this workload gives even with random guesses "
                    f"(top-1 accuracy {floor:.2f} at 200-token buckets: most lengths share a bucket); use noise:ACC "
                    f"with ACC >= {math.ceil(floor * 100) / 100:.2f} or gauss:SIGMA"
                )
            return hi
    lo, hi = bracket_spread(acc, accuracy, 0.0, hi, 60)  # acc(lo) > accuracy >= acc(hi)
    return lo if abs(acc(lo) - accuracy) < abs(acc(hi) - accuracy) else hi


def bracket_spread(metric: Callable[[float], float], target: float, lo: float, hi: float,
                   steps: int) -> tuple[float, float]:
    """Bisect ``[lo, hi]`` ``steps`` times for a noise spread whose ``metric`` (an accuracy, a Kendall tau) falls as the
    spread grows, ``metric(lo) > target >= metric(hi)``: the last bracket, whose ends straddle ``target``."""
    for _ in range(steps):
        mid = (lo + hi) / 2.0
        if metric(mid) > target:
            lo = mid
        else:
            hi = mid
    return lo, hi


def bucket_predictions(scheme: BucketScheme, buckets: np.ndarray, probs: np.ndarray,
                       lengths: np.ndarray) -> list[Prediction]:
    """A bucket predictor's output as :class:`Prediction` objects: each length (at least one token), its bucket with that
    bucket's top as ``hi``, and the bucket distribution the engine re-predicts from."""
    upper = scheme.upper()
    inner = tuple(int(e) for e in scheme.edges[1:])  # Prediction.edges: bucket tops but the last (open) one
    return [Prediction(length=float(max(1.0, n)), hi=float(upper[int(b)]), bucket=int(b), edges=inner,
                       probs=tuple(float(x) for x in p)) for b, p, n in zip(buckets, probs, lengths)]


def _point(length: float) -> Prediction:
    """A point prediction with its bucket under :data:`ACCURACY_SCHEME` (``hi`` = that bucket's top)."""
    b = int(ACCURACY_SCHEME.assign(length)[0])
    return Prediction(length=float(length), hi=float(max(ACCURACY_SCHEME.upper()[b], length)), bucket=b)


def _truth(requests: list[TraceRequest]) -> tuple[np.ndarray, np.ndarray]:
    return (np.array([r.output_tokens for r in requests], dtype=np.float64),
            np.array([r.rid for r in requests], dtype=np.int64))


def _need_text(spec: str, requests: list[TraceRequest]) -> None:
    """Raise :class:`WorkloadError` when a predictor that reads prompts is given requests without text."""
    missing = [r.rid for r in requests if not r.turns]
    if missing:
        raise WorkloadError(
            f"predictor {spec} needs prompt text, but {len(missing)} request(s) have none (e.g. rid {missing[0]}); "
            "use a ShareGPT or AlpacaEval workload, or oracle / noise:ACC / gauss:SIGMA for length-only traces"
        )


def _as_the_engine_does(prediction: Prediction, generated: int) -> float:
    """Re-predict a request that outlived its prediction from the first prediction alone, as the plug-in must.

    The engine never learns a request's true remaining length, so neither does the simulator: the conditional
    remaining length under the first prediction's bucket distribution when it has one, doubling when it has none
    (:meth:`Prediction.remaining_after`). Only :class:`ExactOracle`, the upper bound by design, sees the truth.
    """
    return float(prediction.remaining_after(generated))


# --- predictors ----------------------------------------------------------------------------------------


class ExactOracle:
    """The true output length: the best any length-aware scheduler could do."""

    def __init__(self) -> None:
        self.spec = "oracle"

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        return [Prediction(length=float(r.output_tokens), hi=float(r.output_tokens)) for r in requests]

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return float(max(1, request.output_tokens - generated))


class LogNormalNoise:
    """Truth × exp(N(0, σ)), σ calibrated per workload to a target top-1 bucket accuracy.

    Multiplicative noise keeps predictions positive and makes errors proportional to the length, as a
    classifier's are; matching accuracy (not σ) lets a chart put it beside the real predictor.
    """

    def __init__(self, accuracy: float, seed: int = 0) -> None:
        self.accuracy = accuracy
        self.seed = seed
        self.sigma: float | None = None  # set by predict() on the workload's own lengths
        self.achieved: float | None = None
        self.spec = f"noise:{accuracy:g}"

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        if not requests:
            return []
        truth, rids = _truth(requests)
        z = standard_normal(self.seed, rids, _SALT_PREDICT)
        self.sigma = calibrate_sigma(truth, z, self.accuracy)
        pred = np.maximum(1.0, truth * np.exp(self.sigma * z))
        self.achieved = bucket_accuracy(truth, pred)
        return [_point(p) for p in pred]

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return _as_the_engine_does(prediction, generated)


class GaussianNoise:
    """Truth × (1 + N(0, SIGMA)), floored at one token (additive relative error, SeaLLM-style)."""

    def __init__(self, sigma: float, seed: int = 0) -> None:
        self.sigma = sigma
        self.seed = seed
        self.spec = f"gauss:{sigma:g}"

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        if not requests:
            return []
        truth, rids = _truth(requests)
        pred = np.maximum(1.0, truth * (1.0 + self.sigma * standard_normal(self.seed, rids, _SALT_PREDICT)))
        return [_point(p) for p in pred]

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return _as_the_engine_does(prediction, generated)


class ModelPredictor:
    """The trained ONNX length predictor on each request's prompt turns.

    ``length`` is the expected length (or the ``quantile`` length when given), ``hi`` the top of the
    argmax bucket, and ``edges``/``probs`` the bucket distribution, which re-prediction conditions on.
    """

    def __init__(self, spec: str, predictor, quantile: float | None = None) -> None:
        self.spec = spec
        self.predictor = predictor  # predictor.runtime.OnnxLengthPredictor
        self.quantile = quantile

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        if not requests:
            return []
        _need_text(self.spec, requests)
        from serving.progress import Counter

        scheme: BucketScheme = self.predictor.scheme
        prompts = [[(str(role), str(text)) for role, text in _turn_pairs(r.turns)] for r in requests]
        q = self.quantile if self.quantile is not None else 0.9
        chunk = 256
        buckets, probs, lengths = [], [], []
        with Counter(f"predicting ({self.spec})", total=len(prompts), unit="prompt",
                     quiet=len(prompts) <= PROGRESS_MIN) as bar:
            for i in range(0, len(prompts), chunk):
                out = self.predictor.predict(prompts[i : i + chunk], quantile=q)
                buckets.append(np.asarray(out.buckets))
                probs.append(np.asarray(out.probs))
                lengths.append(np.asarray(out.quantile if self.quantile is not None else out.expected))
                bar.update(len(prompts[i : i + chunk]))
        return bucket_predictions(scheme, np.concatenate(buckets), np.concatenate(probs), np.concatenate(lengths))

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return _as_the_engine_does(prediction, generated)


# The buckets ``tfidf`` classifies into: doubling from 16 tokens, ten of them, the last [4096, 8192) (8,192: the context
# of the scenarios with text) and open above. Answers span two orders of magnitude (AlpacaEval's concise 7B model
# averages about 80 GPT-2 tokens, Llama-3-8B about 440, ShareGPT's tail reaches thousands): 200-token buckets put
# nearly every short answer in bucket 0, leaving nothing to rank among them, while doubling buckets resolve short and
# long answers alike to within a factor of two, which is what ordering requests by length needs.
TFIDF_SCHEME = BucketScheme.from_edges([16 * 2**k for k in range(9)], 8192)
TFIDF_FOLDS = 2       # K of plain ``tfidf``
TFIDF_VAL_SHARE = 5   # one training row in this many is held back to choose the regularisation C ...
TFIDF_MIN_VAL = 50    # ... when there are at least this many (fewer: TfidfLogReg takes its middle C)
TFIDF_MIN_ROWS = 20   # a service with fewer training rows in a fold is fitted on every service's (too few alone)
_SALT_FOLD, _SALT_VAL = 1, 2


def _hashed(rids: np.ndarray, salt: int, k: int) -> np.ndarray:
    """A fixed hash of each rid (salted) modulo ``k``: a request's fold depends on its rid and nothing else."""
    h = _splitmix(_splitmix(np.asarray(rids, dtype=np.int64).astype(np.uint64)) ^ _U64(salt))
    return (h % _U64(k)).astype(np.int64)


class CrossFitTfidf:
    """A trained predictor for any workload with text: TF-IDF + logistic regression over :data:`TFIDF_SCHEME`,
    cross-fitted on the workload's own requests.

    The requests are dealt into ``folds`` folds by a fixed hash of their rid, and each fold is predicted by
    :class:`training.baselines.TfidfLogReg` (per slice, first turns and later turns, as
    :func:`training.baselines.fit_sliced` fits it in the training report) fitted on the other folds' prompts and true
    lengths, one row in :data:`TFIDF_VAL_SHARE` of those held back to choose C. So no request is predicted by a model
    that saw its length. Where the workload has several services (``TraceRequest.service``) each service is fitted on
    its own rows, since its predictor is for its lengths, with the same folds.

    ``length`` is the expected length under the bucket distribution (bucket centres: the training rows' mean length in
    each bucket), or its ``quantile`` when given, as :class:`ModelPredictor`'s. After :meth:`predict`, ``achieved`` is
    the top-1 accuracy at :data:`ACCURACY_SCHEME` and ``quality`` the Kendall tau per service (key ``all`` when the
    workload has none), both on the held-out predictions; ``fits`` says what each fit saw and chose.
    """

    def __init__(self, folds: int = TFIDF_FOLDS, quantile: float | None = None) -> None:
        self.folds = folds
        self.quantile = quantile
        self.spec = "tfidf" if folds == TFIDF_FOLDS else f"tfidf:{folds}"
        self.achieved: float | None = None
        self.quality: dict[str, float] = {}
        self.fits: list[dict] = []

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        if not requests:
            return []
        _need_text(self.spec, requests)
        from threadpoolctl import threadpool_limits

        from training.baselines import TfidfLogReg, fit_sliced, rows_of
        from training.data.example import Example, Turn
        from training.evaluate import kendall_tau

        examples = [Example(str(r.rid), tuple(Turn(role, text) for role, text in _turn_pairs(r.turns)),
                            response_tokens=r.output_tokens) for r in requests]
        rows = rows_of(examples, np.array([r.prompt_tokens for r in requests]))
        truth, rids = _truth(requests)
        fold, held = _hashed(rids, _SALT_FOLD, self.folds), _hashed(rids, _SALT_VAL, TFIDF_VAL_SHARE) == 0
        service = np.array([r.service for r in requests], dtype=object)
        probs, lengths = np.zeros((len(requests), TFIDF_SCHEME.n)), np.zeros(len(requests))
        self.fits = []
        for f in range(self.folds):
            for s in sorted(set(service[fold == f])):
                test = (fold == f) & (service == s)
                fit = (fold != f) & (service == s)
                if fit.sum() < TFIDF_MIN_ROWS:
                    fit = fold != f
                if not fit.any():
                    raise WorkloadError(f"predictor {self.spec} learns each request's length from the others', but all "
                                        f"{len(requests)} request(s) fall in one of its {self.folds} folds; use more "
                                        "requests")
                val = fit & held if fit.sum() >= TFIDF_MIN_VAL else np.zeros_like(fit)
                scheme = TFIDF_SCHEME.with_centers(truth[fit])
                # One BLAS thread: these fits are small, and threads contending for shared cores made them 10-100x slower.
                with threadpool_limits(limits=1):
                    pred, info = fit_sliced(TfidfLogReg, scheme, rows.take(fit & ~val), rows.take(val), rows.take(test))
                probs[test] = pred.probs
                lengths[test] = pred.point if self.quantile is None else scheme.quantile(pred.probs, self.quantile)
                self.fits.append({"service": s, "fold": f, "n_train": int((fit & ~val).sum()), "n_val": int(val.sum()),
                                  "pooled": bool((service[fit] != s).any()), "slices": info})
        self.achieved = bucket_accuracy(truth, lengths)
        self.quality = {s or "all": kendall_tau(lengths[service == s], truth[service == s]) for s in sorted(set(service))}
        return bucket_predictions(TFIDF_SCHEME, probs.argmax(1), probs, lengths)

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return _as_the_engine_does(prediction, generated)


class Blind:
    """A predictor that knows nothing: each request is predicted another request's true length (a seeded permutation),
    so the predictions have the workload's own spread and a Kendall tau of about 0 against the truth."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.spec = "blind"

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        truth, _ = _truth(requests)
        order = np.random.default_rng(self.seed + 104729).permutation(len(truth))
        return [_point(max(1.0, float(truth[i]))) for i in order]

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return _as_the_engine_does(prediction, generated)


class GivenPredictions:
    """Predictions made elsewhere for exactly these requests, looked up by request id (``given:PATH``, or a bench's
    cross-fitted folds). A request the predictions do not cover, or whose length differs from the one they were made
    for, is an error: predictions for another workload would pass for a weak predictor."""

    def __init__(self, spec: str, by_rid: dict[int, Prediction], made_for: dict[int, int] | None = None) -> None:
        self.spec, self._by_rid, self._made_for = spec, by_rid, made_for or {}

    @classmethod
    def from_file(cls, spec: str, path: Path) -> GivenPredictions:
        """Read a file of :func:`serving.bench.gpu.predictions.make`: ``{"predictions": {rid: {length, hi, bucket,
        edges, probs, truth_tokens}}}``."""
        try:
            doc = json.loads(path.expanduser().read_text())
            rows = doc["predictions"]
            by_rid = {int(k): Prediction(length=float(v["length"]), hi=v.get("hi"), bucket=v.get("bucket"),
                                         edges=tuple(v["edges"]) if v.get("edges") else None,
                                         probs=tuple(v["probs"]) if v.get("probs") else None) for k, v in rows.items()}
            made_for = {int(k): int(v["truth_tokens"]) for k, v in rows.items() if "truth_tokens" in v}
        except FileNotFoundError:
            raise PredictorSpecError(f"{spec}: no file {path}; make one with python -m serving.bench.gpu.predictions") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PredictorSpecError(f"{spec}: {path} is not a predictions file ({type(exc).__name__}: {exc})") from None
        return cls(spec, by_rid, made_for)

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        missing = [r.rid for r in requests if r.rid not in self._by_rid]
        if missing:
            raise PredictorSpecError(f"{self.spec}: no prediction for {len(missing)} request(s) (e.g. rid {missing[0]}); "
                                     "the file was made for a smaller or another workload")
        other = [r.rid for r in requests if self._made_for.get(r.rid, r.output_tokens) != r.output_tokens]
        if other:
            raise PredictorSpecError(f"{self.spec}: request {other[0]} is not the request its prediction was made for "
                                     f"({len(other)} differ in length): the file belongs to another workload")
        return [self._by_rid[r.rid] for r in requests]

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return _as_the_engine_does(prediction, generated)


class PointOnly:
    """Another predictor's point predictions without their bucket distribution, so that re-prediction doubles."""

    def __init__(self, base: LengthOracle) -> None:
        self.base = base
        self.spec = f"point:{base.spec}"

    def predict(self, requests: list[TraceRequest]) -> list[Prediction]:
        return [dataclasses.replace(p, edges=None, probs=None) for p in self.base.predict(requests)]

    def repredict(self, request: TraceRequest, generated: int, prediction: Prediction) -> float:
        return _as_the_engine_does(prediction, generated)


def _turn_pairs(turns) -> list[tuple[str, str]]:
    """``(role, text)`` pairs from tuples or ``training.data.Turn`` objects."""
    return [(t.role, t.text) if hasattr(t, "role") else (t[0], t[1]) for t in turns]


# --- specs ----------------------------------------------------------------------------------------------


def _number(spec: str, value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise PredictorSpecError(f"predictor spec {spec!r} needs a number after ':'; valid forms: {_VALID}") from None
    if not math.isfinite(x):
        raise PredictorSpecError(f"predictor spec {spec!r} needs a finite number; valid forms: {_VALID}")
    return x


def _load_model(spec: str):
    if spec.startswith(("models:/", "runs:/")):
        from registry.store import load_predictor

        try:
            return load_predictor(spec)
        except Exception as exc:  # noqa: BLE001 - MLflow raises many types for "no such model/alias"
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise PredictorSpecError(f"cannot load predictor {spec}: {first}") from None
    from predictor.package_meta import META_FILE
    from predictor.runtime import MODEL_FILE, OnnxLengthPredictor

    d = Path(spec).expanduser()
    if not ((d / MODEL_FILE).exists() and (d / META_FILE).exists()):
        raise PredictorSpecError(f"{d} is not a predictor package (needs {MODEL_FILE} and {META_FILE}); valid forms: {_VALID}")
    try:
        return OnnxLengthPredictor(d)
    except Exception as exc:  # noqa: BLE001 - onnxruntime/tokenizers raise their own types on bad files
        raise PredictorSpecError(f"cannot load predictor package {d}: "
                                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None


def names_a_model(spec: str) -> bool:
    """Whether ``spec`` names a trained model (a registry URI or a package directory) rather than a synthetic predictor."""
    s = spec.strip()
    if s.lower().startswith("point:"):
        return names_a_model(s[len("point:"):])
    kind = s.partition(":")[0].lower()
    return s.startswith(("models:/", "runs:/")) or (
        kind not in ("oracle", "noise", "gauss", "tfidf", "blind", "given") and ("/" in s or Path(s).expanduser().is_dir()))


def check_spec(spec: str) -> None:
    """Raise :class:`PredictorSpecError` for a malformed spec before any work is done; a model is only loaded later."""
    if not isinstance(spec, str) or not names_a_model(spec):
        make_predictor(spec)


def make_predictor(spec: str, seed: int = 0, quantile: float | None = None) -> LengthOracle:
    """Build the predictor a spec names (see the module doc); a bad spec raises :class:`PredictorSpecError`.

    ``quantile`` (a real model or ``tfidf`` only) makes ``length`` the bucket-distribution quantile instead of the
    mean, i.e. padded predictions.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise PredictorSpecError(f"empty predictor spec; valid forms: {_VALID}")
    s = spec.strip()
    if s.lower().startswith("point:"):
        return PointOnly(make_predictor(s[len("point:"):], seed, quantile))
    kind, _, value = s.partition(":")
    kind_l = kind.lower()
    is_model = names_a_model(s)
    if quantile is not None:
        if not is_model and kind_l != "tfidf":
            raise PredictorSpecError(f"quantile applies only to a real model predictor or tfidf, not to {s!r}")
        if not 0.0 < quantile < 1.0:
            raise PredictorSpecError(f"quantile must be in (0, 1), got {quantile}")
    if is_model:
        return ModelPredictor(s, _load_model(s), quantile)
    if kind_l == "given" and value:
        return GivenPredictions.from_file(s, Path(value))
    if kind_l == "blind" and not value:
        return Blind(seed)
    if kind_l == "oracle" and not value:
        return ExactOracle()
    if kind_l == "noise" and value:
        acc = _number(s, value)
        if not 0.0 < acc <= 1.0:
            raise PredictorSpecError(f"noise accuracy must be in (0, 1], got {value}; e.g. noise:0.55")
        return LogNormalNoise(acc, seed)
    if kind_l == "gauss" and value:
        sigma = _number(s, value)
        if sigma < 0.0:
            raise PredictorSpecError(f"gauss sigma must be >= 0, got {value}; e.g. gauss:0.2")
        return GaussianNoise(sigma, seed)
    if kind_l == "tfidf":
        folds = _number(s, value) if value else TFIDF_FOLDS
        if folds != int(folds) or folds < 2:
            raise PredictorSpecError(f"tfidf folds must be a whole number >= 2, got {value}; e.g. tfidf:5")
        return CrossFitTfidf(int(folds), quantile)
    raise PredictorSpecError(f"unknown predictor spec {spec!r}; valid forms: {_VALID}")
