"""Training progress that reaches a log file, not only a terminal.

Lightning's progress bar redraws one line in place; written to a file (``nohup``, CI, a notebook's captured output)
it shows nothing for as long as an epoch takes, and a 20-minute epoch looks like a hung process. When stderr is not
a terminal, :class:`PlainProgress` takes the bar's place and prints one plain line at least every ``interval_s``
seconds and at the end of every epoch: the epoch, the step, the rate and the time the epoch has left.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as L

LOG_INTERVAL_S = 60.0


def on_a_terminal() -> bool:
    """Whether stderr is a terminal (where Lightning's own bar draws)."""
    return sys.stderr.isatty()


class PlainProgress(L.Callback):
    """One line on stderr every ``interval_s`` seconds of training and at each epoch's end."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._epoch_start = 0.0
        self._last = 0.0

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._epoch_start = self._last = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        self._last = now
        done = batch_idx + 1
        total = trainer.num_training_batches
        rate = done / max(now - self._epoch_start, 1e-9)
        left = (total - done) / rate if isinstance(total, int) and rate > 0 else float("nan")
        print(f"train: epoch {trainer.current_epoch + 1}/{trainer.max_epochs}, step {done}/{total}, "
              f"{rate:.2f} steps/s, about {left / 60:.1f} min left in the epoch", file=sys.stderr, flush=True)

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(("val_", "train_loss"))}
        shown = ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items()))
        print(f"train: epoch {trainer.current_epoch + 1}/{trainer.max_epochs} done in "
              f"{time.monotonic() - self._epoch_start:.0f} s{', ' + shown if shown else ''}", file=sys.stderr, flush=True)
