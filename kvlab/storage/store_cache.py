"""A transformers cache whose layers write the prefill's K/V straight into the fast engine's static
store (no second copy of the prompt's K/V beside the store at the peak), and the loading of a
prefilled cache into a store that every family with one length per layer shares.

    cache = StoreCache(store, rows)        # rows: the batch rows this prefill fills (None: all)
    generation.prefill(model, ids, cache)  # every layer's K/V lands in the store's slots 0..n
    load_prefilled(store, cache, rows)     # nothing to copy: only the lengths are checked

Only for storages that take the prompt whole into a store that can take its writes (dense, kvq):
an evicting policy needs the whole prompt's K/V before it selects, so it prefills into its own
cache and :func:`load_prefilled` copies what it kept. What each layer's attention sees is the
store's ``write_prefill``: a dense store's slots ``[0, end)`` (views); a quantized store's exact K/V
on the first forward, the stored codes dequantized on later chunks (as ``hf``'s layer does).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.storage.base import StoredLengthMixin, hf_model, layer_tensors
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


def load_prefilled(store, cache, rows: slice | None = None) -> None:
    """A prefilled cache's K/V into ``store``: a :class:`StoreCache` of this store already wrote them
    (its lengths are checked), any other cache's plain K/V are copied (:func:`layer_tensors`)."""
    if isinstance(cache, StoreCache):
        if cache.store is not store:
            raise ValueError("this StoreCache writes into another decoder's store")
        got = [layer.get_seq_length() for layer in cache.layers]
        if got != list(store.layout.kept):
            raise ValueError(f"the prefill wrote {got[0]} tokens per layer, the store was sized for "
                             f"{store.layout.kept[0]}")
        store.step.zero_()
    else:
        store.load(layer_tensors(cache), rows)


def kept_tokens(cache) -> tuple[int, tuple[int, ...]]:
    """(batch, stored tokens per layer) of a prefilled cache of plain K/V."""
    kv = layer_tensors(cache)
    return kv[0][0].shape[0], tuple(k.shape[-2] for k, _ in kv)


def dense_prefill_cache(model):
    """A plain transformers cache for the prefill of a store that loads the prompt's K/V from it."""
    from transformers import DynamicCache

    return DynamicCache(config=hf_model(model).config)
