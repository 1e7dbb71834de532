"""Random eviction: a seeded floor that any scored method should beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.policies.base import check_int
from kvlab.policies.eviction import EvictionPolicy


@dataclass(frozen=True)
class RandomPolicy(EvictionPolicy):
    name = "random"
    summary = "uniformly random prompt positions per KV head (seeded)"

    seed: int = field(default=0, metadata={"help": "seed; each layer draws from seed and its index"})

    def __post_init__(self):
        super().__post_init__()
        check_int("seed", self.seed, minimum=0)

    def score(self, keys, values, attn, layer_idx):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + layer_idx)
        return torch.rand(keys.shape[:-1], generator=generator).to(keys.device)
