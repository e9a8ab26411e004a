"""``predictor-sidecar``: the length predictor as an HTTP service beside the engines.

Sits above the registry (it resolves ``models:/`` URIs and reports online error windows to MLflow) and the
predictor core (the ONNX runtime). One module per job: ``schemas`` (the HTTP contract), ``cache`` (resolving and
caching a model reference), ``batcher`` (micro-batching), ``metrics`` (Prometheus), ``app`` (the FastAPI app and
its state; ``python -m predictor.sidecar`` runs it). Its benchmark is ``training/bench_sidecar.py``.
"""
