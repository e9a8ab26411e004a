"""What each service's finished requests teach: its length prior, its predictor's calibration and its predictor's skill.

SeaLLM profiles a service by the mean and spread of its requests; here the profile is the whole histogram (as
quantile points of a recent window), so a heavy tail stays a heavy tail. Two more things come from the same window:
how far the per-request predictor's point predictions have been off (the actual/predicted ratios a point prediction
is widened by), and how well it has ranked this service's requests lately (Kendall's tau), which decides how much
the per-request prediction counts against the service prior.

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
DEFAULT_SKILL = 0.5  # the weight of a per-request prediction before its skill is judged
REFRESH_EVERY = 128  # after the first doublings (8, 16, ..., 256 samples), refresh every this many


def _quantile_points(values: list[float], n: int) -> list[float]:
    s = sorted(values)
    m = len(s)
    return [s[min(m - 1, int((i + 0.5) * m / n))] for i in range(n)]


@dataclass(frozen=True)
class Profile:
    """A service's prior, ratios and skill as of its last refresh (immutable: beliefs built from it stay valid)."""

    prior: LengthBelief | None
    ratios: tuple[float, ...]
    skill: float
    samples: int


class ServicePriors:
    """Every service's window, and the profile each refresh derives from it (plus one pooled over all services)."""

    POOLED = "\0pooled"

    def __init__(self, window: int, client_share: float) -> None:
        self.window, self.client_share = window, client_share
        self.windows: dict[str, ClientWindow] = {}
        self.profiles: dict[str, Profile] = {}
        self.refused = 0
        self.refreshes = 0

    def learn(self, req: Request) -> set[str]:
        """Take a finished request's length if it is the model's own; the services whose profile it changed (the
        pooled one as :data:`POOLED`)."""
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
            w.add(req.generated, req.client or None, predicted)
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
        pairs = [(p, float(n)) for _, n, p in w.samples if p is not None and p > 0]
        ratios: tuple[float, ...] = ()
        skill = DEFAULT_SKILL
        if len(pairs) >= MIN_SAMPLES:
            ratios = tuple(_quantile_points([n / p for p, n in pairs], RATIO_POINTS))
        if len(pairs) >= MIN_PAIRS:
            skill = min(1.0, max(0.0, kendall_tau_b([p for p, _ in pairs], [n for _, n in pairs])))
        return Profile(prior, ratios, skill, len(lengths))


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
