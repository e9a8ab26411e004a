"""``predictor-sidecar``: the length predictor as an HTTP service beside the engines.

Sits above the predictor core (the ONNX runtime) and the monitoring package (online error windows, the feedback
store). It talks to MLflow itself, through the store of :mod:`predictor.tracking` (resolving ``models:/`` URIs) and
the monitoring runs of :mod:`predictor.monitoring_runs`, and never imports the registry: the registry stores
predictor packages, so the dependency runs from the registry to the predictor only.

One module per job: ``settings`` (every setting, validated), ``schemas`` (the HTTP contract), ``cache`` (resolving
and caching a model reference), ``loading`` (opening and running one model version), ``batcher`` (micro-batching),
``state`` (the serving version, hot reload, feedback windows), ``feedback`` (which feedback may change anything),
``auth`` (the bearer token), ``metrics`` (Prometheus), ``app`` (the FastAPI routes and middleware) and ``cli`` (the
flags, derived from the settings; ``python -m predictor.sidecar`` runs it). Its benchmark is
``serving/bench/predictor/sidecar.py``.
"""
