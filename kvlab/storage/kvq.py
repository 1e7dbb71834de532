"""The kvq family: kvlab's own quantized formats (:mod:`kvlab.kernels`: fp8, int4, int2, bf16), for both engines.

On the ``hf`` engine this is the explicit **dequantize-then-attend** path: :class:`KVQLayer` keeps
each layer's K and V as :class:`kvlab.kernels.KVStore` s (codes plus scales, nothing else), quantizes
every token it is given (the prefill's and each appended one; the formats quantize per token, so
appending is concatenating the stores' tensors along the token dim), and returns the whole store
dequantized to the model dtype for attention. The prefill's own attention reads the exact K/V, as
transformers' quantized layers and kvlab's fast engine do (its prefill runs unquantized).

On the ``fast`` engine the same formats are stored in static buffers (:class:`QuantizedStore`) and
read by the fused kernels; both engines dequantize the same codes.

Format semantics, the same on both engines: the
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

An evicting policy puts its eviction in front of :class:`KVQLayer` (:mod:`kvlab.policies.quantized.storage`)
and stores the kept K/V in the format.

Serving: :class:`KVQPool`, the format's codes and scales per pool slot, a key offset per request; a
step's decode tokens read through their block tables by the fused paged kernel
(:func:`kvlab.kernels.paged.paged_kvq_decode`: codes dequantized in registers) with the engine's
``attention="triton"`` (the default on CUDA), else the torch reference (:meth:`KVQPool.attend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.errors import PolicyError
from kvlab.kernels import KVStore, decode_attention, make_workspace, parse_format, quantize_write
from kvlab.kernels.formats import FormatError
from kvlab.kernels.key_offset import KEY_OFFSETS, shifted
from kvlab.kernels.paged import paged_kvq_decode, paged_kvq_problem, picked
from kvlab.storage.base import ModelShape, StoredLengthMixin, StoreOptions, tensor_bytes
from kvlab.storage.loading import PromptStorage
from kvlab.storage.paged import PagedPool, PoolShape
from kvlab.storage.slots import Layout, SlotStore, StepSlots, sdpa_decode
from kvlab.storage.store_cache import StoreCache


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

    def nbytes(self) -> int:
        return tensor_bytes((self.key_store, self.value_store, self.key_offset))

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


QUANT_ATTENTION = ("auto", "fused", "dequantize")


class QuantizedStore(SlotStore):
    """Per-layer K/V in a :mod:`kvlab.kernels` format (``[B, Hkv, C_l, ...]`` codes and scales).

    The new token is quantized on write (one Triton launch per tensor on CUDA), before it attends,
    as ``hf``'s :class:`KVQLayer` does. Attention is ``fused``
    (the split-K Triton kernel reads the codes: float16 operands, float32 accumulation and softmax;
    the float32 reference on CPU) or ``dequantize``: the whole store converted to the model dtype,
    then masked SDPA, i.e. what an implementation without a fused kernel does (``hf``'s arithmetic),
    kept as the explicit baseline.

    With a ``key_offset`` that subtracts (:mod:`kvlab.kernels.key_offset`) the keys are written minus
    a per-layer ``[B, Hkv, D]`` float32 offset (``key_offsets``), fitted on each row's prompt keys
    when they are loaded or prefilled and subtracted inside the write kernel for every later token;
    attention reads the codes as they are (the offset shifts every score of a query by the same amount).
    """

    def __init__(self, layout: Layout, kv_format: str, num_heads: int, dtype, device, scale: float,
                 attention: str = "auto", key_offset: str = "none"):
        if attention not in QUANT_ATTENTION:
            raise ValueError(f"attention={attention!r} for a quantized store: use one of {', '.join(QUANT_ATTENTION)}")
        self.fmt = parse_format(kv_format)
        self.offset_rule = KEY_OFFSETS[key_offset]
        self.kv_format = offset_label(self.fmt.label, key_offset)
        self.attention = "fused" if attention == "auto" else attention
        self.layout, self.scale, self.dtype = layout, scale, dtype
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.keys = [self.fmt.alloc(b, h, c, d, device) for c in layout.capacity]
        self.values = [self.fmt.alloc(b, h, c, d, device) for c in layout.capacity]
        self.key_offsets = [torch.zeros(b, h, d, dtype=torch.float32, device=device)
                            if self.offset_rule.subtracts else None for _ in layout.capacity]
        cuda = torch.device(device).type == "cuda"
        self.workspaces = [make_workspace(num_heads, k) if cuda else None for k in self.keys]
        self.slots = StepSlots(layout.kept, layout.batch, device)

    def _offset_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.key_offsets if t is not None)

    def bytes_allocated(self) -> int:
        return sum(s.nbytes() for s in self.keys + self.values) + self._offset_bytes()

    def buffers(self) -> list[torch.Tensor]:
        offsets = [t for t in self.key_offsets if t is not None]
        return [t for s in self.keys + self.values for t in s.tensors()] + offsets + list(self.slots.tensors())

    def bytes_per_slot(self) -> int:
        return 2 * self.fmt.bytes_per_token(self.layout.kv_heads, self.layout.head_dim)

    def held_bytes(self, held: list[int]) -> int:
        """The slots' bytes plus the key offsets' (``head_dim`` float32 per row, KV head and layer)."""
        return super().held_bytes(held) + self._offset_bytes()

    def key_offset(self, layer: int, rows: slice = slice(None)) -> torch.Tensor | None:
        """Layer ``layer``'s key offset of batch rows ``rows`` (a view), None without one."""
        offset = self.key_offsets[layer]
        return None if offset is None else offset[rows]

    def fit_key_offset(self, layer: int, rows: slice, keys: torch.Tensor) -> torch.Tensor | None:
        """Fit rows ``rows``' key offset of layer ``layer`` on their prompt ``keys`` (``[b, Hkv, n, D]``)."""
        offset = self.key_offset(layer, rows)
        if offset is not None:
            offset.copy_(self.offset_rule.fit(keys))
        return offset

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = torch.arange(k.shape[-2], device=k.device)
        offset = self.fit_key_offset(layer, rows, k)
        quantize_write(self.keys[layer].rows(rows), k.contiguous(), slots, offset=offset)
        quantize_write(self.values[layer].rows(rows), v.contiguous(), slots)

    def write_prefill(self, layer: int, rows: slice, start: int, k: torch.Tensor, v: torch.Tensor):
        """A prefill chunk's K/V quantized into slots ``start..`` of batch rows ``rows`` (:class:`StoreCache`);
        the first chunk fixes the rows' key offset. What its attention reads: the exact K/V on the first
        chunk, the stored codes dequantized after (keys minus the offset, which attention does not see)."""
        end = start + k.shape[-2]
        slots = torch.arange(start, end, device=k.device)
        kstore, vstore = self.keys[layer].rows(rows), self.values[layer].rows(rows)
        offset = self.fit_key_offset(layer, rows, k) if start == 0 else self.key_offset(layer, rows)
        quantize_write(kstore, k.contiguous(), slots, offset=offset)
        quantize_write(vstore, v.contiguous(), slots)
        if start == 0:  # the prefill attends exactly
            return k, v
        return kstore.dequantize(end).to(k.dtype), vstore.dequantize(end).to(v.dtype)

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        slot = self.slots.slot(layer)
        quantize_write(self.keys[layer], k, slot, offset=self.key_offsets[layer])
        quantize_write(self.values[layer], v, slot)
        bsz, n_heads, _, dim = q.shape
        if self.attention == "fused":
            out = decode_attention(q.reshape(bsz, n_heads, dim).contiguous(), self.keys[layer], self.values[layer],
                                   self.slots.used(layer), self.scale, workspace=self.workspaces[layer])
            return out.to(q.dtype)
        keys = self.keys[layer].dequantize().to(self.dtype)
        values = self.values[layer].dequantize().to(self.dtype)
        return sdpa_decode(q, keys, values, slot + 1, self.scale)


class KVQPool(PagedPool):
    """K and V per layer in a ``kvlab.kernels`` format: one ``KVStore`` of batch 1 whose token axis
    is the pool's slots; each token is quantized on its own (its scales are per token), so a request
    attends over exactly the bits its blocks store, dequantized on read.

    With a key offset (:mod:`kvlab.kernels.key_offset`) the pool fits each request's per-channel
    offset ``[Hkv, D]`` on its first chunk's keys and stores every later key of the request minus
    it; reads return the shifted keys, which attention does not see (``q . m`` is the same for every
    key of a request). ``paged_kernel``: the format's decode kernels read this head dim (the paged
    kernel takes what the contiguous ones take)."""

    def __init__(self, fmt, shape: PoolShape, dtype: torch.dtype, device, key_offset: str = "none"):
        self.fmt, self.dtype, self.head_dim, self.block_size = fmt, dtype, shape.head_dim, shape.block_size
        self.offset_rule = KEY_OFFSETS[key_offset]
        self.key_offsets: list[dict[int, torch.Tensor | None]] = [{} for _ in range(shape.num_layers)]  # per owner
        self.k = [fmt.empty(1, shape.kv_heads, shape.slots, shape.head_dim, device) for _ in range(shape.num_layers)]
        self.v = [fmt.empty(1, shape.kv_heads, shape.slots, shape.head_dim, device) for _ in range(shape.num_layers)]
        self.paged_kernel = paged_kvq_problem(self.k[0]) is None

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        keys = k.transpose(0, 1).unsqueeze(0).float()  # [1, Hkv, n, D]
        if first:
            self.key_offsets[layer][owner] = self.offset_rule.fit(keys)
        keys = shifted(keys, self.key_offsets[layer].get(owner))
        for store, x in ((self.k[layer], keys), (self.v[layer], v.transpose(0, 1).unsqueeze(0).float())):
            codes = self.fmt.quantize(x)
            for dst, src in zip(store.tensors(), codes.tensors(), strict=True):
                dst[:, :, slots] = src

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = (picked(store, slots).dequantize()[0].to(self.dtype) for store in (self.k[layer], self.v[layer]))
        return keys, values

    def decode(self, layer: int, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
               scale: float) -> torch.Tensor:
        return paged_kvq_decode(q, self.k[layer], self.v[layer], tables, lengths, self.block_size, scale)


def offset_label(label: str, key_offset: str) -> str:
    """A kvq store's ``kv_format`` column: the format's label, with the key offset it subtracts."""
    return label if key_offset == "none" else f"{label}, keys - {key_offset}"


@dataclass(frozen=True)
class KVQStorage(PromptStorage):
    """K/V in the kvlab format ``kv_format`` (``fp8``, ``int4-g64``, ...). ``prefill``: the evicting
    policy whose cache the prefill fills (None: the prompt is quantized straight into the store)."""

    format: str = "int4-g64"
    prefill: Any = None
    key_offset: str = "none"

    @property
    def kv_format(self) -> str:
        return offset_label(parse_format(self.format).label, self.key_offset)

    def check(self, shape: ModelShape, cuda: bool) -> None:
        try:
            parse_format(self.format).check_head_dim(shape.head_dim)
        except FormatError as err:
            raise PolicyError(f"kvq {self.format} cannot store {shape.name}: {err}") from None

    def make_cache(self, num_layers: int):
        return Cache(layers=[KVQLayer(self.format, self.key_offset) for _ in range(num_layers)])

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        return 2 * parse_format(self.format).bytes_per_token(kv_heads, head_dim)

    def store(self, layout: Layout, options: StoreOptions):
        return QuantizedStore(layout, self.format, options.num_heads, options.dtype, options.device, options.scale,
                              options.quant_attention, self.key_offset)

    def prefill_cache(self, store, rows: slice | None, model):
        return StoreCache(store, rows) if self.prefill is None else self.prefill.make_cache(model)

    def paged_pool(self, shape: PoolShape, dtype: torch.dtype, device) -> KVQPool:
        return KVQPool(parse_format(self.format), shape, dtype, device, self.key_offset)


