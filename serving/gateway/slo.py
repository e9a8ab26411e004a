"""Each request's deadline (absolute Unix seconds), the ``deadline`` the scheduler plug-in orders by.

Default: EcoServe's JCT SLO (§4), the same :class:`serving.perf.slo.SLO` the simulator uses:
``slo_scale x (t_p + t_g x predicted length)`` after arrival. A client may state its own per-token SLO
instead with headers ``x-slo-ttft-ms`` (time to first token) and ``x-slo-tpot-ms`` (time per output
token): the deadline is then ``arrival + ttft + tpot x predicted length``; a header left out keeps its
term of the default (``slo_scale x t_p`` for TTFT, ``slo_scale x t_g`` for TPOT), so both forms are one
formula.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from serving.gateway.errors import ApiError
from serving.gateway.settings import GatewaySettings
from serving.perf.slo import SLO

TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


def default_slo(settings: GatewaySettings) -> SLO:
    s = settings
    return SLO(s.slo_scale, s.t_p_s, s.t_g_s, ttft_s=s.slo_scale * s.t_p_s, tpot_s=s.slo_scale * s.t_g_s)


def _ms(headers: Mapping[str, str], name: str, bounds: tuple[float, float] | None,
        on_clamp: Callable[[str, str], None] | None) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise ApiError(400, f"header {name} must be a positive number of milliseconds, got {raw[:40]!r}", param=name,
                       code="invalid_header")
    if bounds is not None:
        lo, hi = bounds
        if v < lo or v > hi:
            if on_clamp is not None:
                on_clamp(name, "min" if v < lo else "max")
            v = min(max(v, lo), hi)
    return v / 1000.0


def client_slo(headers: Mapping[str, str], bounds: tuple[float, float] | None = None,
               on_clamp: Callable[[str, str], None] | None = None) -> tuple[float | None, float | None]:
    """The client's (TTFT, TPOT) in seconds from the ``x-slo-*`` headers; a malformed header is a 400.

    ``bounds`` (milliseconds): a value outside is moved to the nearer bound and ``on_clamp(header, "min" | "max")`` is
    called. Why clamp rather than refuse: 1e-6 ms is a client asking for "first, always", 1e308 ms one asking for
    "whenever"; both are meaningful wishes with absurd numbers, and clamped they keep the deadline (and the
    ``x-lengthwise-deadline`` header, the plug-in's ``deadline`` hint) a number of a sane size: never infinite, never
    three hundred digits, never so early that it outranks every honest request by orders of magnitude.
    """
    return _ms(headers, TTFT_HEADER, bounds, on_clamp), _ms(headers, TPOT_HEADER, bounds, on_clamp)


def deadline(arrival: float, predicted_tokens: float, client: tuple[float | None, float | None], slo: SLO) -> float:
    """Absolute deadline of a request that arrived at ``arrival`` (Unix seconds)."""
    ttft, tpot = client
    if ttft is None and tpot is None:
        return arrival + slo.jct_limit(predicted_tokens)
    return arrival + (slo.ttft_s if ttft is None else ttft) + (slo.tpot_s if tpot is None else tpot) * predicted_tokens
