"""A transformers cache whose layers write the prefill's K/V straight into the fast engine's static
store (``fast`` would otherwise hold the whole prefill cache beside the store, one extra cache at peak).

    cache = StoreCache(store, rows)        # rows: the batch rows this prefill fills (None: all)
    generation.prefill(model, ids, cache)  # every layer's K/V lands in the store's slots 0..n
    # nothing to load: the store holds the prompt; cache.get_seq_length() is the prompt length

Only for storages that keep every prompt token in a store that takes the writes (dense, kvq, with
no prefill policy): an evicting policy needs the whole prompt's K/V before it selects, so it still
prefills into its own cache and :func:`kvlab.storage.loading.load_prefilled` copies what it kept.

What each layer's attention sees, as on ``hf`` (the store's ``write_prefill``):
- a dense store (model dtype): the store's slots ``[0, end)`` (views; nothing copied);
- a quantized store: the first forward (one-shot prefill or first chunk) attends its exact K/V, as
  :class:`~kvlab.storage.kvq.KVQLayer` does; later chunks attend the stored codes
  dequantized (a transient of one layer), as ``KVQLayer`` does.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.storage.base import StoredLengthMixin
from kvlab.storage.slots import row_slice


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
        return self.store.write_prefill(self.layer, rows, start, key_states, value_states)

    def nbytes(self) -> int:
        return 0  # the store's bytes are the decoder's stats


class StoreCache(Cache):
    """The prefill cache of a fast decoder whose storage takes the prompt whole: one :class:`StoreLayer`
    per layer of ``store`` (a store with ``write_prefill``)."""

    def __init__(self, store, rows: slice | None = None):
        rows = slice(None) if rows is None else rows
        super().__init__(layers=[StoreLayer(store, i, rows) for i in range(len(store.layout.kept))])
        self.store = store

