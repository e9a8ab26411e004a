"""MLflow model registry for length predictors: versions, aliases, guarded promotion, and the online-error report."""
