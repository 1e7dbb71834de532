"""Random eviction: a seeded floor that any scored method should beat (positions drawn per layer and
KV head from the seed, the same in every sequence of a batch)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import int_param
from kvlab.policies.eviction import EvictionPolicy


@dataclass(frozen=True)
class RandomPolicy(EvictionPolicy):
    name = "random"
    summary = "uniformly random prompt positions per KV head (seeded; the same in every sequence)"

    seed: int = int_param(0, "seed; each layer draws from seed and its index", minimum=0)

    def score(self, keys, values, attn, layer_idx):
        """One draw per KV head and position, the same for every sequence of the batch: a sequence's
        selection must not depend on its row or on the batch it was prefilled with (the fast engine
        prefills large batches in row groups). Row 0 draws what it drew before this was per row."""
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer_idx)
        return torch.rand(keys.shape[1:-1], generator=generator).to(keys.device).expand(keys.shape[:-1])
