"""MLflow model registry for length predictors (versions, aliases, guarded promotion) and online
prediction-error tracking."""
