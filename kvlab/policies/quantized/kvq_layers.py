"""kvlab's own quantized KV storage (:mod:`kvlab.kernels` formats) as transformers cache layers.

On the ``hf`` engine this is the explicit **dequantize-then-attend** path: :class:`KVQLayer` keeps
each layer's K and V as :class:`kvlab.kernels.KVStore` s (codes plus scales, nothing else), quantizes
every token it is given (the prefill's and each appended one; the formats quantize per token, so
appending is concatenating the stores' tensors along the token dim), and returns the whole store
dequantized to the model dtype for attention. The prefill's own attention reads the exact K/V, as
transformers' quantized layers and kvlab's fast engine do (its prefill runs unquantized).

On the ``fast`` engine the same formats are stored in static buffers and read by the fused kernels
(:mod:`kvlab.engine.kvstore`); both engines dequantize the same codes.

Format semantics, the same on both engines (issue #28, reports/cpu-quality-engines-2026-12-05): the
prompt is quantized after its own prefill attention (exact K/V); every later token (a question, a
gold answer, a reply) is quantized before it attends, itself included; no token is kept unquantized
(no residual window). Keys are stored minus the layer's key offset (:mod:`kvlab.kernels.key_offset`:
``prompt-mean`` fits it on the first keys stored, ``none`` stores keys as they are); dequantized keys
stay shifted, which attention does not see (``q . m`` is the same for every key). Codes, scales (int: float16 scale and zero per group, the zero rounded down
and the scale up; fp8: a float32 scale per token) and rounding (``floor(v + 0.5)``) are the format
object's (``fast``'s CUDA write kernel repeats its steps); on CPU the prompt's stored bits are equal
on both engines. Only attention's arithmetic differs: here the codes are dequantized in float32,
rounded to the model dtype and attended by transformers' SDPA in that dtype; ``fast`` attends in
float32 on CPU (the reference) and with float16 operands and float32 accumulation on CUDA, never
rounding a dequantized value. On SmolLM2's own q/K/V in bf16 each path's attention error against
float64 over the same codes is a small share of the format's own error (this path 1.7% for int4-g64
and 6.6% for fp8, medians over layers; the bf16 rounding of the output alone 0.8% / 3.4%; the Triton
kernels under the interpreter, first three layers, 1.8% / 12%). Those rounding differences still
move codes of the tokens stored after the prompt across rounding boundaries, and the moves grow
layer by layer, as between any two implementations (hf fed in one forward or token by token alike):
compare the engines' quality over many items (``benchmarks/quality_engines.py``), not item by item.

:class:`EvictingKVQLayer` evicts at prefill (:class:`kvlab.policies.cache.EvictionMixin`) and
quantizes the kept K/V.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from kvlab.kernels import KVStore, parse_format
from kvlab.kernels.key_offset import KEY_OFFSETS, shifted
from kvlab.policies.cache import EvictionError, EvictionMixin, StoredLengthMixin


def _cat(a: KVStore | None, b: KVStore) -> KVStore:
    if a is None:
        return b
    parts = [torch.cat([x, y], dim=2) if x is not None else None
             for x, y in ((a.codes, b.codes), (a.scale, b.scale), (a.zero, b.zero))]
    return KVStore(a.format, *parts, a.head_dim)


def _map(store: KVStore | None, fn) -> KVStore | None:
    if store is None:
        return None
    return KVStore(store.format, *(fn(t) if t is not None else None for t in (store.codes, store.scale, store.zero)),
                   store.head_dim)


class KVQLayer(StoredLengthMixin, DynamicLayer):
    """K/V kept as kvlab ``KVStore`` s in ``kv_format`` (``fp8``, ``int4-g64``, ...); attention gets
    them dequantized to the model dtype. ``keys``/``values`` stay empty tensors: the stores are all
    the layer holds (``key_store``/``value_store``, counted by ``policies.cache_stats``)."""

    is_croppable = True

    def __init__(self, kv_format: str = "int4-g64", key_offset: str = "none", **kwargs):
        super().__init__()
        self.kv_format = kv_format
        self.fmt = parse_format(kv_format)
        self.offset_rule = KEY_OFFSETS[key_offset]
        self.key_store: KVStore | None = None
        self.value_store: KVStore | None = None
        self.key_offset: torch.Tensor | None = None  # [B, Hkv, D] float32, fitted on the first keys stored
        self.dtype: torch.dtype | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype

    # -- storage -------------------------------------------------------------------------------
    def _add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize ``[B, Hkv, n, D]`` K/V (keys minus the key offset) and append them to the stores."""
        if self.key_store is None:
            self.key_offset = self.offset_rule.fit(keys)
        self.key_store = _cat(self.key_store, self.fmt.quantize(shifted(keys, self.key_offset)))
        self.value_store = _cat(self.value_store, self.fmt.quantize(values))

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.key_store.dequantize().to(self.dtype), self.value_store.dequantize().to(self.dtype))

    @property
    def stored_tokens(self) -> int:
        return 0 if self.key_store is None else self.key_store.capacity

    # -- transformers layer API ------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        self._add(key_states, value_states)
        if first:  # the prefill attends exactly; the stored codes serve every later step
            return key_states, value_states
        return self._dequantized()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative number of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove == 0 or self.key_store is None:
            return
        keep = max(0, self.stored_tokens + tokens_to_remove)
        self.key_store = _map(self.key_store, lambda t: t[:, :, :keep])
        self.value_store = _map(self.value_store, lambda t: t[:, :, :keep])

    def reset(self) -> None:
        super().reset()
        self.key_store = self.value_store = self.key_offset = None

    def _map_batch(self, fn) -> None:
        self.key_store = _map(self.key_store, fn)
        self.value_store = _map(self.value_store, fn)
        if self.key_offset is not None:
            self.key_offset = fn(self.key_offset)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.key_store is not None:
            idx = beam_idx.to(self.key_store.device)
            self._map_batch(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices])

    def offload(self) -> None:
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.key_store is not None and self.key_store.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))


class EvictingKVQLayer(EvictionMixin, KVQLayer):
    """Evict at prefill (``policy.budget(n)`` positions per KV head), store the kept K/V in
    ``kv_format``; later tokens are quantized and appended as in :class:`KVQLayer`."""

    def __init__(self, policy, layer_idx: int, num_layers: int, kv_format: str = "int4-g64",
                 key_offset: str = "none"):
        KVQLayer.__init__(self, kv_format, key_offset)
        self._init_eviction(policy, layer_idx, num_layers)

    def _store(self, keys, values) -> None:
        self.dtype = keys.dtype
        self.key_store = self.value_store = self.key_offset = None
        self._add(keys, values)

    def _append(self, keys, values, *args, **kwargs):
        self._add(keys, values)
        return self._dequantized()

    def crop(self, tokens_to_remove: int) -> None:
        appended = self.logical_length - (self.prompt_length or 0)
        if tokens_to_remove > 0 or -tokens_to_remove > appended:
            raise EvictionError(f"an evicting cache can only crop tokens added after its prefill "
                                f"(at most {appended}, passed as a negative number); got {tokens_to_remove}")
        KVQLayer.crop(self, tokens_to_remove)
        self.logical_length += tokens_to_remove
        self.physical_length += tokens_to_remove
