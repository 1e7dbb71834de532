"""What the storages with one length per layer share: loading a prefilled cache into their store,
sizing a store from it, and the defaults of the :class:`~kvlab.storage.base.Storage` protocol."""

from __future__ import annotations

from kvlab.errors import EngineError
from kvlab.storage.base import hf_model, layer_tensors, paged_layout
from kvlab.storage.paged import PoolDefaults
from kvlab.storage.store_cache import StoreCache


def load_prefilled(store, cache, rows: slice | None = None) -> None:
    """A prefilled cache's K/V into ``store``: a :class:`StoreCache` of this store already wrote them
    (its lengths are checked), any other cache's plain K/V are copied (:func:`layer_tensors`)."""
    if isinstance(cache, StoreCache):
        if cache.store is not store:
            raise EngineError("this StoreCache writes into another decoder's store")
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


class PromptStorage(PoolDefaults):
    """Defaults of a storage whose layers each hold one length (every family but ragged): its paged
    layout from its ``token_bytes``; the prefill fills the prefill policy's cache (an evicting
    policy's) or a plain one, and the store copies the kept K/V from it; no serving pool unless the
    family defines ``paged_pool``."""

    prefill = None
    keys_per_token = False  # each token's keys coded over one range with no key offset (the outlier-key preflight warns)

    def paged(self, kv_heads: int, head_dim: int, block_tokens: int = 16, element_size: int = 2):
        return paged_layout(self.token_bytes(kv_heads, head_dim, element_size), block_tokens)

    def prefill_cache(self, store, rows: slice | None, model):
        return dense_prefill_cache(model) if self.prefill is None else self.prefill.make_cache(model)

    def load(self, store, cache, rows: slice | None = None) -> None:
        load_prefilled(store, cache, rows)

    def kept(self, cache) -> tuple[int, tuple[int, ...]]:
        return kept_tokens(cache)
