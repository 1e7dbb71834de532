"""The block allocator: a free list of block ids, and the flat slots a block table addresses.

The K/V slots behind the ids are the storage's pool (:meth:`kvlab.storage.base.Storage.paged_pool`,
:mod:`kvlab.storage.paged`); slot ``block * block_size + offset`` of every layer.
"""

from __future__ import annotations

from collections import deque

import torch


class BlockAllocator:
    """Block ids on a free list (FIFO, as nano-vllm's); ``used`` counts the ids handed out."""

    def __init__(self, num_blocks: int):
        self.total = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self.free_ids)

    @property
    def used(self) -> int:
        return self.total - len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"allocate({n}) with {len(self.free_ids)} free blocks: the scheduler must check first")
        return [self.free_ids.popleft() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)


def slots_of(blocks: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Flat slots of token indices ``start..stop-1`` of a request whose block table is ``blocks``."""
    idx = torch.arange(start, stop)
    table = torch.tensor(blocks, dtype=torch.long)
    return table[idx // block_size] * block_size + idx % block_size
