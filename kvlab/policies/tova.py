"""TOVA at prefill: keep what the last prompt query attends to, averaged over all query heads.

Every KV head of a layer keeps the same positions; the last prompt token is always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.eviction import EvictionPolicy
from kvlab.policies.snapkv import protect_tail


def tova_scores(attn: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``attn`` ``[B, Hq, 1+, n]`` -> scores ``[B, Hkv, n]`` from its last row."""
    last = attn[:, :, -1, :-1].mean(dim=1, keepdim=True)
    return protect_tail(last.expand(-1, num_kv_heads, -1), 1)


@dataclass(frozen=True)
class TOVAPolicy(EvictionPolicy):
    name = "tova"
    summary = "attention of the last prompt token, averaged over heads (per layer)"
    needs_attention = True

    def query_window(self, n: int) -> int:
        return 1

    def score(self, keys, values, attn, layer_idx):
        return tova_scores(attn, keys.shape[1])
