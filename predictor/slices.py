"""Per-slice routing: a package may ship, beside its ONNX model, a cheap baseline for a slice where it ranked better.

Training reports every predictor on a conversation's first turns and on its later turns apart, and names the best on
each (by pairwise ranking accuracy). When that is a baseline that can serve, ``train-predictor`` writes the fitted
baseline into the package (``slices/<slice>.skops``) and ``meta.json`` records the routing table::

    "routes": {"first_turn": {"predictor": "tfidf-logreg", "file": "slices/first_turn.skops", "test_metrics": {...}},
               "later_turns": {"predictor": "lengthwise", "test_metrics": {...}}}

At serving time (predictor.runtime) each prompt goes to its slice's predictor: the baseline gives bucket probabilities
over the package's own scheme, and the expected and quantile lengths come from them exactly as from the model's.

What can serve (:data:`SERVABLE`): ``tfidf-logreg`` (it reads the prompt's text and length hints, computed by
predictor.features as in training) and ``global-median`` (one bucket distribution for every prompt: shipped only if
it wins a slice, which takes a model that ranks worse than a coin). ``prompt-length-bin`` cannot: it conditions on
the prompt's length in the *target* model's tokens, and a package carries the predictor backbone's tokenizer, not the
target's; counting with the wrong tokenizer would move every prompt across the bins it was fitted on.

A package may also carry a **fast tier** (``meta.json``'s ``fast_tier``: ``fast/<slice>.skops``, the TF-IDF model training
fitted for each slice, whatever the routes say): what a saturated sidecar answers with when its encoder's queue would
make a prediction late (predictor.sidecar.batcher), instead of the caller's constant fallback.

Files are written with ``skops.io``, not pickle: loading one builds only the types listed in :data:`TRUSTED_TYPES`
(and numpy/builtins), so a package from the registry cannot run code when the sidecar opens it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from predictor.features import Turns, baseline_text, is_first_turn, length_hints, tfidf_matrix

# The slices a package may route, as training.evaluate names them; "all" is a report slice, not a route.
SLICES = ("first_turn", "later_turns")
MODEL = "lengthwise"  # the package's own ONNX model
TFIDF = "tfidf-logreg"
CONSTANT = "global-median"
SERVABLE = (TFIDF, CONSTANT)
ROUTES_KEY = "routes"
SLICES_DIR = "slices"
FAST_TIER_KEY = "fast_tier"
FAST_TIER_DIR = "fast"
FILE_FORMAT = 1
# What a slice file may hold beyond numpy arrays and builtins: the vectorizer and the classifier of tfidf-logreg.
TRUSTED_TYPES = ("sklearn.feature_extraction.text.TfidfVectorizer", "sklearn.linear_model._logistic.LogisticRegression")


class SliceModelError(ValueError):
    """A package's routing table or slice file that cannot be served: missing, corrupt, untrusted or inconsistent."""


def slice_of(turns: Turns) -> str:
    """``first_turn`` for a conversation's opening request (no earlier user turn), else ``later_turns``."""
    return SLICES[0] if is_first_turn(turns) else SLICES[1]


def rows_by_slice(conversations: Sequence[Turns]) -> dict[str, list[int]]:
    """``{slice: indices of the conversations in it}``, in the conversations' order within each slice."""
    out: dict[str, list[int]] = {}
    for i, conv in enumerate(conversations):
        out.setdefault(slice_of(conv), []).append(i)
    return out


class BucketModel(Protocol):
    """A routed predictor: bucket probabilities over the package's scheme for each conversation."""

    name: str

    def probs(self, conversations: Sequence[Turns]) -> np.ndarray: ...


@dataclass
class TfidfBuckets:
    """TF-IDF of the last turns plus the length hints (predictor.features), multinomial logistic regression over the
    buckets. ``classifier`` is None when training saw a single bucket (``classes[0]``): it predicts that bucket."""

    vectorizer: Any
    classifier: Any | None
    classes: np.ndarray
    n_buckets: int
    name: str = TFIDF

    def probs_of(self, texts: Sequence[str], hints: np.ndarray) -> np.ndarray:
        """``[n, n_buckets]`` probabilities from the features' raw parts (what training holds as rows)."""
        probs = np.zeros((len(texts), self.n_buckets))
        if self.classifier is None:
            probs[:, int(self.classes[0])] = 1.0
        else:
            probs[:, self.classifier.classes_] = self.classifier.predict_proba(tfidf_matrix(self.vectorizer, texts, hints))
        return probs

    def probs(self, conversations: Sequence[Turns]) -> np.ndarray:
        hints = np.array([length_hints(c) for c in conversations], dtype=np.float64).reshape(len(conversations), 2)
        return self.probs_of([baseline_text(c) for c in conversations], hints)

    def state(self) -> dict:
        # The fitted vocabulary maps each term to a numpy integer, which skops writes as one array file per term:
        # a 50,000-term vocabulary took over a minute to save and 13 s to load. As Python ints it is one JSON object
        # (1.6 s to save, 2.3 s to load).
        vectorizer = copy.copy(self.vectorizer)
        if isinstance(getattr(vectorizer, "vocabulary_", None), dict):
            vectorizer.vocabulary_ = {term: int(col) for term, col in vectorizer.vocabulary_.items()}
        return {"vectorizer": vectorizer, "classifier": self.classifier, "classes": np.asarray(self.classes),
                "n_buckets": int(self.n_buckets)}


@dataclass
class ConstantBuckets:
    """One bucket distribution for every prompt (``global-median``: the training lengths' histogram)."""

    dist: np.ndarray
    name: str = CONSTANT

    def probs(self, conversations: Sequence[Turns]) -> np.ndarray:
        dist = np.asarray(self.dist, dtype=np.float64)
        return np.tile(dist / dist.sum(), (len(conversations), 1))

    def state(self) -> dict:
        return {"dist": np.asarray(self.dist, dtype=np.float64), "n_buckets": len(self.dist)}


def save_model(model: TfidfBuckets | ConstantBuckets, path: Path) -> None:
    """Write a routed predictor with ``skops.io`` (never pickle)."""
    import skops.io as sio

    path.parent.mkdir(parents=True, exist_ok=True)
    sio.dump({"format": FILE_FORMAT, "predictor": model.name, **model.state()}, path)


def load_model(path: Path, n_buckets: int) -> BucketModel:
    """Read a file :func:`save_model` wrote; :class:`SliceModelError` naming the file and what is wrong with it when
    it is missing, corrupt, holds an untrusted type or does not fit a scheme of ``n_buckets`` buckets."""
    import skops.io as sio

    if not path.is_file():
        raise SliceModelError(f"slice model {path} is missing")
    try:
        untrusted = [t for t in sio.get_untrusted_types(file=path) if t not in TRUSTED_TYPES]
        if untrusted:
            raise SliceModelError(f"slice model {path} holds types this runtime does not trust: {', '.join(untrusted)}")
        state = sio.load(path, trusted=list(TRUSTED_TYPES))
    except SliceModelError:
        raise
    except Exception as exc:  # noqa: BLE001 - skops raises zip, JSON, key and type errors alike for a damaged file
        raise SliceModelError(f"slice model {path} cannot be read ({type(exc).__name__}: {exc})") from None
    model = _from_state(state, path)
    if int(state.get("n_buckets", -1)) != n_buckets:
        raise SliceModelError(f"slice model {path} predicts {state.get('n_buckets')} buckets, the package's scheme has "
                              f"{n_buckets}")
    return model


def _from_state(state: object, path: Path) -> BucketModel:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    if not isinstance(state, dict) or state.get("format") != FILE_FORMAT:
        raise SliceModelError(f"slice model {path} is not a slice file of format {FILE_FORMAT}")
    kind = state.get("predictor")
    if kind == TFIDF:
        vec, clf = state.get("vectorizer"), state.get("classifier")
        if not isinstance(vec, TfidfVectorizer) or not (clf is None or isinstance(clf, LogisticRegression)):
            raise SliceModelError(f"slice model {path} says tfidf-logreg but holds no fitted vectorizer and classifier")
        return TfidfBuckets(vec, clf, np.asarray(state["classes"]), int(state["n_buckets"]))
    if kind == CONSTANT:
        return ConstantBuckets(np.asarray(state["dist"], dtype=np.float64))
    raise SliceModelError(f"slice model {path} holds predictor {kind!r}; this runtime serves {', '.join(SERVABLE)}")


def load_routes(package_dir: Path, routes: object, n_buckets: int) -> dict[str, BucketModel]:
    """``{slice: routed predictor}`` of a package's routing table (``meta.json``'s routes; slices its ONNX model answers
    are left out); empty for a package without routes. :class:`SliceModelError` for a table this runtime cannot serve
    as recorded."""
    routes = routes or {}
    if not isinstance(routes, Mapping):
        raise SliceModelError(f"meta.json's {ROUTES_KEY} must map a slice to its predictor, got {type(routes).__name__}")
    out: dict[str, BucketModel] = {}
    for part, route in routes.items():
        if part not in SLICES:
            raise SliceModelError(f"meta.json routes slice {part!r}; this runtime knows {', '.join(SLICES)}")
        name = route.get("predictor") if isinstance(route, Mapping) else None
        if name == MODEL:
            continue
        if name not in SERVABLE or not route.get("file"):
            raise SliceModelError(f"meta.json routes {part} to {name!r} without a servable file; this runtime serves "
                                  f"{', '.join((MODEL, *SERVABLE))}")
        model = load_model(Path(package_dir) / str(route["file"]), n_buckets)
        if model.name != name:
            raise SliceModelError(f"meta.json routes {part} to {name} but {route['file']} holds {model.name}")
        out[part] = model
    return out


def routes_tag(routes: Mapping | None) -> str | None:
    """The routing table in one line, e.g. ``first_turn=tfidf-logreg,later_turns=lengthwise`` (None: no routes)."""
    if not routes:
        return None
    return ",".join(f"{part}={route.get('predictor', MODEL)}" for part, route in routes.items())



def load_fast_tier(package_dir: Path, tier: object, n_buckets: int) -> dict[str, BucketModel]:
    """``{slice: model}`` of a package's fast tier (``meta.json``'s fast_tier; empty without one); :class:`SliceModelError`
    for one recorded but unreadable, as for a route."""
    tier = tier or {}
    files = tier.get("files") if isinstance(tier, Mapping) else None
    if not isinstance(files, Mapping):
        if tier:
            raise SliceModelError(f"meta.json's {FAST_TIER_KEY} must name its files per slice")
        return {}
    out: dict[str, BucketModel] = {}
    for part, file in files.items():
        if part not in SLICES:
            raise SliceModelError(f"meta.json's {FAST_TIER_KEY} names slice {part!r}; this runtime knows {', '.join(SLICES)}")
        out[part] = load_model(Path(package_dir) / str(file), n_buckets)
    return out
