"""Several services in one engine (``bench engine --services``): a base model and LoRA adapters of it, each request for
one of them, its length one of that service's own relabelled answers.

SeaLLM's and MuxServe's schedulers order requests by their service; ours orders them by a per-request prediction. On
the real engine the three meet where vLLM serves adapters: one batch, one KV pool, a request's service its adapter's
name. The engine runs random weights of the model's shape (the lengths are the services' real ones, ended by the
exact-length logits processor, out of every scheduler's sight) and a random rank-8 adapter per service, so each
request pays LoRA's compute as a served adapter does.

Predictions are made out of fold (``folds:VARIANT``): the labelled prompts are dealt into folds by conversation, and
each prompt's prediction comes from predictors fitted on the other folds (TF-IDF per service, pooled, conditioned on
the service, or the service's mean, SeaLLM's profile), so no request is predicted by a model that saw its prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from pathlib import Path

import numpy as np

from predictor.buckets import BucketScheme
from serving.policy.request import Prediction
from serving.sim.predictions import bucket_predictions
from serving.sim.workload import TraceRequest

LABELS = Path(__file__).resolve().parents[3] / "training" / "labels"
SMOLLM2 = "smollm2"
"""The committed services: SmolLM2-135M-Instruct and its two LoRA adapters (serving/launch/lora), each with its own
relabelled lengths."""
SMOLLM2_SERVICES = {
    "base": LABELS / "smollm2-135m-instruct.sharegpt.lengths.jsonl.xz",
    "smollm2-terse": LABELS / "smollm2-terse.sharegpt.lengths.jsonl.xz",
    "smollm2-detailed": LABELS / "smollm2-detailed.sharegpt.lengths.jsonl.xz",
}
FOLDS = "folds:"
"""The predictor spec prefix of out-of-fold predictions (``folds:tfidf``); valid with ``--services`` only."""
VARIANTS = ("tfidf", "tfidf-pooled", "tfidf-conditioned", "model-mean")
CACHE = Path("bench-results/services")  # the out-of-fold predictions, once per label files and settings
BUCKET_WIDTH = 100  # the buckets the out-of-fold predictors learn (as bench model-lengths scores these services)


class ServicesError(ValueError):
    """A services spec or label file that cannot be used; one line."""


def parse_services(spec: str) -> dict[str, Path]:
    """``smollm2`` (the committed services) or ``NAME=LABELS,NAME=LABELS,...``: the first entry is the base model, the
    others its adapters."""
    if spec.strip() == SMOLLM2:
        return dict(SMOLLM2_SERVICES)
    out: dict[str, Path] = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        name, eq, path = part.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ServicesError(f"--services: {part!r} is not NAME=LABELS (e.g. base=a.jsonl.xz,terse=b.jsonl.xz), "
                                f"nor {SMOLLM2!r}")
        if name.strip() in out:
            raise ServicesError(f"--services: {name.strip()!r} is named twice")
        out[name.strip()] = Path(path.strip())
    if len(out) < 2:
        raise ServicesError("--services: give a base and at least one adapter (two services or more)")
    return out


def check_variant(spec: str) -> str:
    """The variant a ``folds:`` spec names, or :class:`ServicesError`."""
    variant = spec.removeprefix(FOLDS)
    if variant not in VARIANTS:
        raise ServicesError(f"predictor {spec!r}: out-of-fold predictions are {', '.join(FOLDS + v for v in VARIANTS)}")
    return variant


@dataclasses.dataclass(frozen=True)
class ServicesTrace:
    """The requests (arrivals set later), each with its service, and every variant's prediction of each, in order."""

    requests: list[TraceRequest]
    predictions: dict[str, list[Prediction]]
    base: str
    summary: dict[str, dict]


def load_services(files: dict[str, Path], prompts: Path, max_requests: int, seed: int, max_model_len: int,
                  cap: int | None = None, folds: int = 5, cache: Path = CACHE) -> ServicesTrace:
    """``max_requests`` requests, each for a service drawn uniformly (seeded), then one of that service's labelled
    prompts not drawn before and one of its samples: the length that service answered it with (a censored sample at
    the cap, as it was served). Prompt lengths are the labels' (the served chat template's tokens); prompts whose
    prompt and ``cap`` (default: the labels' own cap) do not fit ``max_model_len`` are left out. Every labelled row is
    predicted out of fold, once per label files and settings: the predictions are kept in ``cache`` (fitting them takes
    minutes on two cores)."""
    from serving.bench.predictor.models import Answers, ModelLengthsError, predict_folds
    from training.data.example import DataError
    from training.data.loaders import load_examples
    from training.data.served import prompt_hash, read_served
    from training.evaluate import Predictions
    from training.split import split_of

    try:
        examples = load_examples(str(prompts), "sharegpt")
        records = {name: read_served(f)[0] for name, f in files.items()}
    except (DataError, OSError) as exc:
        raise ServicesError(f"--services: {' '.join(str(exc).split())}") from None
    labelled = {name: _labelled(recs) for name, recs in records.items()}
    cap = cap or max((int(r.get("max_tokens") or 0) for recs in records.values() for r in recs), default=0)
    if cap < 1:
        raise ServicesError("--services: the labels do not say their cap (max_tokens); give --max-tokens")
    first = {}
    for e in examples:
        first.setdefault(prompt_hash(e.turns), e)
    rows = [(m, h) for m in files for h in labelled[m] if h in first]
    if not rows:
        raise ServicesError(f"--services: no labelled prompt is in {prompts}: relabel from that prompt set")
    answers = Answers(np.array([m for m, _ in rows], dtype=object), [first[h].group for _, h in rows],
                      [first[h].turns[-1].text for _, h in rows],
                      np.array([float(np.mean(labelled[m][h][0])) for m, h in rows]),
                      np.array([split_of(first[h].group, seed=seed) for _, h in rows], dtype=object))
    scheme = BucketScheme.equal_width(BUCKET_WIDTH, cap)
    key = hashlib.sha256(json.dumps([[n, hashlib.sha256(Path(f).read_bytes()).hexdigest()] for n, f in files.items()]
                                    + [str(prompts), seed, cap, folds, BUCKET_WIDTH]).encode()).hexdigest()[:16]
    cached = cache / f"folds-{key}.npz"
    if cached.is_file():
        with np.load(cached) as z:
            made = {v: Predictions(z[f"{v}.probs"], z[f"{v}.point"]) for v in VARIANTS}
    else:
        try:
            _, made = predict_folds(answers, scheme, folds)  # every row scored: each predicted by the folds it is not in
        except ModelLengthsError as exc:
            raise ServicesError(f"--services: {exc}") from None
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(cached.stem + ".partial.npz")
        np.savez(tmp, **{f"{v}.{k}": getattr(made[v], k) for v in VARIANTS for k in ("probs", "point")})
        tmp.rename(cached)
    rng = random.Random(seed)
    pools = {m: [i for i, (mm, h) in enumerate(rows) if mm == m and labelled[m][h][1] + cap + 16 <= max_model_len]
             for m in files}
    for pool in pools.values():
        rng.shuffle(pool)
    reqs: list[TraceRequest] = []
    picked: list[int] = []
    names = list(files)
    while len(reqs) < max_requests and any(pools.values()):
        m = rng.choice([n for n in names if pools[n]])
        i = pools[m].pop()
        h = rows[i][1]
        samples, prompt_tokens = labelled[m][h]
        out = min(cap, max(1, rng.choice(samples)))
        reqs.append(TraceRequest(len(reqs), 0.0, prompt_tokens, out, service=m))
        picked.append(i)
    preds = {v: bucket_predictions(scheme, made[v].probs[picked].argmax(axis=1), made[v].probs[picked],
                                   np.minimum(cap, made[v].point[picked])) for v in VARIANTS}
    summary = {m: {"labelled_prompts": len(labelled[m]), "requests": sum(r.service == m for r in reqs),
                   "mean_tokens": float(np.mean([r.output_tokens for r in reqs if r.service == m] or [0]))}
               for m in names}
    return ServicesTrace(reqs, preds, names[0], summary)


def _labelled(records: list[dict]) -> dict[str, tuple[list[int], int]]:
    """Prompt hash -> (its samples' lengths, its prompt tokens in the served chat template)."""
    out: dict[str, tuple[list[int], int]] = {}
    for rec in sorted(records, key=lambda r: (r["prompt_hash"], r["sample"])):
        lengths, _ = out.setdefault(rec["prompt_hash"], ([], int(rec.get("prompt_tokens") or 0)))
        lengths.append(int(rec["response_tokens"]))
    return out


