"""Training progress reaches a log: with stderr not a terminal, a real Lightning run prints plain lines (step, rate,
time left) instead of a bar that a file never shows."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from training.progress import PlainProgress, on_a_terminal

pytestmark = pytest.mark.unit


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_run_whose_output_is_a_file_prints_plain_progress_lines(capsys):
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[PlainProgress(interval_s=0)])
    trainer.fit(_Tiny(), DataLoader(data, batch_size=8))
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("train: ")]
    steps = [ln for ln in lines if " step " in ln]
    assert len(steps) == 16  # every step of both epochs at interval 0
    assert "epoch 1/2, step 1/8" in steps[0] and "steps/s" in steps[0] and "min left" in steps[0]
    ends = [ln for ln in lines if " done in " in ln]
    assert len(ends) == 2 and "train_loss" in ends[-1]
    assert not on_a_terminal()  # under pytest stderr is captured: the training pipeline would choose these lines
