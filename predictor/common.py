"""The floor every package may import: where the data files and lengthwise's own state live, and keeping libraries'
logs quiet.

Nothing here imports another module of the project (nor MLflow), so the simulator, the sidecar, the feedback store,
training and the command lines can all find the same directories and quiet the same loggers without importing each
other.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path


def data_dir() -> Path:
    """Where the data files of ``predictor/datafiles/manifest.toml`` are read from, and ``lengthwise data fetch`` writes.

    ``$LENGTHWISE_DATA`` when set; else ``../shared/data`` beside the checkout when that folder exists (the team's
    machines and CI have it, with every file); else the per-user cache, ``~/.cache/lengthwise/data``
    (``$XDG_CACHE_HOME`` honoured), which ``lengthwise data fetch`` fills on a fresh machine.
    """
    env = os.environ.get("LENGTHWISE_DATA")
    if env:
        return Path(env)
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "data"
    return shared if shared.is_dir() else user_cache_dir() / "data"


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/lengthwise``, else ``~/.cache/lengthwise``: what can be downloaded again (data, wheels)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lengthwise"


def lengthwise_home() -> Path:
    """``$LENGTHWISE_HOME`` (default ``~/.lengthwise``): the embedded MLflow store, the sidecar's model cache and the
    feedback store live under it. Here, not beside MLflow, because the sidecar and the feedback store need the place
    without the registry."""
    return Path(os.environ.get("LENGTHWISE_HOME", Path.home() / ".lengthwise")).expanduser()


def default_sharegpt() -> Path:
    return data_dir() / "prompts" / "sharegpt_v3_unfiltered_cleaned_split.first15000.json.xz"


def default_tokenizer() -> Path:
    return data_dir() / "tokenizers" / "gpt2" / "tokenizer.json"


NOISY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "mlflow", "transformers", "torch.onnx", "alembic")


def quiet_libraries(verbose: bool) -> None:
    """Keep the terminal to progress bars and results unless --verbose (libraries log a lot at INFO)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not verbose:
        os.environ["LENGTHWISE_QUIET"] = "1"
        warnings.filterwarnings("ignore")
        silence_loggers()


def silence_loggers() -> None:
    """Libraries reset their log levels on import, so this is called again once they are imported."""
    if os.environ.get("LENGTHWISE_QUIET"):
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)


def usable_cores() -> list[int]:
    """The cores this process may run on, in order: its affinity, not the machine's count (a process pinned to one core
    that starts two compute threads makes them take turns)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def available_cores() -> int:
    """How many cores this process may run on (:func:`usable_cores`)."""
    return len(usable_cores())


def compute_threads() -> int:
    """Threads for torch's in-process math: ``OMP_NUM_THREADS`` when set, else :func:`available_cores`."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", "0"))
    except ValueError:
        n = 0
    return n if n >= 1 else available_cores()
