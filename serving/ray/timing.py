"""How long the engine routers spend in ``choose_replicas``: per router, and for every router of this process.

Why a module of its own: Ray Serve ships a deployment's request router class to the processes holding its handles by
pickling the router's module *by value* (``cloudpickle.register_pickle_by_value``), so a registry defined in
:mod:`serving.ray.router` would be a copy in the ingress, one the ingress's ``/health`` never sees. This module is
pickled by reference: the routers and the ingress share its :data:`ROUTERS`.
"""

from __future__ import annotations

import weakref
from typing import Any

ROUTERS: weakref.WeakSet[RouterTiming] = weakref.WeakSet()  # the timed routers of this process (one per handle)


class RouterTiming:
    """Decisions made and seconds spent in ``choose_replicas`` by one router (Ray may call it again for a request whose
    chosen replicas were all full: each call counts)."""

    decisions: int = 0
    choose_s: float = 0.0
    _hist: Any = None

    def _timed(self, seconds: float) -> None:
        if not self.decisions:
            ROUTERS.add(self)
            try:
                from ray.util.metrics import Histogram

                self._hist = Histogram("lengthwise_ray_router_choose_seconds", "time in the engine router's choose_replicas",
                                       boundaries=[1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1],
                                       tag_keys=("router",))
            except Exception:  # noqa: BLE001 - metrics are optional (no Ray metrics agent in this process)
                self._hist = None
        self.decisions += 1
        self.choose_s += seconds
        if self._hist is not None:
            self._hist.observe(seconds, tags={"router": type(self).__name__})

    def timing(self) -> dict[str, Any]:
        return {"decisions": self.decisions, "choose_s": self.choose_s,
                "fallbacks": dict(getattr(self, "fallbacks", {}) or {})}


def router_timings() -> dict[str, dict[str, Any]]:
    """The timed routers of this process by class name (several of one class summed)."""
    out: dict[str, dict[str, Any]] = {}
    for r in list(ROUTERS):
        t, o = r.timing(), out.setdefault(type(r).__name__, {"decisions": 0, "choose_s": 0.0, "fallbacks": {}})
        o["decisions"] += t["decisions"]
        o["choose_s"] += t["choose_s"]
        for k, v in t["fallbacks"].items():
            o["fallbacks"][k] = o["fallbacks"].get(k, 0) + v
    return out
