"""Online error of served predictions: feedback folded into windows and the drift alarm (``online``), writing closed
windows without blocking (``window_log``), and the local store of served predictions and their actual lengths that
retraining reads (``feedback_store``).

No MLflow, no HTTP, no sidecar here: the sidecar, retraining and the benches all use it, and where windows are written
(MLflow) is the caller's choice (:mod:`predictor.monitoring_runs`).
"""
