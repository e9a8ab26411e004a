"""Response-length buckets: the label space of the length classifier.

TetriInfer predicts a *range* of response lengths (RL) rather than an exact count, because sampling
makes the exact count noisy while a range is enough to bound KV use. A :class:`BucketScheme` holds the
bucket edges in tokens of the target model's tokenizer and travels inside every model artifact, so a
served model and its training data always agree on what "bucket 3" means.

Bucket ``i`` covers ``[edges[i], edges[i+1])``; lengths at or above the last edge fall into the last
bucket, whose nominal upper bound is ``max_tokens`` (the generation cap).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class BucketSchemeError(ValueError):
    """A bucket scheme that cannot classify anything (too few buckets, unsorted edges)."""


@dataclass(frozen=True)
class BucketScheme:
    """Bucket boundaries plus per-bucket representative lengths.

    ``edges`` are the lower bounds of each bucket (first is 0); ``max_tokens`` closes the last bucket.
    ``centers`` is the length that stands for a bucket when a point estimate is needed; training
    replaces the midpoint default by the mean training length inside each bucket, which makes the
    expected length unbiased on the training distribution.
    """

    edges: tuple[int, ...]
    max_tokens: int
    centers: tuple[float, ...] = field(default=())

    def __post_init__(self) -> None:
        edges = tuple(int(e) for e in self.edges)
        if len(edges) < 2:
            raise BucketSchemeError(
                f"a bucket scheme needs at least 2 buckets, got {len(edges)}: give more edges or a smaller --bucket-width"
            )
        if edges[0] != 0:
            raise BucketSchemeError(f"the first bucket edge must be 0, got {edges[0]}")
        if any(b <= a for a, b in itertools.pairwise(edges)):
            raise BucketSchemeError(f"bucket edges must be strictly increasing, got {list(edges)}")
        if self.max_tokens <= edges[-1]:
            raise BucketSchemeError(
                f"max_tokens ({self.max_tokens}) must exceed the last edge ({edges[-1]})"
            )
        object.__setattr__(self, "edges", edges)
        if not self.centers:
            object.__setattr__(self, "centers", tuple(float(c) for c in self.midpoints()))
        elif len(self.centers) != len(edges):
            raise BucketSchemeError("centers must have one value per bucket")

    # --- construction -------------------------------------------------------------------------
    @classmethod
    def equal_width(cls, width: int, max_tokens: int = 2048) -> BucketScheme:
        """Buckets ``[0,w), [w,2w), ...`` up to ``max_tokens`` (TetriInfer's granularity)."""
        if width <= 0:
            raise BucketSchemeError(f"bucket width must be positive, got {width}")
        if max_tokens <= width:
            raise BucketSchemeError(
                f"--max-tokens ({max_tokens}) must exceed --bucket-width ({width}) to give at least 2 buckets"
            )
        return cls(edges=tuple(range(0, max_tokens, width)), max_tokens=max_tokens)

    @classmethod
    def from_edges(cls, inner_edges: Sequence[int], max_tokens: int = 2048) -> BucketScheme:
        """Explicit boundaries, e.g. ``--edges 64,128,256,512`` gives 5 buckets starting at 0."""
        edges = [0] + [int(e) for e in inner_edges if int(e) != 0]
        return cls(edges=tuple(edges), max_tokens=max(max_tokens, edges[-1] + 1))

    @classmethod
    def parse(cls, spec: str, max_tokens: int = 2048) -> BucketScheme:
        """Parse ``"a,b,c"``; raises :class:`BucketSchemeError` with a readable message."""
        try:
            values = [int(x) for x in spec.split(",") if x.strip()]
        except ValueError as exc:
            raise BucketSchemeError(f"--edges must be comma-separated integers, got {spec!r}") from exc
        return cls.from_edges(values, max_tokens)

    def with_centers(self, lengths: np.ndarray) -> BucketScheme:
        """Return a copy whose centers are the mean observed length per bucket (midpoint if empty)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        idx = self.assign(lengths)
        mids = self.midpoints()
        centers = [float(lengths[idx == i].mean()) if np.any(idx == i) else float(mids[i]) for i in range(self.n)]
        return BucketScheme(self.edges, self.max_tokens, tuple(centers))

    # --- queries ------------------------------------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.edges)

    def upper(self) -> np.ndarray:
        """Upper bound of each bucket (exclusive; the last is ``max_tokens``)."""
        return np.array(list(self.edges[1:]) + [self.max_tokens], dtype=np.float64)

    def midpoints(self) -> np.ndarray:
        return (np.array(self.edges, dtype=np.float64) + self.upper()) / 2.0

    def assign(self, lengths: np.ndarray | Sequence[int] | int) -> np.ndarray:
        """Bucket index of each length (lengths beyond the last edge go to the last bucket)."""
        arr = np.atleast_1d(np.asarray(lengths, dtype=np.float64))
        return np.searchsorted(np.array(self.edges, dtype=np.float64), arr, side="right") - 1

    def decided(self, lengths: np.ndarray | Sequence[int], censored: np.ndarray | Sequence[bool]) -> np.ndarray:
        """Whether each label's bucket is known. A censored label (the answer was cut at ``lengths``: its true length
        is at least that) is decided only when it already lies in the last, open bucket, where every longer answer
        lands too; an answer that stopped by itself always is."""
        cut = np.asarray(censored, dtype=bool)
        return ~cut | (self.assign(lengths) == self.n - 1)

    def range_of(self, bucket: int) -> tuple[int, int]:
        return int(self.edges[bucket]), int(self.upper()[bucket])

    def expected(self, probs: np.ndarray) -> np.ndarray:
        """Expected length under the bucket distribution, using the bucket centers."""
        return np.asarray(probs, dtype=np.float64) @ np.array(self.centers)

    def quantile(self, probs: np.ndarray, q: float = 0.9) -> np.ndarray:
        """Length at CDF level ``q``, interpolating linearly inside the bucket where the CDF crosses ``q``.

        This is the padded length a scheduler can reserve KV for: with a calibrated model, a request
        overruns it with probability about ``1 - q``.
        """
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        p = np.atleast_2d(np.asarray(probs, dtype=np.float64))
        cdf = np.cumsum(p, axis=1)
        cdf[:, -1] = np.maximum(cdf[:, -1], 1.0)
        idx = np.minimum((cdf < q).sum(axis=1), self.n - 1)
        rows = np.arange(p.shape[0])
        below = np.where(idx > 0, cdf[rows, np.maximum(idx - 1, 0)], 0.0)
        mass = np.maximum(p[rows, idx], 1e-12)
        frac = np.clip((q - below) / mass, 0.0, 1.0)
        lo = np.array(self.edges, dtype=np.float64)[idx]
        hi = self.upper()[idx]
        return lo + frac * (hi - lo)

    # --- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"edges": list(self.edges), "max_tokens": self.max_tokens, "centers": list(self.centers)}

    @classmethod
    def from_dict(cls, d: dict) -> BucketScheme:
        return cls(tuple(d["edges"]), int(d["max_tokens"]), tuple(d.get("centers") or ()))
