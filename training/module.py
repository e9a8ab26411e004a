"""Lightning training of the length classifier: data batching by length, loss, metrics per epoch."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from predictor.model import LengthClassifier
from predictor.runtime import pad_ids


class EncodedDataset(Dataset):
    def __init__(self, ids: Sequence[list[int]], labels: Sequence[int]):
        self.ids = list(ids)
        self.labels = list(labels)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[list[int], int]:
        return self.ids[i], self.labels[i]


class LengthGroupedBatches(Sampler[list[int]]):
    """Batches of similar prompt length, in a seeded random order that changes each epoch.

    Most prompts are short (ShareGPT first-turn median: 33 tokens), so padding to the longest prompt
    in a random batch wastes most of the compute; sorting inside shuffled windows keeps both
    randomness and tight padding.
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, shuffle: bool, seed: int = 0, window: int = 50):
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.window = window
        self.epoch = 0

    def __iter__(self) -> Iterator[list[int]]:
        rng = random.Random(self.seed + self.epoch)
        self.epoch += 1
        idx = list(range(len(self.lengths)))
        if self.shuffle:
            rng.shuffle(idx)
        span = self.batch_size * self.window
        batches = []
        for s in range(0, len(idx), span):
            chunk = sorted(idx[s : s + span], key=lambda i: self.lengths[i])
            batches.extend(chunk[b : b + self.batch_size] for b in range(0, len(chunk), self.batch_size))
        if self.shuffle:
            rng.shuffle(batches)
        return iter(batches)

    def __len__(self) -> int:
        return math.ceil(len(self.lengths) / self.batch_size)




def make_loader(ids: Sequence[list[int]], labels: Sequence[int], pad_id: int, batch_size: int, shuffle: bool,
                seed: int) -> DataLoader:
    def collate(items):
        x, m = pad_ids([i for i, _ in items], pad_id)
        return torch.from_numpy(x), torch.from_numpy(m), torch.tensor([y for _, y in items], dtype=torch.long)

    sampler = LengthGroupedBatches([len(x) for x in ids], batch_size, shuffle, seed)
    return DataLoader(EncodedDataset(ids, labels), batch_sampler=sampler, collate_fn=collate, num_workers=0)


class LengthModule(L.LightningModule):
    """Cross-entropy over buckets; validation logs loss, top-1, within-one and MAE of the expected length."""

    def __init__(self, model: LengthClassifier, centers: Sequence[float], lr: float = 1e-3, weight_decay: float = 0.01):
        super().__init__()
        self.model = model
        self.lr = lr
        self.weight_decay = weight_decay
        self.register_buffer("centers", torch.tensor(list(centers), dtype=torch.float32))
        self._val: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._epoch_start = 0.0
        self._seen = 0

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids, attention_mask)

    def training_step(self, batch, _):
        x, m, y = batch
        loss = torch.nn.functional.cross_entropy(self(x, m), y)
        self._seen += int(y.shape[0])
        self.log("train_loss", loss, prog_bar=True, batch_size=int(y.shape[0]))
        return loss

    def on_train_epoch_start(self) -> None:
        self._epoch_start = time.perf_counter()
        self._seen = 0

    def on_train_epoch_end(self) -> None:
        dt = time.perf_counter() - self._epoch_start
        self.log("epoch_time_s", dt)
        self.log("train_samples_per_s", self._seen / max(dt, 1e-9))

    def validation_step(self, batch, _):
        x, m, y = batch
        logits = self(x, m)
        self._val.append((logits.detach(), y))

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        logits = torch.cat([a for a, _ in self._val])
        y = torch.cat([b for _, b in self._val])
        self._val.clear()
        pred = logits.argmax(1)
        probs = logits.softmax(1)
        expected = probs @ self.centers
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (pred == y).float().mean(), prog_bar=True)
        self.log("val_acc_within_1", ((pred - y).abs() <= 1).float().mean())
        self.log("val_mae_buckets_center", (expected - self.centers[y]).abs().mean())

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        total = max(1, self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=total, pct_start=0.06)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
