"""The ragged family: per-KV-head budgets (AdaKV, scope 'layer'); on ``fast`` only the kept rows are allocated.

A layer with budget ``k`` keeps exactly ``Hkv x k`` prompt rows per sequence, split unevenly over
its KV heads (``kept[b, h]``, known only after the prefill). Its K and its V are each one flat
buffer of ``B x Hkv x (k + new_tokens)`` rows ``[N, D]`` at the model dtype: a static size, so a CUDA
graph captures it once. Batch row ``b`` owns the block of rows ``[b R, (b + 1) R)``, ``R = Hkv (k +
new)``, and inside it KV head ``h`` a segment at ``off[b, h]`` of ``kept[b, h] + new`` rows
(:func:`segment_offsets`). :meth:`RaggedStore.load` writes each head's kept rows at the start of its
segment and fills the offsets and lengths (device tensors, read in place by the captured graph);
decode step ``s`` writes head ``(b, h)``'s token at ``off + kept + s`` and attends over the first
``kept + s + 1`` rows of its segment. The same bytes as a dense store of the layer's mean budget
(:meth:`~kvlab.storage.slots.Layout.dense_bytes`); transformers' cache on ``hf`` pads every head to
the layer's longest (:func:`kvlab.policies.headwise.head_stats`).

Attention treats each (row, KV head) as a sequence with one KV head and its GQA group's ``Hq / Hkv``
query heads: ``flash`` (CUDA) is flash attention's varlen kernel with ``cu_seqlens_k`` = the
segment offsets and ``seqused_k`` = the used lengths (:func:`ragged_flash_decode`); ``sdpa`` (any
device, the CPU reference) attends each row's block with a mask of the head's segment
(:func:`ragged_sdpa_decode`), ``Hkv`` times the work of the segments alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvlab.errors import EngineError, PolicyError
from kvlab.storage.base import ModelShape, StoreOptions, layer_tensors, paged_layout
from kvlab.storage.paged import PoolDefaults
from kvlab.storage.slots import Layout, ModelDtypeStore, dense_attention, flash_varlen, row_slice


def segment_offsets(lengths: torch.Tensor, kept: int, new_tokens: int, first_row: int = 0) -> torch.Tensor:
    """Each (row, KV head) segment's first row in a layer's flat buffer, ``[b, Hkv]`` int64.

    ``lengths`` ``[b, Hkv]``: the kept rows per head of batch rows ``first_row, ...``; each row must keep
    ``Hkv x kept`` rows over its heads (the layer's budget), so its segments of ``lengths + new_tokens``
    rows fill its block of ``Hkv x (kept + new_tokens)`` exactly."""
    bsz, heads = lengths.shape
    totals = lengths.sum(dim=-1)
    if bool((totals != heads * kept).any()):
        raise ValueError(f"the rows keep {totals.tolist()} positions over their {heads} KV heads, the store holds "
                         f"{heads} x {kept} = {heads * kept} per row")
    sizes = lengths.long() + new_tokens
    starts = sizes.cumsum(dim=-1) - sizes
    rows = torch.arange(first_row, first_row + bsz, device=lengths.device, dtype=torch.long)
    return rows[:, None] * (heads * (kept + new_tokens)) + starts


def per_head_budget(lengths: torch.Tensor) -> int:
    """A layer's budget from its kept rows per (row, KV head) ``[B, Hkv]``: the same total in every row,
    a whole number per head (what a scope-'layer' head-adaptive selection keeps)."""
    totals = lengths.sum(dim=-1)
    heads = lengths.shape[-1]
    total = int(totals[0])
    if bool((totals != total).any()) or total % heads:
        raise ValueError(f"the rows keep {totals.tolist()} positions over {heads} KV heads: a ragged store needs the "
                         f"same multiple of {heads} in every row (adakv scope='layer')")
    return total // heads


def ragged_flash_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cu_q: torch.Tensor,
                        cu_k: torch.Tensor, used: torch.Tensor, max_k: int, scale: float) -> torch.Tensor:
    """Decode attention over the segments with flash's varlen kernel; ``[B, Hq, D]``.

    ``q`` ``[B, Hq, 1, D]``; ``keys``/``values`` ``[N, D]`` (a layer's flat buffers); ``cu_q`` int32
    ``[S + 1]`` (0..S), ``cu_k`` int32 ``[S + 1]`` (segment ``i = b Hkv + h`` starts at ``cu_k[i]``; the last
    entry is ``N``), ``used`` int32 ``[S]``, ``max_k`` at least the longest segment, all fixed for a
    captured graph. Segment ``i`` has one KV head and query heads ``h G .. (h + 1) G - 1`` of row ``b``."""
    bsz, n_heads, _, dim = q.shape
    segments = used.shape[0]
    out = flash_varlen(q.reshape(segments, bsz * n_heads // segments, dim), keys.view(-1, 1, dim),
                       values.view(-1, 1, dim), cu_q, cu_k, max_k, used, scale)
    return out.view(bsz, n_heads, dim)


def ragged_sdpa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                       used: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference of :func:`ragged_flash_decode` (any device): each KV head's queries attend their row's
    whole block of the flat buffers, masked to the head's segment; ``[B, Hq, D]``.

    ``offsets``/``used`` ``[S]`` (``S = B Hkv``): each segment's first row in the buffer and rows used."""
    bsz, n_heads, _, dim = q.shape
    heads = used.shape[0] // bsz
    block = keys.shape[0] // bsz
    start = offsets.view(bsz, heads) - torch.arange(bsz, device=q.device)[:, None] * block
    rel = torch.arange(block, device=q.device)
    valid = (rel >= start[..., None]) & (rel < (start + used.view(bsz, heads))[..., None])  # [B, Hkv, R]
    k = keys.view(bsz, 1, block, dim).expand(bsz, heads, block, dim)
    v = values.view(bsz, 1, block, dim).expand(bsz, heads, block, dim)
    out = F.scaled_dot_product_attention(q.reshape(bsz, heads, n_heads // heads, dim), k, v,
                                         attn_mask=valid[:, :, None, :], scale=scale)
    return out.reshape(bsz, n_heads, dim)


class SegmentSlots:
    """Per layer and segment (row, KV head): its first row, kept rows, this step's write row and used
    length. :meth:`begin` computes every layer's at once (two kernels per step); until a load sets them,
    every head holds the layer's budget (so a graph's warm-up steps write inside their segments)."""

    def __init__(self, layout: Layout, device):
        segments = layout.batch * layout.kv_heads
        n_layers = len(layout.kept)
        self.layout = layout
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.offsets = torch.zeros(n_layers, segments, dtype=torch.long, device=device)
        self._end = torch.zeros_like(self.offsets)  # offsets + kept: step 0's row
        self._next = torch.zeros_like(self.offsets)  # kept + 1: rows used at step 0
        self._slots = torch.zeros_like(self.offsets)
        self._used = torch.zeros(n_layers, segments, dtype=torch.int32, device=device)
        self._cu_k = torch.zeros(n_layers, segments + 1, dtype=torch.int32, device=device)
        self.cu_q = torch.arange(segments + 1, dtype=torch.int32, device=device)
        for layer, kept in enumerate(layout.kept):
            self._cu_k[layer, -1] = layout.batch * layout.kv_heads * (kept + layout.new_tokens)
            even = torch.full((layout.batch, layout.kv_heads), kept, dtype=torch.long, device=device)
            self.set_rows(layer, slice(0, layout.batch), segment_offsets(even, kept, layout.new_tokens), even)

    def set_rows(self, layer: int, rows: slice, offsets: torch.Tensor, lengths: torch.Tensor) -> None:
        """Batch rows ``rows`` of layer ``layer`` hold segments at ``offsets`` with ``lengths`` kept rows."""
        heads = self.layout.kv_heads
        flat = slice(rows.start * heads, rows.stop * heads)
        offsets, lengths = offsets.reshape(-1), lengths.reshape(-1).long()
        self.offsets[layer, flat] = offsets
        self._end[layer, flat] = offsets + lengths
        self._next[layer, flat] = lengths + 1
        self._cu_k[layer, flat] = offsets.to(torch.int32)

    def begin(self) -> None:
        torch.add(self._end, self.step, out=self._slots)
        torch.add(self._next, self.step, out=self._used)

    def slot(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s write row per segment this step, int64 ``[S]``."""
        return self._slots[layer]

    def used(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s rows attended per segment this step, int32 ``[S]``."""
        return self._used[layer]

    def cu_k(self, layer: int) -> torch.Tensor:
        return self._cu_k[layer]

    def advance(self) -> None:
        self.step.add_(1)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.step, self.offsets, self._end, self._next, self._slots, self._used, self._cu_k, self.cu_q)


class RaggedStore(ModelDtypeStore):
    """Per-layer flat K/V ``[B Hkv (k_l + new), D]`` at the model dtype, one segment per (row, KV head),
    attended with ``flash`` (varlen over the segments) or ``sdpa`` (masked, the reference)."""

    kv_format = "model dtype, ragged heads"

    def __init__(self, layout: Layout, dtype, device, scale: float, attention: str = "auto"):
        self.layout = layout
        self.attention = dense_attention(attention, device, dtype)
        self.scale = scale
        rows = [layout.batch * layout.kv_heads * c for c in layout.capacity]
        self.keys = [torch.zeros(n, layout.head_dim, dtype=dtype, device=device) for n in rows]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.slots = SegmentSlots(layout, device)
        # a head keeps at most its layer's whole budget: the longest segment flash may see (fixed per graph)
        self.max_segment = [layout.kv_heads * k + layout.new_tokens for k in layout.kept]

    def load(self, layer_kv, rows: slice | None = None) -> None:
        """Each layer's ``(keys, values, lengths)`` after the prefill (:func:`head_tensors`:
        ``[b, Hkv, n, D]`` with head ``(b, h)``'s kept rows first, ``lengths`` ``[b, Hkv]``) into batch rows
        ``rows`` (None: all): each head's kept rows at the start of its segment, the padding left behind."""
        for i, (k, v, lengths) in enumerate(layer_kv):
            where = row_slice(rows, self.layout.batch, k.shape[0], i)
            offsets = segment_offsets(lengths, self.layout.kept[i], self.layout.new_tokens, where.start)
            index = torch.arange(k.shape[-2], device=k.device)
            real = index < lengths[..., None]  # [b, Hkv, n]
            dest = (offsets[..., None] + index)[real]
            self.keys[i].index_copy_(0, dest, k[real].to(self.keys[i].dtype))
            self.values[i].index_copy_(0, dest, v[real].to(self.values[i].dtype))
            self.slots.set_rows(i, where, offsets, lengths)
        self.step.zero_()

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        bsz, _, _, dim = q.shape
        slot, used = self.slots.slot(layer), self.slots.used(layer)
        self.keys[layer].index_copy_(0, slot, k.reshape(-1, dim))
        self.values[layer].index_copy_(0, slot, v.reshape(-1, dim))
        if self.attention == "flash":
            return ragged_flash_decode(q, self.keys[layer], self.values[layer], self.slots.cu_q,
                                       self.slots.cu_k(layer), used, self.max_segment[layer], self.scale)
        return ragged_sdpa_decode(q, self.keys[layer], self.values[layer], self.slots.offsets[layer], used,
                                  self.scale)


def head_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer of a per-head-budget cache right after its prefill: the stored K/V ``[B, Hkv, L, D]``
    and each (row, KV head)'s kept count ``[B, Hkv]`` (int64). A head's kept rows come first
    (:func:`ragged_layout`), its padding after; a layer that evicted nothing keeps all ``L`` rows
    per head. What the fast engine's ragged store copies (the padding stays behind)."""
    out = []
    for i, ((keys, values), layer) in enumerate(zip(layer_tensors(cache), cache.layers, strict=True)):
        prompt = getattr(layer, "prompt_length", None)
        if prompt is None or getattr(layer, "logical_length", None) != prompt:
            raise PolicyError(f"layer {i} holds tokens after its prefill (or no prefill): take the per-head "
                                f"rows right after the prefill")
        valid = getattr(layer, "head_valid", None)
        if valid is None:
            lengths = torch.full(keys.shape[:2], keys.shape[-2], dtype=torch.long, device=keys.device)
        else:
            lengths = valid.sum(dim=-1)
        out.append((keys, values, lengths))
    return out


@dataclass(frozen=True)
class RaggedStorage(PoolDefaults):
    """Per-KV-head budgets with a fixed total per layer: each (row, KV head)'s kept rows in a segment of
    its own at the model dtype, no padding. ``prefill``: the policy whose prefill selects per head (its
    cache, padded per head on ``hf``: :mod:`kvlab.policies.headwise`, is what the store loads from)."""

    prefill: Any = None
    kv_format = "model dtype, ragged heads"

    def check(self, shape: ModelShape, cuda: bool) -> None:
        """Any full-attention model (the prefill policy checks it)."""

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        return 2 * kv_heads * head_dim * element_size

    def paged(self, kv_heads: int, head_dim: int, block_tokens: int = 16, element_size: int = 2):
        """Blocks of ``block_tokens`` tokens per layer, counted over the layer's KV heads together (a
        layer keeps ``Hkv x budget`` rows in all, however they split over its heads)."""
        return paged_layout(self.token_bytes(kv_heads, head_dim, element_size), block_tokens)

    def store(self, layout: Layout, options: StoreOptions):
        if options.attention in ("triton", "cudnn"):
            raise EngineError(f"attention={options.attention!r} reads one length per layer; per-KV-head budgets "
                              "(adakv) need the ragged store: use attention auto, flash or sdpa")
        return RaggedStore(layout, options.dtype, options.device, options.scale, options.attention)

    def prefill_cache(self, store, rows: slice | None, model):
        return self.prefill.make_cache(model)

    def load(self, store, cache, rows: slice | None = None) -> None:
        store.load(head_tensors(cache), rows)

    def kept(self, cache) -> tuple[int, tuple[int, ...]]:
        """A layer's budget: its kept rows per row over the KV heads."""
        kv = head_tensors(cache)
        return kv[0][0].shape[0], tuple(per_head_budget(lengths) for _, _, lengths in kv)
