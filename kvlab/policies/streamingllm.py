"""StreamingLLM at prefill: the first ``n_sink`` prompt positions plus the most recent ones.

Positions are not re-indexed: kept keys keep their RoPE rotation and decoding continues at the
original positions (kvpress's StreamingLLMPress; the paper's rolling, re-rotated window differs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.policies.base import int_param
from kvlab.policies.eviction import EvictionPolicy


def sink_and_recent(n: int, n_kept: int, n_sink: int) -> torch.Tensor:
    """Positions ``[0, s) + [n - (n_kept - s), n)`` with ``s = min(n_sink, n_kept)``."""
    sink = min(n_sink, n_kept)
    return torch.cat([torch.arange(sink), torch.arange(n - (n_kept - sink), n)])


@dataclass(frozen=True)
class StreamingLLMPolicy(EvictionPolicy):
    name = "streamingllm"
    summary = "attention sinks + most recent prompt tokens (same positions in every head)"

    n_sink: int = int_param(4, "first prompt positions always kept", minimum=0)

    def shape_problem(self, ctx: int) -> str | None:
        kept = min(ctx, self.budget(ctx, 0, 1))
        if self.n_sink <= kept:
            return None
        return (f"n_sink={self.n_sink} is more than the {kept} tokens keep={self.keep:g} keeps at ctx {ctx}: only "
                f"{kept} sinks and no recent token would be kept; lower n_sink below {kept} or raise keep")

    def select(self, keys, values, attn, n_kept, layer_idx, num_layers):
        bsz, heads, n, _ = keys.shape
        return sink_and_recent(n, n_kept, self.n_sink).to(keys.device).expand(bsz, heads, -1)
