"""Evicting cache layers and cache statistics (transformers cache internals: see :mod:`kvlab.policies`).

An evicting layer behaves like a ``DynamicLayer`` except for its first ``update`` (the prefill):
it returns the full prompt K/V, so the prefill attention is exact, and keeps only
``policy.budget(n)`` positions per KV head. Like transformers' ``DynamicSlidingWindowLayer`` it
counts tokens logically: ``get_seq_length()`` is every token seen (so model-made position ids and
``generate()``'s input slicing stay right) while ``get_mask_sizes`` describes the physical tensors
(``(physical + q, logical - physical)``), which keeps causal masks right after eviction.

Methods that need attention scores (SnapKV, PyramidKV, TOVA) wait for the prefill queries, handed
over by :mod:`kvlab.policies.attention` right after the layer's attention call.

Chunked prefill (:mod:`kvlab.policies.chunking`): between ``begin_stream(n)`` and ``end_stream()``
every update is a chunk of one ``n``-token prompt; the layer keeps a running budget of
``policy.budget(n)`` rows (kept rows + the new chunk are rescored whenever they exceed it) and holds
them unquantized until the prompt ends, then stores them (quantizing, for evict-then-quantize).

Evict-then-quantize: the same mixin over a transformers quantized layer stores the kept K/V by
quantizing them into ``_quantized_keys``/``_quantized_values`` with an empty residual and sets
``cumulative_length`` to the logical count. The attribute names and the residual/flush logic
are the same in transformers 5.17 (``QuantizedLayer(DynamicLayer)``, residual flushed at
``residual_length - 1`` tokens) and 5.21+ (``BaseQuantizedLayer``; flush at ``residual + new >=
residual_length``); later decode steps run the stock quantized ``update``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from kvlab.kernels.formats import KVStore
from kvlab.policies import attention
from kvlab.policies.base import PolicyError


class EvictionError(PolicyError):
    """The cache was driven in a way eviction cannot honour (e.g. scores never arrived)."""


class LogicalLengthMixin:
    """A cache layer that holds fewer rows (``physical_length``) than the tokens it has seen
    (``logical_length``): the sequence length and the attention mask follow the logical count, the
    mask's key length the physical one (transformers 5.x ``get_mask_sizes``)."""

    logical_length: int
    physical_length: int

    def get_seq_length(self) -> int:
        return self.logical_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.physical_length + query_length, self.logical_length - self.physical_length

    def get_max_length(self) -> int:
        return -1


class StoredLengthMixin:
    """A cache layer that holds every token it has seen, but not in ``DynamicLayer``'s ``keys``
    (codes, the fast engine's store): the sequence length and the mask follow ``stored_tokens``
    (spelled out: ``DynamicLayer``'s ``get_mask_sizes`` varies by release)."""

    stored_tokens: int

    def get_seq_length(self) -> int:
        return self.stored_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1


class EvictionMixin(LogicalLengthMixin):
    """Prefill eviction with logical/physical bookkeeping, over a DynamicLayer or a quantized layer."""

    def _init_eviction(self, policy, layer_idx: int, num_layers: int) -> None:
        self.policy = policy
        self.layer_idx = layer_idx
        self.num_layers = num_layers
        self._clear_eviction()

    def _clear_eviction(self) -> None:
        self.logical_length = 0
        self.physical_length = 0
        self.prompt_length: int | None = None
        self._kept: torch.Tensor | None = None  # int32 [B, Hkv, n_kept]; None = all prompt positions
        self._awaiting: tuple | None = None
        self._stream_length: int | None = None  # while a prompt streams in: its full length
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # kept K/V while streaming

    # -- chunked prefill (kvlab.policies.chunking) ----------------------------------------------
    def begin_stream(self, prompt_length: int) -> None:
        """The next updates are chunks of one ``prompt_length``-token prompt (budget: its full length)."""
        if self.prompt_length is not None:
            raise EvictionError("a chunked prefill must start on a fresh cache (this layer already holds a prompt)")
        self._stream_length = prompt_length

    def end_stream(self) -> None:
        """The prompt is in: store the kept rows the way this layer stores K/V."""
        if self._awaiting is not None:
            raise EvictionError(f"layer {self.layer_idx}: the prompt ended while a chunk still waited for its "
                                f"queries: call policy.prepare(model) before the first forward")
        self._stream_length = None
        if self._staged is not None:
            keys, values = self._staged
            self._staged = None
            self._store(keys, values)

    @property
    def _streaming(self) -> bool:
        return self._stream_length is not None and self.logical_length < self._stream_length

    # -- inspection ---------------------------------------------------------------------------
    @property
    def kept_positions(self) -> torch.Tensor | None:
        """Original prompt positions kept per KV head, ``[B, Hkv, n_kept]`` ascending; None before prefill."""
        if self.prompt_length is None or self._awaiting is not None:
            return None
        if self._kept is None:
            b, h = self._batch_heads
            return torch.arange(self.prompt_length, device=self.device).expand(b, h, -1)
        return self._kept.long()

    # -- transformers layer API ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._awaiting is not None:
            self._awaiting = None
            attention.cancel_queries(self.layer_idx)
            raise EvictionError(
                f"{self.policy.name} needs the prefill queries of layer {self.layer_idx}, but the attention "
                f"function never handed them over: call policy.prepare(model) before the first forward"
            )
        if self.prompt_length is None or self._streaming:
            return self._prefill(key_states, value_states)
        n_new = key_states.shape[-2]
        out = self._append(key_states, value_states, *args, **kwargs)
        self.logical_length += n_new
        self.physical_length += n_new
        return out

    def reset(self) -> None:
        if self._awaiting is not None:
            attention.cancel_queries(self.layer_idx)
        super().reset()
        self._clear_eviction()

    def _map_rows(self, fn) -> None:
        """``fn`` over each per-batch-row tensor kept beside the K/V (a mixin in front adds its own), so
        that it follows transformers' batch operations below."""
        if self._kept is not None:
            self._kept = fn(self._kept)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._map_rows(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._map_rows(lambda t: t[indices])

    # -- eviction ---------------------------------------------------------------------------------
    def _prefill(self, new_keys: torch.Tensor, new_values: torch.Tensor):
        """A whole prompt (one shot) or its next chunk: append, then evict to the budget if over it.

        Returns the K/V the chunk attends to (kept rows + the chunk), so its attention is exact."""
        if not self.is_initialized:
            DynamicLayer.lazy_initialization(self, new_keys, new_values)
        start, c = self.logical_length, new_keys.shape[-2]
        total = self._stream_length or c
        keys, values, positions = new_keys, new_values, None  # None: rows are positions 0..n-1
        if self._staged is not None:
            keys = torch.cat([self._staged[0], new_keys], dim=-2)
            values = torch.cat([self._staged[1], new_values], dim=-2)
            self._staged = None
            if self._kept is not None:
                new_pos = torch.arange(start, start + c, device=self._kept.device, dtype=self._kept.dtype)
                positions = torch.cat([self._kept, new_pos.expand(*self._kept.shape[:2], c)], dim=-1)
        self._batch_heads = tuple(keys.shape[:2])
        self.prompt_length = self.logical_length = start + c
        rows = keys.shape[-2]
        n_kept = min(rows, self.policy.budget(total, self.layer_idx, self.num_layers))
        if n_kept >= rows:
            self._keep(keys, values, positions)
        elif self.policy.needs_attention:
            self._awaiting = (keys, values, n_kept, positions)
            attention.expect_queries(self.layer_idx, self)
        else:
            self._evict(keys, values, n_kept, None, positions)
        return keys, values

    def awaits(self, key: torch.Tensor) -> bool:
        """Whether ``key`` is the prompt key tensor this layer returned and waits to score."""
        return self._awaiting is not None and self._awaiting[0] is key

    def receive_queries(self, query: torch.Tensor, attention_mask, scaling) -> None:
        """Called by kvlab's attention function right after this layer's prefill attention."""
        keys, values, n_kept, positions = self._awaiting
        self._awaiting = None
        window = self.policy.query_window(keys.shape[-2])
        probs = attention.window_attention(query, keys, scaling, window, attention_mask)
        self._evict(keys, values, n_kept, probs, positions)

    def _evict(self, keys, values, n_kept: int, attn: torch.Tensor | None, positions=None) -> None:
        idx = self.policy.select(keys, values, attn, n_kept, self.layer_idx, self.num_layers)
        gather = idx.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        kept = idx.to(torch.int32) if positions is None else positions.gather(-1, idx.to(positions.device))
        self._keep(keys.gather(2, gather), values.gather(2, gather), kept)

    def _keep(self, keys, values, positions: torch.Tensor | None) -> None:
        """Hold these rows: staged unquantized while a prompt streams in, else stored."""
        self._kept = positions
        self.physical_length = keys.shape[-2]
        if self._stream_length is not None and self.logical_length < self._stream_length:
            self._staged = (keys, values)
        else:
            self._store(keys, values)

    def _store(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _append(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        raise NotImplementedError


class EvictingLayer(EvictionMixin, DynamicLayer):
    """A DynamicLayer that keeps ``policy.budget(n)`` prompt positions per KV head after prefill."""

    def __init__(self, policy, layer_idx: int, num_layers: int):
        super().__init__()
        self._init_eviction(policy, layer_idx, num_layers)

    def _store(self, keys, values) -> None:
        self.keys, self.values = keys, values

    def _append(self, keys, values, *args, **kwargs):
        return DynamicLayer.update(self, keys, values)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove trailing tokens appended after the prefill (e.g. an answer, to ask another question)."""
        appended = self.logical_length - (self.prompt_length or 0)
        if tokens_to_remove > 0 or -tokens_to_remove > appended:
            raise EvictionError(f"an evicting cache can only crop tokens added after its prefill "
                                f"(at most {appended}, passed as a negative number); got {tokens_to_remove}")
        super().crop(tokens_to_remove)
        self.logical_length += tokens_to_remove
        self.physical_length += tokens_to_remove


class _EvictingQuantized(EvictionMixin):
    """Mixed in front of a transformers quantized layer class (see :func:`evicting_quantized_class`)."""

    def __init__(self, policy, layer_idx: int, num_layers: int, **quant_kwargs):
        super().__init__(**quant_kwargs)
        self._init_eviction(policy, layer_idx, num_layers)

    def _store(self, keys, values) -> None:
        fp8 = not hasattr(self, "residual_length")
        if fp8:
            self._quantized_keys = self._quantize(keys.contiguous())
            self._quantized_values = self._quantize(values.contiguous())
        else:
            self._quantized_keys = self._quantize(keys.contiguous(), axis=self.axis_key)
            self._quantized_values = self._quantize(values.contiguous(), axis=self.axis_value)
        self.cumulative_length = self.logical_length  # the base update keeps counting from here

    def _append(self, keys, values, *args, **kwargs):
        # The stock quantized update: dequantize, concatenate, flush the residual when full.
        return super(EvictionMixin, self).update(keys, values, *args, **kwargs)

    def crop(self, tokens_to_remove: int) -> None:
        raise EvictionError("a quantized cache cannot be cropped: build a fresh cache for each question")


@cache
def evicting_quantized_class(base: type) -> type:
    """``Evicting<Base>``: eviction at prefill, then the stock quantized layer behaviour."""
    return type(f"Evicting{base.__name__}", (_EvictingQuantized, base), {})


class EvictionCache(Cache):
    """A ``Cache`` of evicting layers, one per decoder layer; ``policy`` is the policy that made it."""

    def __init__(self, layers: list[CacheLayerMixin], policy):
        super().__init__(layers=layers)
        self.policy = policy

    def kept_positions(self) -> list[torch.Tensor | None]:
        return [layer.kept_positions for layer in self.layers]


def kept_positions(cache) -> list[torch.Tensor | None]:
    """Per layer, the original prompt positions kept per KV head (``[B, Hkv, n_kept]``), or None
    for layers that do not evict."""
    return [getattr(layer, "kept_positions", None) for layer in cache.layers]


def layer_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the stored K/V ``[B, Hkv, n_l, D]`` of an unquantized cache (dynamic or evicting):
    what the fast engine copies into its static buffers after the prefill."""
    out = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if (not isinstance(keys, torch.Tensor) or keys.dim() != 4 or hasattr(layer, "_quantized_keys")
                or hasattr(layer, "key_store")):
            raise EvictionError(f"layer {i} ({type(layer).__name__}) holds no plain K/V tensors to copy")
        out.append((keys, values))
    return out


# -- statistics -----------------------------------------------------------------------------------
def tensor_bytes(obj: Any, _seen: set | None = None) -> int:
    """Bytes held by tensors inside ``obj`` (tensors, quanto tensor subclasses, HQQ (W, meta), tuples,
    kvlab ``KVStore`` s)."""
    seen = set() if _seen is None else _seen
    if isinstance(obj, KVStore):  # kvlab formats: codes, scales, zeros
        return sum(tensor_bytes(t, seen) for t in obj.tensors())
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name), seen) for name in names)
        key = (obj.data_ptr(), obj.numel(), obj.dtype)
        if obj.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    return 0


def _physical_tokens(layer) -> int:
    if isinstance(layer, EvictionMixin):
        return layer.physical_length
    if hasattr(layer, "_quantized_keys"):  # quantized: all tokens are stored (packed or residual)
        return layer.get_seq_length()
    if hasattr(layer, "key_store") or hasattr(layer, "codes"):  # kvlab formats (kvq_layers, kivi_layer)
        return layer.stored_tokens
    keys = getattr(layer, "keys", None)
    return keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0


def _layer_bytes(layer) -> int:
    if callable(getattr(layer, "nbytes", None)):  # a layer that counts its own storage (KIVI, Quest's bounds)
        return layer.nbytes()
    seen: set = set()
    return sum(tensor_bytes(getattr(layer, name, None), seen)
               for name in ("keys", "values", "_quantized_keys", "_quantized_values", "key_store", "value_store",
                            "key_offset"))


def cache_stats(cache) -> dict[str, Any]:
    """Logical tokens (seen, per sequence), physical tokens (stored per sequence and KV head,
    averaged over layers) and bytes (all K/V storage incl. quantization scales) of a cache."""
    layers = [layer for layer in cache.layers if isinstance(layer, CacheLayerMixin)]
    per_layer = [_physical_tokens(layer) for layer in layers]
    mean = sum(per_layer) / len(per_layer) if per_layer else 0
    return {
        "logical_tokens": int(cache.get_seq_length()),
        "physical_tokens": int(mean) if mean == int(mean) else round(mean, 2),
        "bytes": int(sum(_layer_bytes(layer) for layer in layers)),
        "physical_tokens_per_layer": per_layer,
    }


@contextmanager
def profiler_scopes(cache, update: str, quantize: str, dequantize: str) -> Iterator[None]:
    """Profiler scopes named ``update`` around ``cache.update`` and ``quantize``/``dequantize``
    around its layers' (de)quantization, for as long as the context lasts.

    The hook :mod:`kvlab.anatomy` uses to classify ops without knowing transformers' cache classes:
    the methods are shadowed by instance attributes (layers created lazily on the first update
    included) and the instance attributes are deleted on exit, so the cache is as it was.
    """
    from torch.profiler import record_function

    undo: list = []

    def scoped(fn, name):
        def wrapper(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)

        wrapper.__kvlab_scoped__ = True
        return wrapper

    def wrap_layers():
        for layer in getattr(cache, "layers", None) or []:
            for attr, name in (("_quantize", quantize), ("_dequantize", dequantize)):
                fn = getattr(layer, attr, None)
                if fn is not None and not getattr(fn, "__kvlab_scoped__", False):
                    setattr(layer, attr, scoped(fn, name))
                    undo.append((layer, attr))

    original_update = cache.update

    def scoped_update(*args, **kwargs):
        wrap_layers()
        with record_function(update):
            return original_update(*args, **kwargs)

    cache.update = scoped_update
    wrap_layers()
    try:
        yield
    finally:
        for obj, attr in reversed(undo):
            delattr(obj, attr)  # the instance attribute shadowed the class method
        del cache.update
