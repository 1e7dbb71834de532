"""K-norm: keep the keys with the lowest L2 norm (a cheap, attention-free floor for plots)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.eviction import EvictionPolicy


@dataclass(frozen=True)
class KnormPolicy(EvictionPolicy):
    name = "knorm"
    summary = "lowest key L2 norm kept, per KV head (no attention needed)"

    def score(self, keys, values, attn, layer_idx):
        return -keys.float().norm(dim=-1)
