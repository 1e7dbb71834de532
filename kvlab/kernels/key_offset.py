"""A per-channel key offset subtracted before a per-token quantizer (``KeyOffset``).

Why: some models (Qwen2's k_proj bias) give a few key channels a large, almost constant offset
(-355 +- 1.3 in Qwen2.5-Coder-1.5B's layer 0). A format with one scale per token (``int4-g64``,
``fp8``) then spends its range on the offset and loses the quiet channels: garbage output.
Subtracting each (row, KV head, channel)'s offset ``m`` before
quantizing keeps the range on what varies. Attention needs no correction: for any query,
``q . (k - m) = q . k - q . m`` and ``q . m`` is the same for every key, so softmax is unchanged;
the stores hold codes of ``k - m`` and the decode kernels read them as they are. The offset costs
``head_dim`` float32 per (row, KV head, layer) and no per-token bytes.

The offset is fitted once, on the first keys a store receives (the prompt, or its first chunk under
chunked prefill) and kept: every later token is quantized as ``k - m`` with the same ``m``. A later
token whose channels drift from the prompt's mean is still quantized with its own per-token range,
so drift costs precision on that token only (its range widens by the drift), never correctness.

    offset = KEY_OFFSETS["prompt-mean"].fit(keys)   # [B, Hkv, D] float32, or None for "none"
    shifted(keys, offset)                            # what the quantizer sees
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class KeyOffset:
    """How a per-token key store picks the offset it subtracts: ``none`` (the per-token layout as it
    was, no offset) or ``prompt-mean`` (each channel's mean over the first keys stored)."""

    name: str
    summary: str
    subtracts: ClassVar[bool] = True  # whether a store keeps an offset tensor for it

    def fit(self, keys: torch.Tensor) -> torch.Tensor | None:
        """The offset ``[B, Hkv, D]`` (float32) for keys ``[B, Hkv, n, D]``; None: keys stored as they are."""
        raise NotImplementedError


@dataclass(frozen=True)
class NoKeyOffset(KeyOffset):
    subtracts: ClassVar[bool] = False

    def fit(self, keys: torch.Tensor) -> None:
        return None


@dataclass(frozen=True)
class PromptMeanOffset(KeyOffset):
    def fit(self, keys: torch.Tensor) -> torch.Tensor:
        return keys.float().mean(dim=-2)


KEY_OFFSETS: dict[str, KeyOffset] = {o.name: o for o in (
    PromptMeanOffset("prompt-mean", "each key channel's mean over the prompt, subtracted before quantizing"),
    NoKeyOffset("none", "keys quantized as they are (the per-token layout before the offset)"),
)}
DEFAULT_KEY_OFFSET = "prompt-mean"


def shifted(keys: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """``keys [B, Hkv, n, D]`` minus ``offset [B, Hkv, D]`` in float32 (the write kernel's arithmetic);
    ``keys`` themselves when there is no offset."""
    if offset is None:
        return keys
    return keys.float() - offset.unsqueeze(-2)
