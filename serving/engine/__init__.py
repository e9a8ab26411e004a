"""Engine plug-ins: the vLLM scheduler adapter (scheduler.py imports vLLM; inputs and settings do not)."""
