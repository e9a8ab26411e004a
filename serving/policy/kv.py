"""The KV block ledger: how many blocks each request holds, never more than the pool."""

from __future__ import annotations


class KVOverflow(RuntimeError):
    """A policy tried to hold more KV blocks than exist: a bug, never a normal outcome."""


class BlockLedger:
    """Counts blocks per request id. Policies decide; the ledger refuses anything over capacity."""

    def __init__(self, total_blocks: int) -> None:
        if total_blocks <= 0:
            raise ValueError("the KV cache must have at least one block")
        self.total = total_blocks
        self.used = 0
        self.held: dict[int, int] = {}

    @property
    def free(self) -> int:
        return self.total - self.used

    def of(self, rid: int) -> int:
        return self.held.get(rid, 0)

    def grow_to(self, rid: int, blocks: int) -> bool:
        """Make ``rid`` hold at least ``blocks``; False (and no change) if the pool cannot."""
        extra = blocks - self.held.get(rid, 0)
        if extra <= 0:
            return True
        if extra > self.free:
            return False
        self.held[rid] = blocks
        self.used += extra
        return True

    def add(self, rid: int, blocks: int) -> None:
        """Hand ``rid`` blocks it is owed (e.g. a host's span passing to its hosted GT); must fit."""
        if blocks > self.free:
            raise KVOverflow(f"request {rid}: {blocks} blocks requested, {self.free} free")
        self.held[rid] = self.held.get(rid, 0) + blocks
        self.used += blocks

    def shrink(self, rid: int, blocks: int) -> None:
        """Return ``blocks`` of ``rid``'s blocks to the pool."""
        have = self.held.get(rid, 0)
        blocks = min(blocks, have)
        self.used -= blocks
        if have - blocks:
            self.held[rid] = have - blocks
        else:
            self.held.pop(rid, None)

    def release(self, rid: int) -> int:
        n = self.held.pop(rid, 0)
        self.used -= n
        return n

    def check(self) -> None:
        if self.used > self.total or self.used != sum(self.held.values()) or any(v < 0 for v in self.held.values()):
            raise KVOverflow(f"ledger inconsistent: used {self.used} of {self.total}")
