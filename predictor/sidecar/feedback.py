"""What one ``POST /v1/feedback`` may change, and why the rest changes nothing.

Feedback becomes online error windows, a drift alarm, MLflow monitoring runs, Prometheus series and training rows,
so a feedback that did not come from a real answer to a real prediction must not reach any of them. It is taken
when it names a prediction this sidecar served and still remembers (``--lru-size``), or, on a sidecar with a token
(its callers proved they are the gateway), carries the served prediction inline for a version this sidecar serves
or has served: the gateway does so, so that a replica that did not serve the prediction, or one restarted since,
still counts it. Everything else is refused and counted by reason (``REJECT_REASONS``): an id never served here
(``unknown_id``), a version it never loaded (``unknown_version``: no request can add a label series or a monitoring
run), an ``actual_tokens`` past ``--max-actual-tokens`` or an inline prediction no model of this scheme could make
(``out_of_range``). The same id fed back again changes nothing and is answered ``duplicate``. No FastAPI here: the
HTTP layer (predictor/sidecar/app.py) turns a :class:`Refused` into its status and ``{"detail": ...}``.
"""

from __future__ import annotations

from monitoring.online import Feedback
from predictor.buckets import BucketScheme
from predictor.sidecar.schemas import FeedbackRequest, InlinePrediction
from predictor.sidecar.state import SidecarState


class Refused(Exception):
    """A feedback that changes nothing: its HTTP status, the counted reason (None: not the caller's doing) and why."""

    def __init__(self, status: int, reason: str | None, detail: str):
        super().__init__(detail)
        self.status, self.reason, self.detail = status, reason, detail


def take(state: SidecarState, req: FeedbackRequest) -> dict:
    """Score the feedback, fold it into the online windows and queue its training row; the reply's body. A repeat of
    an id already counted is answered with ``accepted: false, duplicate: true`` and counted; :class:`Refused` when the
    feedback may not change anything."""
    limit = state.settings.max_actual_tokens
    if req.actual_tokens > limit:
        raise Refused(422, "out_of_range", f"actual_tokens: {req.actual_tokens} exceeds {limit}, the longest answer this "
                                           "sidecar takes (--max-actual-tokens, the served model's context)")
    entry = state.served.get(req.request_id)
    if entry is not None:
        if (entry.name, entry.version) not in state.schemes:
            raise Refused(422, "unknown_version", f"request_id {req.request_id!r} was predicted by version "
                                                  f"{entry.version!r}, which this sidecar no longer tracks")
        source, name, version, scheme = "served", entry.name, entry.version, entry.scheme
        bucket, expected, qtok = entry.bucket, entry.expected, entry.quantile_tokens
    else:
        source = "inline"
        name, version, scheme, bucket, expected, qtok = _inline(state, req)
    actual_bucket = int(scheme.assign(req.actual_tokens)[0])
    fb = Feedback(name, version, bucket, actual_bucket, expected, qtok, req.actual_tokens, req.finish_reason, scheme.n,
                  first_turn=None if entry is None else entry.first_turn, client=req.client,
                  served_model=None if entry is None else entry.served_model)
    duplicate = state.fed_back_before(req.request_id, entry)
    stored = False
    if duplicate:
        state.metrics.feedback.labels("duplicate").inc()
        state.metrics.feedback_rejected.labels("duplicate").inc()
    else:
        state.mark_fed_back(req.request_id, entry)
        state.record(fb)
        stored = state.store(req.request_id, entry, fb)
        state.metrics.feedback.labels(source).inc()
    return {"accepted": not duplicate, "duplicate": duplicate, "request_id": req.request_id, "source": source,
            "model_name": name, "model_version": version, "predicted_bucket": bucket, "actual_bucket": actual_bucket,
            "error_tokens": float(expected - req.actual_tokens), "censored": fb.censored, "stored": stored}


def _inline(state: SidecarState, req: FeedbackRequest) -> tuple[str, str, BucketScheme, int, float, float | None]:
    """Name, version, scheme, bucket, expected and quantile length of a prediction sent inline, if it may be taken."""
    p: InlinePrediction | None = req.prediction
    if p is None:
        raise Refused(404, "unknown_id", f"unknown request_id {req.request_id!r}: never served here, or forgotten "
                                         "(--lru-size)")
    if not state.trusted:
        raise Refused(404, "unknown_id", f"unknown request_id {req.request_id!r}: never served here, or forgotten "
                                         "(--lru-size); a prediction sent inline is taken only by a sidecar with a "
                                         "token (--token), whose callers are known")
    m = state.model
    if m is None:
        raise Refused(503, None, "no model loaded yet")
    name, version = p.model_name or m.name, p.model_version or m.version
    scheme = state.schemes.get((name, version))
    if scheme is None:
        known = ", ".join(f"{n} {v}" for n, v in state.schemes)
        raise Refused(422, "unknown_version", f"prediction: {name!r} version {version!r} is not a model version this "
                                              f"sidecar serves or has served ({known})")
    bucket = int(scheme.assign(p.expected_tokens)[0]) if p.bucket is None else p.bucket
    if bucket >= scheme.n:
        raise Refused(422, "out_of_range", f"prediction.bucket: {bucket} is out of range for {scheme.n} buckets")
    for field, v in (("expected_tokens", p.expected_tokens), ("quantile_tokens", p.quantile_tokens)):
        if v is not None and v > scheme.max_tokens:  # no prediction of this model can say that
            raise Refused(422, "out_of_range", f"prediction.{field}: {v:g} exceeds the model's largest length "
                                               f"{scheme.max_tokens}")
    return name, version, scheme, bucket, p.expected_tokens, p.quantile_tokens
