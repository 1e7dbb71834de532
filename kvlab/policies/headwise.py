"""Per-KV-head budgets on transformers' cache: kept positions padded to the layer's longest head,
the padding masked out of attention (exact), and what that padding costs.

transformers' cache holds one ``[B, Hkv, L, D]`` tensor per layer, so every KV head of a layer
has the same length ``L``. A head-adaptive selection (AdaKV; KVzip's budgets) keeps a different
number of positions per head; here each head's kept positions come first (ascending), padded with
masked slots up to ``L = max over (row, head)`` of the kept count. Decode steps append real
tokens after the padding. Attention then masks the padding per head: the layer leaves a
per-head validity mask in a slot read by the attention function installed by
:func:`install_head_masks` (it wraps the model's current attention function, kvlab's query
hand-off included), which turns it into a ``[B, Hq, q, kv]`` boolean mask. Exact: a masked slot
gets zero weight, as if it were not there.

The cost, measured by :func:`head_stats`: ``padded_tokens - kept_tokens`` slots per head hold
bytes and bandwidth for nothing, and SDPA runs with a 4-D mask (so transformers repeats K/V per
query head and the flash/fused GQA paths are off). kvpress's own AdaKV keeps *all* positions and
masks the evicted ones, so it frees nothing; this layout frees everything above the longest head.

A cleaner shared hook (for after the restructure): the attention hand-off in
:mod:`kvlab.storage.attention` could take a per-layer mask provider from the cache layer (one
wrapper, no second registered implementation), and :func:`kvlab.policies.cache_stats` could
report ``kept_tokens`` next to ``physical_tokens`` for any layer exposing a validity mask.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from kvlab.policies.cache import EvictionError, tensor_bytes
from kvlab.storage.attention import fit_mask, install_wrapped

PREFIX = "kvlab_heads_"
_slots = threading.local()


def adakv_keep_mask(scores: torch.Tensor, n_kept: int, alpha_safeguard: float) -> torch.Tensor:
    """kvpress ``AdaKVPress.compress``: each head's top ``int(n_kept * alpha)`` are safe; of the
    rest, the ``Hkv * (n - n_kept)`` lowest scores of the whole layer (per batch row) are evicted.
    ``scores`` ``[B, Hkv, n]``; returns the kept mask ``[B, Hkv, n]`` (``Hkv * n_kept`` True per row)."""
    bsz, heads, n = scores.shape
    scores = scores.float().clone()
    n_safe = int(n_kept * alpha_safeguard)
    if n_safe:
        top = scores.topk(n_safe, dim=-1).indices
        scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    n_pruned = heads * (n - n_kept)
    kept = torch.ones(bsz, heads * n, dtype=torch.bool, device=scores.device)
    if n_pruned:
        kept.scatter_(1, (-scores.reshape(bsz, -1)).topk(n_pruned, dim=1).indices, False)
    return kept.view(bsz, heads, n)


def ragged_layout(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kept`` ``[B, Hkv, n]`` bool -> (row index ``[B, Hkv, L]``, valid ``[B, Hkv, L]``): each
    head's kept rows ascending, then padding (index 0, invalid), ``L`` = the longest head."""
    n = kept.shape[-1]
    order = torch.arange(n, device=kept.device).expand_as(kept)
    key = torch.where(kept, order, order + n)  # kept rows first, in order
    length = int(kept.sum(dim=-1).max()) if kept.numel() else 0
    rows = key.sort(dim=-1).values[..., :length]
    valid = rows < n
    return torch.where(valid, rows, torch.zeros_like(rows)), valid


def _slot_map() -> dict:
    slots = getattr(_slots, "map", None)
    if slots is None:
        slots = _slots.map = {}
    return slots


def offer_mask(layer_idx: int, key: torch.Tensor, valid: torch.Tensor) -> None:
    """The next attention call of ``layer_idx`` over exactly ``key`` masks the invalid slots."""
    _slot_map()[layer_idx] = (weakref.ref(key), valid)


def _take_mask(layer_idx, key: torch.Tensor) -> torch.Tensor | None:
    entry = _slot_map().get(layer_idx)
    if entry is None or entry[0]() is not key:
        return None
    del _slot_map()[layer_idx]
    return entry[1]


def head_mask(valid: torch.Tensor, attention_mask, q_len: int, n_heads: int) -> torch.Tensor:
    """``valid`` ``[B, Hkv, kv]`` and the model's mask (4-D bool/float, or None: causal) -> ``[B, Hq, q, kv]`` bool."""
    bsz, n_kv, kv = valid.shape
    allowed = valid.repeat_interleave(n_heads // n_kv, dim=1)[:, :, None, :]
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        base = attention_mask[..., -kv:]
        base = base if base.dtype == torch.bool else base > torch.finfo(base.dtype).min / 2
    else:
        rows = torch.arange(q_len, device=valid.device)[:, None] + (kv - q_len)
        base = (torch.arange(kv, device=valid.device)[None, :] <= rows)[None, None]
    return base & allowed


def _wrap(base: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        valid = _take_mask(getattr(module, "layer_idx", None), key)
        attention_mask = fit_mask(attention_mask, key.shape[-2])  # layers differ in length
        if valid is not None:
            attention_mask = head_mask(valid, attention_mask, query.shape[-2], query.shape[1])
        return base(module, query, key, value, attention_mask, *args, **kwargs)

    attention.__doc__ = f"{getattr(base, '__name__', 'attention')} with per-KV-head padding masked out."
    return attention


def install_head_masks(model) -> str:
    """Register ``kvlab_heads_<current>`` over the model's current attention implementation and
    switch to it (idempotent; :meth:`Policy.attach` restores the original on exit)."""
    return install_wrapped(model, PREFIX, _wrap)


class HeadBudgetMixin:
    """In front of :class:`~kvlab.policies.cache.EvictingLayer` (after any evidence mixin): the
    prefill eviction keeps ``select_heads(scores, n_kept)`` per KV head, stored padded.

    ``select_heads`` (set by the policy that builds the cache) maps ``[B, Hkv, n]`` scores and the
    layer's mean budget to a kept mask. ``kept_positions`` holds -1 in padding slots."""

    select_heads: Callable[[torch.Tensor, int], torch.Tensor]
    head_valid: torch.Tensor | None = None

    def _clear_eviction(self) -> None:
        super()._clear_eviction()
        self.head_valid = None

    def _prefill(self, new_keys, new_values):
        if self._stream_length is not None and new_keys.shape[-2] < self._stream_length:
            raise EvictionError("per-head budgets need the whole prompt in one forward: use a prefill_chunk "
                                "at least the prompt's length (ragged rows are not re-scored chunk by chunk yet)")
        return super()._prefill(new_keys, new_values)

    def _evict(self, keys, values, n_kept: int, evidence, positions=None) -> None:
        scores = self.policy.score(keys, values, evidence, self.layer_idx)
        rows, valid = ragged_layout(self.select_heads(scores, n_kept))
        gather = rows.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        kept = rows if positions is None else positions.gather(-1, rows.to(positions.device))
        kept = torch.where(valid, kept, torch.full_like(kept, -1)).to(torch.int32)
        self._keep(keys.gather(2, gather), values.gather(2, gather), kept)
        self.head_valid = valid

    def _append(self, keys, values, *args, **kwargs):
        out = super()._append(keys, values, *args, **kwargs)
        if self.head_valid is not None:
            new = self.head_valid.new_ones(*self.head_valid.shape[:2], keys.shape[-2])
            self.head_valid = torch.cat([self.head_valid, new], dim=-1)
            offer_mask(self.layer_idx, out[0], self.head_valid)
        return out

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if self.head_valid is not None and tokens_to_remove < 0:
            self.head_valid = self.head_valid[..., :tokens_to_remove]

    def _map_rows(self, fn) -> None:  # the batch operations of EvictionMixin
        super()._map_rows(fn)
        if self.head_valid is not None:
            self.head_valid = fn(self.head_valid)


def head_stats(cache) -> dict:
    """What per-head budgets cost on transformers' cache, from the prompt part of each layer:
    ``kept_tokens`` (mean logical kept positions per KV head), ``padded_tokens`` (rows stored per
    KV head, the longest head's count), and the K/V bytes of both (``kept_bytes`` is what a ragged
    store would hold). Per layer lists too."""
    kept, padded, kept_bytes, padded_bytes = [], [], 0, 0
    for layer in cache.layers:
        valid = getattr(layer, "head_valid", None)
        keys = getattr(layer, "keys", None)
        if valid is None or not isinstance(keys, torch.Tensor) or keys.dim() != 4:
            continue
        prompt_rows = valid.shape[-1] - (layer.logical_length - (layer.prompt_length or 0))
        prompt_valid = valid[..., :prompt_rows]
        kept.append(prompt_valid.float().sum(-1).mean().item())
        padded.append(prompt_rows)
        layer_bytes = tensor_bytes((keys, getattr(layer, "values", None)))
        per_slot = layer_bytes / max(1, valid.shape[0] * valid.shape[1] * valid.shape[-1])
        padded_bytes += round(per_slot * valid.numel())
        kept_bytes += round(per_slot * (valid.sum().item()))
    n = len(kept)
    return {
        "kept_tokens": round(sum(kept) / n, 2) if n else 0,
        "padded_tokens": round(sum(padded) / n, 2) if n else 0,
        "kept_bytes": int(kept_bytes),
        "padded_bytes": int(padded_bytes),
        "kept_tokens_per_layer": [round(k, 2) for k in kept],
        "padded_tokens_per_layer": padded,
    }
