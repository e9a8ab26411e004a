"""The Ray Serve application the live Ray tests share: a local Ray cluster, two CPU vLLM engine replicas (dummy weights),
the real sidecar deployment with a small ONNX package, and the ingress.

Why a module of its own: starting the application takes about a minute on a small machine, so tests/test_ray_serve.py
starts it once (a module-scoped fixture over :func:`start_app`) for its end-to-end tests and, last, its faults.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.launch.process import free_port
from tests.datafiles import need_data

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ARGS = ["--load-format dummy", "--enforce-eager", "--max-model-len 2048", "--max-num-seqs 8", "--seed 0"]


@dataclass
class RayApp:
    """A running application: its URL, the settings it was deployed with, and the sidecar's (to deploy it again)."""

    url: str
    settings: Any
    sidecar: dict[str, Any] = field(default_factory=dict)


@contextmanager
def start_app(model_dir: Path, data: Path, work: Path, **overrides: Any) -> Iterator[RayApp]:
    """Start Ray, Serve and the application; take all of it down again, also when starting fails."""
    from ray import serve

    from serving.gateway.settings import GatewaySettings
    from serving.ray.app import run
    from serving.ray.local import local_ray
    from tests.tiny_package import tiny_packages

    pkg = tiny_packages(work / "pkg", need_data("tokenizers/gpt2/tokenizer.json"), {"pkg": None})["pkg"]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "LENGTHWISE_HOME": str(work / "home"), "LENGTHWISE_DATA": str(data)}
    with local_ray(4, env):
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = GatewaySettings(**{"model": str(model_dir), "engines": 2, "placement": "lengthwise",
                                      "predictor_timeout_ms": 2000, "engine_args": ENGINE_ARGS, **overrides})
        sidecar = {"model": str(pkg), "reload_interval": 0, "feedback_store": False}
        t0 = time.time()
        run(settings, sidecar=sidecar)
        print(f"application up in {time.time() - t0:.0f} s")
        yield RayApp(f"http://127.0.0.1:{port}", settings, sidecar)
