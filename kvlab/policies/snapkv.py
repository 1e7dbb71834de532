"""SnapKV: keep what the last ``window_size`` prompt queries attend to.

Score (kvpress semantics): attention of the window queries to the earlier prompt keys, averaged
over the window, smoothed by 1-D average pooling (``kernel_size``), averaged over each GQA group; the
window itself scores above everything, so it is always kept (when the budget is smaller than the
window, its most recent tokens win).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.policies.base import PolicyError, int_param
from kvlab.policies.eviction import EvictionPolicy


def protect_tail(scores: torch.Tensor, tail: int) -> torch.Tensor:
    """Append ``tail`` positions scored above every other score, later ones higher."""
    bsz, heads, n = scores.shape
    # above each sequence's own maximum: nothing of one sequence depends on another row of the batch
    top = (scores.amax(dim=(1, 2), keepdim=True) + 1 if n
           else torch.ones(bsz, 1, 1, device=scores.device, dtype=scores.dtype))
    ramp = torch.arange(tail, device=scores.device, dtype=scores.dtype) / max(tail, 1)
    return torch.cat([scores, (top + ramp).expand(bsz, heads, tail)], dim=-1)


def snapkv_scores(attn: torch.Tensor, num_kv_heads: int, kernel: int) -> torch.Tensor:
    """``attn`` ``[B, Hq, w, n]`` (window rows) -> scores ``[B, Hkv, n]``."""
    bsz, n_heads, w, n = attn.shape
    observed = attn[..., : n - w].mean(dim=-2)
    if observed.shape[-1]:
        observed = F.avg_pool1d(observed, kernel_size=kernel, padding=kernel // 2, stride=1)
    observed = observed.view(bsz, num_kv_heads, n_heads // num_kv_heads, n - w).mean(dim=2)
    return protect_tail(observed, w)


@dataclass(frozen=True)
class SnapKVPolicy(EvictionPolicy):
    name = "snapkv"
    summary = "attention of the last prompt window, pooled, per KV head; window always kept"
    needs_attention = True

    window_size: int = int_param(64, "last prompt queries whose attention scores the rest", minimum=1)
    kernel_size: int = int_param(5, "odd average-pooling kernel over positions", minimum=1)

    def __post_init__(self):
        super().__post_init__()
        if self.kernel_size % 2 == 0:
            raise PolicyError(f"kernel_size={self.kernel_size} must be odd so pooling keeps every position (e.g. 5)")

    def query_window(self, n: int) -> int:
        return self.window_size

    def score(self, keys, values, attn, layer_idx):
        return snapkv_scores(attn, keys.shape[1], self.kernel_size)
