"""What each service's finished requests teach: its length prior, its predictor's calibration and how far to trust it.

SeaLLM profiles a service by the mean and spread of its requests; here the profile is the whole histogram (as
quantile points of a recent window), so a heavy tail stays a heavy tail. Two more things come from the same window:
how far the per-request predictor's point predictions have been off (the actual/predicted ratios a point prediction
is widened by), and the weight the per-request belief gets against the service prior: the mixture weight under which
the lengths that came were most likely (the maximum-likelihood weight of a two-component mixture, found by EM, each
length scored by the mass each component gave its half-octave). A predictor that knows nothing of this service's
lengths gets weight near 0 and the order is the service's; one whose beliefs were right gets near 1. Kendall's tau of
the point predictions is kept beside it for the operator; it is not the weight, because a ranking says nothing of
whether the predicted distribution was calibrated (with tau 0.39 as the weight, a good predictor's belief was 61%
washed out by the prior).

No client may shape a prior: only lengths that are the model's own are learnt (the host says so through
``Request.learnable``; a request that reached its ``max_tokens`` was cut, so it is skipped too), and one client key
holds at most ``client_share`` of a window: its oldest sample goes when it would hold more. A request whose key the
host does not know (``client == ""``, the simulator or a direct engine client) is not capped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from serving.policy.belief import LengthBelief
from serving.policy.learnable import ClientWindow
from serving.policy.request import Request

PRIOR_POINTS = 16   # quantile points a prior keeps of its window
RATIO_POINTS = 8    # quantile points of actual/predicted a point prediction is widened by
MIN_SAMPLES = 8     # a service with fewer learnt lengths borrows the pooled prior
MIN_PAIRS = 32      # fewer (prediction, length) pairs: the predictor's skill is not yet judged
DEFAULT_SKILL = 0.5  # the weight of a per-request belief before the lengths have judged it
MASS_FLOOR = 1e-3    # the least mass a component gives any length: one miss must not zero a component for good
REFRESH_EVERY = 128  # after the first doublings (8, 16, ..., 256 samples), refresh every this many


def _quantile_points(values: list[float], n: int) -> list[float]:
    s = sorted(values)
    m = len(s)
    return [s[min(m - 1, int((i + 0.5) * m / n))] for i in range(n)]


@dataclass(frozen=True)
class Profile:
    """A service's prior, ratios and the per-request belief's weight as of its last refresh (immutable: beliefs built
    from it stay valid); ``tau`` is the point predictions' Kendall tau, for the operator."""

    prior: LengthBelief | None
    ratios: tuple[float, ...]
    skill: float
    samples: int
    tau: float | None = None


class ServicePriors:
    """Every service's window, and the profile each refresh derives from it (plus one pooled over all services)."""

    POOLED = "\0pooled"

    def __init__(self, window: int, client_share: float) -> None:
        self.window, self.client_share = window, client_share
        self.windows: dict[str, ClientWindow] = {}
        self.profiles: dict[str, Profile] = {}
        self.refused = 0
        self.refreshes = 0

    def learn(self, req: Request, own_mass: float | None = None) -> set[str]:
        """Take a finished request's length if it is the model's own; ``own_mass``: what its per-request belief gave
        that length (:meth:`LengthBelief.mass_near`). Returns the services whose profile it changed (the pooled one as
        :data:`POOLED`)."""
        cut = req.max_tokens is not None and req.generated >= req.max_tokens
        if not req.learnable or cut or req.generated <= 0:
            self.refused += 1
            return set()
        predicted = req.pred.length if req.extra.get("predicted", True) else None
        changed: set[str] = set()
        for key in (req.service, self.POOLED):
            w = self.windows.get(key)
            if w is None:
                w = self.windows[key] = ClientWindow(self.window, self.client_share)
            w.add(req.generated, req.client or None, (predicted, own_mass))
            n = w.added
            if n >= MIN_SAMPLES and ((n & (n - 1)) == 0 and n <= 256 or n % REFRESH_EVERY == 0):
                self.profiles[key] = self._profile(w)
                self.refreshes += 1
                changed.add(key)
        return changed

    def profile(self, service: str) -> Profile | None:
        """The service's profile, else the pooled one, else None (nothing learnt yet)."""
        return self.profiles.get(service) or self.profiles.get(self.POOLED)

    @staticmethod
    def _profile(w: ClientWindow) -> Profile:
        lengths = [s[1] for s in w.samples]
        prior = LengthBelief(_quantile_points(lengths, PRIOR_POINTS), [1.0] * PRIOR_POINTS)
        pairs = [(s[2][0], s[1]) for s in w.samples if s[2] and s[2][0]]
        ratios: tuple[float, ...] = ()
        if len(pairs) >= MIN_SAMPLES:
            ratios = tuple(_quantile_points([n / p for p, n in pairs], RATIO_POINTS))
        tau = kendall_tau_b([p for p, _ in pairs], [n for _, n in pairs]) if len(pairs) >= MIN_PAIRS else None
        scored = [(s[2][1], prior.mass_near(s[1])) for s in w.samples if s[2] and s[2][1] is not None]
        skill = mixture_weight(scored) if len(scored) >= MIN_PAIRS else DEFAULT_SKILL
        return Profile(prior, ratios, skill, len(lengths), tau)


def mixture_weight(scored: list[tuple[float, float]], iterations: int = 50) -> float:
    """The weight ``w`` maximising ``sum log(w a + (1 - w) b)`` over ``(a, b)``, the masses the per-request belief and
    the prior gave each length that came (EM: the mean responsibility of the first component, repeated)."""
    pairs = [(max(a, MASS_FLOOR), max(b, MASS_FLOOR)) for a, b in scored]
    w = DEFAULT_SKILL
    for _ in range(iterations):
        w_next = math.fsum(w * a / (w * a + (1 - w) * b) for a, b in pairs) / len(pairs)
        if abs(w_next - w) < 1e-4:
            return w_next
        w = w_next
    return w


def kendall_tau_b(x: list[float], y: list[float]) -> float:
    """Kendall's tau-b (ties in either list discounted), in O(n^2) numpy over a window of at most a few hundred pairs;
    0 when either list is constant."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx = np.sign(a[:, None] - a[None, :])
    dy = np.sign(b[:, None] - b[None, :])
    nx, ny = float(np.abs(dx).sum()), float(np.abs(dy).sum())
    if nx == 0 or ny == 0:
        return 0.0
    return float((dx * dy).sum() / math.sqrt(nx * ny))
