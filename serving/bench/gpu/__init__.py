"""The GPU pack: vLLM's CUDA build, stripped to one architecture, and the wheels a registry-less GPU machine lacks."""
