"""Lightning training of the length classifier: data batching by length, loss, metrics per epoch.

The loss is cross-entropy over the buckets, against a hard bucket (one example per answer) or a soft target (a
prompt's bucket histogram over the served model's K samples, ``--label soft``). An answer that was cut (it ran to its
``max_tokens`` cap) is a *censored* label: its true length is at least what was counted, so its term is the likelihood
of that bound, ``-log P(bucket >= b)`` (:func:`censored_cross_entropy`), not the cross-entropy of a short answer. This
is the standard right-censored likelihood of survival analysis; it lets capped feedback train the predictor rather
than be thrown away or taught as the truth. An optional ranking term
(``rank_loss_weight``) adds a pairwise logistic (RankNet) loss on the expected length over the pairs of each batch:
a scheduler orders requests by that expected length, so the term trains the order directly. vllm-ltr trains its
predictor to rank within each batch too (with a listwise loss, ListMLE).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from predictor.model import LengthClassifier
from predictor.runtime import pad_ids
from training.evaluate import pairwise_accuracy

Label = int | Sequence[float]  # a bucket index, or a distribution over the buckets (soft label)


class EncodedDataset(Dataset):
    def __init__(self, ids: Sequence[list[int]], labels: Sequence[Label], lengths: Sequence[float] | None = None):
        self.ids = list(ids)
        self.labels = list(labels)
        self.lengths = [0.0] * len(self.ids) if lengths is None else [float(x) for x in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[list[int], Label, float]:
        return self.ids[i], self.labels[i], self.lengths[i]


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


class CycledBatches(Sampler[list[int]]):
    """``n`` batches of ``batches`` per epoch, continuing where the last epoch stopped (a new shuffled pass when one
    runs out): a second head's labels keep pace with the served epoch, one batch a step, and every example is seen
    over the epochs whether that set is smaller or larger than the served one."""

    def __init__(self, batches: LengthGroupedBatches, n: int):
        self.batches = batches
        self.n = max(1, n)
        self._it: Iterator[list[int]] = iter(())

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.n):
            batch = next(self._it, None)
            if batch is None:
                self._it = iter(self.batches)
                batch = next(self._it)
            yield batch

    def __len__(self) -> int:
        return self.n


def make_loader(ids: Sequence[list[int]], labels: Sequence[Label], pad_id: int, batch_size: int, shuffle: bool,
                seed: int, lengths: Sequence[float] | None = None, batches_per_epoch: int | None = None) -> DataLoader:
    """Batches ``(input_ids, attention_mask, label, true length)``: the label a long bucket index, or for soft labels
    a float row per example; the true length (response tokens; a prompt's mean over its samples with soft labels) is
    what the ranking term orders by. ``batches_per_epoch`` cycles through the examples that many batches an epoch
    (:class:`CycledBatches`) instead of one pass."""
    soft = bool(labels) and not isinstance(labels[0], (int, np.integer))

    def collate(items):
        x, m = pad_ids([i for i, _, _ in items], pad_id)
        y = torch.tensor([y for _, y, _ in items], dtype=torch.float32 if soft else torch.long)
        return torch.from_numpy(x), torch.from_numpy(m), y, torch.tensor([n for _, _, n in items], dtype=torch.float32)

    sampler: Sampler[list[int]] = LengthGroupedBatches([len(x) for x in ids], batch_size, shuffle, seed)
    if batches_per_epoch is not None:
        sampler = CycledBatches(sampler, batches_per_epoch)
    return DataLoader(EncodedDataset(ids, labels, lengths), batch_sampler=sampler, collate_fn=collate, num_workers=0)


def censored_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``target`` (``[N, 2B]``): its first B columns weigh buckets observed exactly
    (one-hot for a hard label, a histogram for a soft one), its last B columns weigh lower bounds, where column ``b``
    is the share of the prompt's samples cut inside bucket ``b`` (their likelihood is ``P(bucket >= b)``). With no
    censored weight this is the ordinary (soft) cross-entropy; a bound in the last bucket equals an exact label there."""
    n = logits.shape[1]
    logp = torch.log_softmax(logits, 1)
    tail = torch.logcumsumexp(logp.flip(1), 1).flip(1)  # log P(bucket >= b)
    return -((target[:, :n] * logp).sum(1) + (target[:, n:] * tail).sum(1)).mean()


def pairwise_rank_loss(score: torch.Tensor, length: torch.Tensor, censored: torch.Tensor | None = None) -> torch.Tensor:
    """RankNet's pairwise logistic loss: mean of ``log(1 + exp(-(s_i - s_j)))`` over the pairs with ``length_i >
    length_j``; zero when no pair differs (a batch of one prompt's samples, or of equal lengths). A pair whose shorter
    member is ``censored`` (a lower bound) has no known order and is left out."""
    longer = length.unsqueeze(1) > length.unsqueeze(0)
    if censored is not None:
        longer = longer & ~censored.bool().unsqueeze(0)
    if not bool(longer.any()):
        return score.sum() * 0.0
    diff = score.unsqueeze(1) - score.unsqueeze(0)
    return torch.nn.functional.softplus(-diff[longer]).mean()


class LengthModule(L.LightningModule):
    """Cross-entropy over buckets (hard or soft targets), plus ``rank_loss_weight`` times the pairwise ranking loss on
    the expected length; validation logs loss, top-1, within-one and MAE of the expected length.

    The ranking score is the expected length in units of the mean gap between bucket centers, so a one-bucket
    difference is about one logit of the pairwise loss whatever the bucket width.
    """

    def __init__(self, model: LengthClassifier, centers: Sequence[float], lr: float = 1e-3, weight_decay: float = 0.01,
                 rank_loss_weight: float = 0.0, aux_weight: float = 0.0):
        super().__init__()
        self.model = model
        self.lr = lr
        self.weight_decay = weight_decay
        self.rank_loss_weight = float(rank_loss_weight)
        self.aux_weight = float(aux_weight)
        self.register_buffer("centers", torch.tensor(list(centers), dtype=torch.float32))
        c = list(centers)
        self.rank_scale = max((c[-1] - c[0]) / max(len(c) - 1, 1), 1e-6)
        self._val: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._epoch_start = 0.0
        self._seen = 0

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids, attention_mask)

    def training_step(self, batch, _):
        """One batch of served labels; or, for a two-headed model, a dict of one served batch (``served``) and one batch
        of the auxiliary labels (``answers``, for the second head) per step, the latter's loss weighed by
        ``aux_weight``."""
        served = batch["served"] if isinstance(batch, dict) else batch
        loss = self._served_loss(served)
        n = int(served[2].shape[0])
        if isinstance(batch, dict):
            x, m, y, _ = batch["answers"]
            aux = torch.nn.functional.cross_entropy(self.model.aux_logits(x, m), y)
            self.log("train_aux_loss", aux, batch_size=int(y.shape[0]), on_step=False, on_epoch=True)
            self._seen += int(y.shape[0])
            loss = loss + self.aux_weight * aux
        self.log("train_loss", loss, prog_bar=True, batch_size=n)
        return loss

    def _served_loss(self, batch) -> torch.Tensor:
        x, m, y, length = batch
        logits = self(x, m)
        n = int(y.shape[0])
        censored = None
        if y.dim() == 2 and y.shape[1] == 2 * logits.shape[1]:  # exact and censored weights (see censored_cross_entropy)
            loss = censored_cross_entropy(logits, y)
            censored = y[:, logits.shape[1]:].sum(1) > 0
        else:  # y: bucket indices, or soft targets (rows summing to 1)
            loss = torch.nn.functional.cross_entropy(logits, y)
        if self.rank_loss_weight > 0:
            rank = pairwise_rank_loss(logits.softmax(1) @ self.centers / self.rank_scale, length, censored)
            self.log("train_ce_loss", loss, batch_size=n, on_step=False, on_epoch=True)  # epoch means: the ablation's
            self.log("train_rank_loss", rank, batch_size=n, on_step=False, on_epoch=True)  # numbers, however short
            loss = loss + self.rank_loss_weight * rank
        self._seen += n
        return loss

    def on_train_epoch_start(self) -> None:
        self._epoch_start = time.perf_counter()
        self._seen = 0

    def on_train_epoch_end(self) -> None:
        dt = time.perf_counter() - self._epoch_start
        self.log("epoch_time_s", dt)
        self.log("train_samples_per_s", self._seen / max(dt, 1e-9))

    def validation_step(self, batch, _):
        x, m, y, length = batch
        logits = self(x, m)
        self._val.append((logits.detach(), y, length))

    def on_validation_epoch_end(self) -> None:
        if not self._val:
            return
        logits = torch.cat([a for a, _, _ in self._val])
        y = torch.cat([b for _, b, _ in self._val])
        length = torch.cat([n for _, _, n in self._val])
        self._val.clear()
        pred = logits.argmax(1)
        probs = logits.softmax(1)
        expected = probs @ self.centers
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), prog_bar=True)
        self.log("val_acc", (pred == y).float().mean(), prog_bar=True)
        self.log("val_acc_within_1", ((pred - y).abs() <= 1).float().mean())
        self.log("val_mae_buckets_center", (expected - self.centers[y]).abs().mean())
        self.log("val_pairwise_accuracy", pairwise_accuracy(expected.numpy(), length.numpy()))

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr, weight_decay=self.weight_decay)
        total = max(1, self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=total, pct_start=0.06)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
