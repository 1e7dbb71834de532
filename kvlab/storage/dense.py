"""The dense family: the whole cache at the model dtype.

``hf``: transformers' ``DynamicLayer`` (an evicting policy puts its eviction in front of it,
:mod:`kvlab.policies.cache`). ``fast``: :class:`DenseStore`, K/V at the model dtype in
``[B, Hkv, C, D]``, head-major: each (row, KV head) is one contiguous segment of ``C`` slots, which
flash attention's variable-length kernel reads as a sequence of its own (one KV head, the GQA
group's query heads; ``seqused_k`` per segment), so the kernel's GQA transposes stay views at any
batch; else SDPA with a length mask (any device, the CPU reference) or, opt-in, cuDNN's attention.
With ``attention="triton"`` the fast engine keeps the dense cache in kvlab's bf16 format instead
(:class:`kvlab.storage.kvq.QuantizedStore`), read by the same split-K kernel as the quantized formats.
Serving: :class:`DensePool`, K/V at the model dtype in ``[slots, Hkv, D]`` per layer, which the
Triton paged decode reads in place (:func:`kvlab.kernels.paged.paged_decode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvlab.errors import EngineError
from kvlab.kernels.paged import paged_decode
from kvlab.storage.base import ModelShape, StoreOptions
from kvlab.storage.kvq import QuantizedStore
from kvlab.storage.loading import PromptStorage
from kvlab.storage.paged import PagedPool, PoolShape
from kvlab.storage.slots import (
    DENSE_ATTENTION,
    Layout,
    ModelDtypeStore,
    StepSlots,
    cudnn_decode,
    cumulative_offsets,
    dense_attention,
    flash_decode,
    sdpa_decode,
)
from kvlab.storage.store_cache import StoreCache


class DenseStore(ModelDtypeStore):
    """Per-layer K/V at the model dtype, ``[B, Hkv, C_l, D]``, attended with ``flash``, ``sdpa`` or
    ``cudnn`` (:func:`cudnn_decode`, opt-in: ``auto`` stays flash until it is measured faster).

    ``offsets[l]``: flash's ``cu_seqlens`` for layer ``l``'s ``B Hkv`` segments (constants).
    ``splits``: flash's split-KV count (None: its heuristic; :func:`flash_varlen`). ``bias[l]``:
    cuDNN's length bias for layer ``l``, computed for every layer in :meth:`begin` (two kernels)."""

    kv_format = "model dtype"

    def __init__(self, layout: Layout, dtype, device, scale: float, attention: str = "auto",
                 splits: int | None = None):
        self.layout = layout
        self.attention = dense_attention(attention, device, dtype, DENSE_ATTENTION)
        self.scale = scale
        self.splits = splits
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.keys = [torch.zeros(b, h, c, d, dtype=dtype, device=device) for c in layout.capacity]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.slots = StepSlots(layout.kept, layout.batch, device, segments=h)
        self.offsets = [cumulative_offsets(b * h, c, device) for c in layout.capacity]
        width = -(-max(layout.capacity) // 8) * 8  # rows 16-byte aligned, as cuDNN wants its operands
        self._slot_index = torch.arange(width, dtype=torch.int32, device=device)
        self._bias = torch.zeros(len(layout.kept), width, dtype=dtype, device=device)
        self._open, self._shut = (torch.tensor(x, dtype=dtype, device=device) for x in (0.0, float("-inf")))

    def begin(self) -> None:
        """Every layer's slot and length, and with ``cudnn`` its length bias."""
        super().begin()
        if self.attention == "cudnn":
            torch.where(self._slot_index < self.slots.used_column(), self._open, self._shut, out=self._bias)

    def bias(self, layer: int) -> torch.Tensor:
        return self._bias[layer, :self.layout.capacity[layer]].view(1, 1, 1, -1)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor a step writes or reads in place, the cuDNN length bias included."""
        return [*super().buffers(), self._bias]

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        n = k.shape[-2]
        self.keys[layer][rows, :, :n].copy_(k)
        self.values[layer][rows, :, :n].copy_(v)

    def write_prefill(self, layer: int, rows: slice, start: int, k: torch.Tensor, v: torch.Tensor):
        """A prefill chunk's K/V into slots ``start..`` of batch rows ``rows`` (:class:`StoreCache`);
        what its attention reads: the slots written so far (views, nothing copied)."""
        end = start + k.shape[-2]
        keys, values = self.keys[layer][rows], self.values[layer][rows]
        keys[:, :, start:end].copy_(k)
        values[:, :, start:end].copy_(v)
        return keys[:, :, :end], values[:, :, :end]

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        slot = self.slots.slot(layer)
        self.keys[layer].index_copy_(2, slot, k)
        self.values[layer].index_copy_(2, slot, v)
        if self.attention == "flash":
            return flash_decode(q, self.keys[layer], self.values[layer], self.slots.segment_used(layer), self.scale,
                                *self.offsets[layer], splits=self.splits)
        if self.attention == "cudnn":
            return cudnn_decode(q, self.keys[layer], self.values[layer], self.bias(layer), self.scale)
        return sdpa_decode(q, self.keys[layer], self.values[layer], slot + 1, self.scale)


class DensePool(PagedPool):
    """K and V per layer as ``[slots, Hkv, D]`` in the model dtype."""

    paged_kernel = True
    captures_decode = True

    def __init__(self, shape: PoolShape, dtype: torch.dtype, device):
        size = (shape.num_layers, shape.slots, shape.kv_heads, shape.head_dim)
        self.k = torch.zeros(size, dtype=dtype, device=device)
        self.v = torch.zeros(size, dtype=dtype, device=device)
        self.dtype, self.block_size = dtype, shape.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        """``k``/``v`` ``[n, Hkv, D]`` into ``slots [n]`` (a dense pool keeps no per-request state)."""
        self.k[layer, slots] = k.to(self.dtype)
        self.v[layer, slots] = v.to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, slots].transpose(0, 1), self.v[layer, slots].transpose(0, 1)

    def decode(self, layer: int, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
               scale: float) -> torch.Tensor:
        return paged_decode(q, self.k[layer], self.v[layer], tables, lengths, self.block_size, scale)


@dataclass(frozen=True)
class DenseStorage(PromptStorage):
    """The model dtype, every kept token. ``prefill``: the evicting policy whose cache the prefill
    fills (None: the prompt is written whole, straight into the fast engine's store)."""

    prefill: Any = None
    kv_format = "model dtype"

    def check(self, shape: ModelShape, cuda: bool) -> None:
        """Any model: nothing to check."""

    def make_cache(self, num_layers: int):
        from transformers import DynamicCache

        return DynamicCache()

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        return 2 * kv_heads * head_dim * element_size

    def store(self, layout: Layout, options: StoreOptions):
        if options.attention == "triton":  # bf16 read by kvlab's split-K kernel
            if options.dtype != torch.bfloat16:
                raise EngineError("attention='triton' stores the cache in bf16: load the model in bfloat16")
            return QuantizedStore(layout, "bf16", options.num_heads, options.dtype, options.device, options.scale,
                                  "fused")
        return DenseStore(layout, options.dtype, options.device, options.scale, options.attention,
                          options.flash_splits)

    def prefill_cache(self, store, rows: slice | None, model):
        return StoreCache(store, rows) if self.prefill is None else self.prefill.make_cache(model)

    def paged_pool(self, shape: PoolShape, dtype: torch.dtype, device) -> DensePool:
        return DensePool(shape, dtype, device)


