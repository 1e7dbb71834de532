"""A transformers cache whose layers write the prefill's K/V straight into the fast engine's static
store (issue #28: ``fast`` held the whole prefill cache beside the store, one extra cache at peak).

    cache = StoreCache(store, rows)        # rows: the batch rows this prefill fills (None: all)
    generation.prefill(model, ids, cache)  # every layer's K/V lands in the store's slots 0..n
    # nothing to load: the store holds the prompt; cache.get_seq_length() is the prompt length

Only for policies that keep every prompt token (``full``, and the quantized formats whose prefill
policy is ``full``): an evicting policy needs the whole prompt's K/V before it selects, so it still
prefills into its own cache and :meth:`~kvlab.engine.fast.FastDecoder.load` copies what it kept.

What each layer's attention sees, as on ``hf``:
- a dense store (model dtype): the store's slots ``[0, end)`` (views; nothing copied);
- a quantized store: the first forward (one-shot prefill or first chunk) attends its exact K/V, as
  :class:`~kvlab.policies.quantized.kvq_layers.KVQLayer` does, and fixes the store's key offset, if
  it has one; later chunks attend the stored codes dequantized (a transient of one layer; keys minus
  the offset, which attention does not see), as ``KVQLayer`` does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.engine.kvstore import DenseStore, QuantizedStore, row_slice
from kvlab.kernels import quantize_write
from kvlab.policies.cache import StoredLengthMixin


class StoreLayer(StoredLengthMixin, DynamicLayer):
    """One layer of :class:`StoreCache`: K/V written into layer ``layer`` of ``store``, rows ``rows``."""

    def __init__(self, store, layer: int, rows: slice):
        super().__init__()
        self.store, self.layer, self.rows = store, layer, rows
        self.stored_tokens = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)  # empty keys/values: the store holds them
        start, n = self.stored_tokens, key_states.shape[-2]
        end = start + n
        if end > self.store.layout.kept[self.layer]:
            raise ValueError(f"layer {self.layer}: the prompt has more than the store's "
                             f"{self.store.layout.kept[self.layer]} slots")
        rows = row_slice(self.rows, self.store.layout.batch, key_states.shape[0], self.layer)
        self.stored_tokens = end
        if isinstance(self.store, DenseStore):
            keys, values = self.store.keys[self.layer][rows], self.store.values[self.layer][rows]
            keys[:, :, start:end].copy_(key_states)
            values[:, :, start:end].copy_(value_states)
            return keys[:, :, :end], values[:, :, :end]
        slots = torch.arange(start, end, device=key_states.device)
        kstore, vstore = self.store.keys[self.layer].rows(rows), self.store.values[self.layer].rows(rows)
        offset = (self.store.fit_key_offset(self.layer, rows, key_states) if start == 0  # fixed by the first chunk
                  else self.store.key_offset(self.layer, rows))
        quantize_write(kstore, key_states.contiguous(), slots, offset=offset)
        quantize_write(vstore, value_states.contiguous(), slots)
        if start == 0:  # the prefill attends exactly
            return key_states, value_states
        return kstore.dequantize(end).to(key_states.dtype), vstore.dequantize(end).to(value_states.dtype)


class StoreCache(Cache):
    """The prefill cache of a fast decoder whose policy keeps every token: one :class:`StoreLayer`
    per layer of ``store`` (a :class:`DenseStore` or :class:`QuantizedStore`)."""

    def __init__(self, store: DenseStore | QuantizedStore, rows: slice | None = None):
        rows = slice(None) if rows is None else rows
        super().__init__(layers=[StoreLayer(store, i, rows) for i in range(len(store.layout.kept))])
        self.store = store
