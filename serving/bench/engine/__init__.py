"""The real-engine benchmark: one trace through stock vLLM scheduling and through ours, on this machine."""
