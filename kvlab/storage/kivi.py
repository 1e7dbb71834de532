"""The kivi family: a KIVI-style 2/4-bit cache (:mod:`kvlab.kernels.kivi`): keys per channel over groups
of ``q_group_size`` tokens, values per token, the last ``residual_length`` tokens in bf16. Liu et al.
2024, github.com/jy-yuan/KIVI.

``hf``: :class:`KiviLayer` holds exactly what the fast engine's :class:`KiviSlotStore` (a
:class:`kvlab.kernels.kivi.KiviStore` per layer) holds at the same length:
the first ``quantized_tokens(n)`` tokens as codes (keys per channel over groups of G tokens, values
per token), the rest as bf16, flushed G at a time once R + G tokens are exact; the codes are
computed from the bf16 values, as the fast store's. Attention gets the whole cache dequantized to
the model dtype (the explicit dequantize-then-attend path, as :class:`kvlab.storage.kvq.KVQLayer`);
the prefill's own attention reads the exact K/V.

A multi-token chunk after the prefill (a question, a teacher-forced answer or continuation) is read
row by row as decoding its tokens one at a time would read them: the token at position ``p`` sees
the first ``quantized_tokens(p + 1)`` tokens as codes and the rest exact, up to itself
(:meth:`KiviLayer.attend`, handed the queries by kvlab's attention wrapper). Read as one block, every
row would see the state after the whole chunk (up to ``n`` more tokens quantized, its own recent
tokens among them, in groups whose ranges include tokens after it).

``fast``: :class:`KiviSlotStore`: the new token goes into the bf16 ring and a group is quantized when
it fills (``kivi_append``); attention is the fused split-K kernel on CUDA and the torch reference
elsewhere (``kivi_decode_attention``).

Serving: :class:`KiviPool`, a block is one key group (``block_size`` = ``q_group_size``): its keys'
per-channel scale and zero one per block, codes and value scales per slot, each request's tokens not yet
quantized (``R <= . < R + G``) in bf16 beside the pool (a fixed extra per sequence: the paged layout's
``sequence_bytes``). The boundary is :class:`~kvlab.kernels.kivi.KiviSpec`'s pure function of the
length, as in the static engines; reads follow :class:`KiviLayer`: a prompt row sees the tokens quantized
before its chunk dequantized and the rest exact (a prompt in one chunk: all exact, as the static
prefill), a decode row at position ``p`` the first ``quantized_tokens(p + 1)`` dequantized and the rest
exact; a re-fed run after a preemption is read row by row that way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.budget import BudgetError, check_positive
from kvlab.errors import PolicyError
from kvlab.kernels import kivi
from kvlab.kernels.kivi_decode import kernel_problem, kivi_append, kivi_decode_attention, make_kivi_workspace
from kvlab.kernels.paged import PagedKiviCodes, paged_kivi_decode
from kvlab.models import ModelSpec
from kvlab.storage import attention
from kvlab.storage.base import ModelShape, StoredLengthMixin, StoreOptions, check_int
from kvlab.storage.basis import ModelBasis
from kvlab.storage.loading import PromptStorage
from kvlab.storage.paged import PagedPool, PoolShape
from kvlab.storage.slots import Layout, SlotStore, StepSlots, uses_kernel

GROUPS = (16, 32, 64, 128)


def kivi_cache_bytes(spec: ModelSpec, ctx: int, batch: int = 1, bits: int = 2, key_bits: int | None = None,
                     group: int = 32, residual: int = 128, value_group: int = 32, new_tokens: int = 0) -> float:
    """A KIVI-style cache holding ``ctx + new_tokens`` tokens per sequence:
    the first ``group * ((n - residual) // group)`` as codes (keys ``key_bits`` per element plus a
    float16 scale and zero per channel per ``group`` tokens; values ``bits`` plus a float16 scale and
    zero per ``value_group`` elements of each token), the ring of ``residual + group`` tokens in bf16
    (allocated whole, so counted whole)."""
    check_positive("batch", batch)
    key_bits = key_bits or bits
    for name, b in (("bits", bits), ("key_bits", key_bits)):
        if b not in (2, 4):
            raise BudgetError(f"KIVI {name}: {b} is not stored; use 2 or 4")
    if residual < 0 or group < 1 or value_group < 1 or spec.head_dim % value_group:
        raise BudgetError(f"KIVI group {group}, residual {residual}, value_group {value_group}: need group >= 1, "
                          f"residual >= 0 and a value_group dividing head_dim {spec.head_dim}")
    n = ctx + new_tokens
    quantized = group * max(0, (n - residual) // group)
    d, heads = spec.head_dim, spec.num_layers * spec.num_kv_heads
    per_token = d * (key_bits + bits) / 8 + 2 * 2 * d / group + 2 * 2 * d / value_group
    ring = 2 * (residual + group) * d * 2
    return batch * heads * (quantized * per_token + ring)


def model_basis(kv_heads: int, head_dim: int, device) -> ModelBasis:
    """KIVI's K/V stored as the model computes them."""
    return ModelBasis()


class KiviLayer(StoredLengthMixin, DynamicLayer):
    """One layer's K/V in a :class:`kvlab.kernels.kivi.KiviSpec` layout (codes grow by whole groups)."""

    is_croppable = False
    attends_own_queries = True  # kvlab's attention wrapper hands a chunk's queries to :meth:`attend`

    def __init__(self, spec: kivi.KiviSpec | None = None, layer_idx: int = 0, basis=model_basis):
        super().__init__()
        self.spec = spec or kivi.KiviSpec()
        self.layer_idx = layer_idx
        self.make_basis = basis  # (kv_heads, head_dim, device) -> the basis K/V are stored in
        self.basis = ModelBasis()
        self._returned: tuple[torch.Tensor, torch.Tensor] | None = None  # K/V a chunk's update returned, for the hook
        self._chunk: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (first exact position, exact K, V)
        self.codes: list[tuple[torch.Tensor, ...]] = []  # per flushed chunk: k codes/scale/zero, v codes/scale/zero
        self.exact_k: torch.Tensor | None = None  # [B, H, r, D] bf16, the tokens not yet quantized
        self.exact_v: torch.Tensor | None = None
        self.quantized = 0
        self.dtype: torch.dtype | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype
        self.basis = self.make_basis(key_states.shape[1], key_states.shape[-1], key_states.device)

    def _add(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Append; flush the groups that filled. Returns the first position not quantized before this
        update and the exact (bf16) K/V from there on, in the stored basis."""
        start = self.quantized
        keys = self.basis.stored(keys).to(kivi.RESIDUAL_DTYPE)
        values = self.basis.stored(values).to(kivi.RESIDUAL_DTYPE)
        if self.exact_k is not None:
            keys, values = torch.cat([self.exact_k, keys], 2), torch.cat([self.exact_v, values], 2)
        flush = self.spec.quantized_tokens(self.quantized + keys.shape[2]) - self.quantized
        if flush:
            self.codes.append((*kivi.quantize_keys(self.spec, keys[:, :, :flush]),
                               *kivi.quantize_values(self.spec, values[:, :, :flush])))
            self.quantized += flush
        self.exact_k, self.exact_v = keys[:, :, flush:], values[:, :, flush:]
        return start, keys, values

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [kivi.dequantize_keys(self.spec, *c[:3]) for c in self.codes] + [self.exact_k.float()]
        values = [kivi.dequantize_values(self.spec, *c[3:]) for c in self.codes] + [self.exact_v.float()]
        keys, values = self.basis.read_back(torch.cat(keys, 2)), self.basis.read_back(torch.cat(values, 2))
        return keys.to(self.dtype), values.to(self.dtype)

    @property
    def stored_tokens(self) -> int:
        return self.quantized + (0 if self.exact_k is None else self.exact_k.shape[2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        added = self._add(key_states, value_states)
        if first:
            return key_states, value_states
        keys, values = self._dequantized()
        if key_states.shape[-2] > 1:  # a chunk: kvlab's attention hands us its queries (:meth:`attend`)
            self._returned, self._chunk = (keys, values), added
            attention.expect_queries(self.layer_idx, self)
        return keys, values

    def awaits(self, key: torch.Tensor) -> bool:
        """Whether ``key`` is the tensor this layer's last chunk update returned."""
        return self._returned is not None and self._returned[0] is key

    def receive_queries(self, query: torch.Tensor, attention_mask, scaling) -> None:
        self._returned = self._chunk = None

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The last update's ``n`` queries ``[B, Hq, n, D]`` -> ``[B, n, Hq, D]`` in the query's dtype,
        each row over what the cache returned when its token was appended alone: tokens before
        ``quantized_tokens(p + 1)`` dequantized, the rest exact, causal (the K/V in the model dtype,
        as the one-token path hands them to the stock kernel)."""
        (keys, values), (start, exact_k, exact_v) = self._returned, self._chunk
        self._returned = self._chunk = None
        batch, q_heads, n, d = query.shape
        total, kv_heads = keys.shape[2], keys.shape[1]
        pos = torch.arange(total - n, total, device=query.device).view(n, 1)  # each row's position
        seen_q = torch.tensor([self.spec.quantized_tokens(p + 1) for p in range(total - n, total)],
                              device=query.device).view(n, 1)
        t_all = torch.arange(total, device=query.device).view(1, total)
        t_exact = torch.arange(start, total, device=query.device).view(1, total - start)
        visible = torch.cat([t_all < seen_q, (t_exact >= seen_q) & (t_exact <= pos)], dim=1)  # [n, T + T - start]
        exact_k, exact_v = self.basis.read_back(exact_k.float()), self.basis.read_back(exact_v.float())
        k = torch.cat([keys, exact_k.to(keys.dtype)], 2).float()
        v = torch.cat([values, exact_v.to(values.dtype)], 2).float()
        qf = query.float().view(batch, kv_heads, q_heads // kv_heads, n, d)
        logits = torch.einsum("bhgnd,bhtd->bhgnt", qf, k) * scaling
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("bhgnt,bhtd->bhgnd", probs, v).reshape(batch, q_heads, n, d)
        return out.transpose(1, 2).to(query.dtype).contiguous()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a KIVI cache cannot be cropped: build a fresh cache for each question")

    def reset(self) -> None:
        super().reset()
        self.codes, self.exact_k, self.exact_v, self.quantized = [], None, None, 0
        self._returned = self._chunk = None

    def nbytes(self) -> int:
        tensors = [t for c in self.codes for t in c] + [t for t in (self.exact_k, self.exact_v) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def kivi_cache(num_layers: int, spec: kivi.KiviSpec | None = None, basis=model_basis) -> Cache:
    """A transformers cache of ``num_layers`` :class:`KiviLayer` s (``basis``: as :class:`KiviLayer`'s)."""
    return Cache(layers=[KiviLayer(spec, i, basis) for i in range(num_layers)])


class KiviSlotStore(SlotStore):
    """Per-layer :class:`kvlab.kernels.kivi.KiviStore` s sized for ``capacity_l`` tokens."""

    rewinds = False  # the ring and the flushed groups follow every token written

    attention = "kivi"

    def __init__(self, layout: Layout, storage: KiviStorage, num_heads: int, device, scale: float,
                 backend: str = "auto"):
        spec = storage.spec
        self.layout, self.spec, self.scale, self.backend = layout, spec, scale, backend
        self.kv_format = storage.kv_format
        b, h, d = layout.batch, layout.kv_heads, layout.head_dim
        self.basis = storage.basis(h, d, device)  # the ring and the codes hold K/V in this basis
        self.stores = [kivi.alloc(spec, b, h, c, d, device) for c in layout.capacity]
        kernel = uses_kernel(backend, device)
        self.workspaces = [make_kivi_workspace(num_heads, s) if kernel else None for s in self.stores]
        self.slots = StepSlots(layout.kept, layout.batch, device)

    def bytes_allocated(self) -> int:
        return sum(s.nbytes() for s in self.stores)

    def buffers(self) -> list[torch.Tensor]:
        return [t for s in self.stores for t in s.tensors()] + list(self.slots.tensors())

    def bytes_per_slot(self) -> int:
        """Bytes of one quantized token in one layer (K and V, all KV heads, scales included, rounded
        up; the ring's fixed bf16 window is in :meth:`bytes_allocated`)."""
        return math.ceil(self.layout.kv_heads * self.spec.token_bytes(self.layout.head_dim))

    def held_bytes(self, held: list[int]) -> int:
        """Codes and scales of the quantized tokens, bf16 for those still in the ring (as ``cache_stats``
        counts a :class:`KiviLayer`)."""
        h, d, b = self.layout.kv_heads, self.layout.head_dim, self.layout.batch
        exact = 2 * h * d * kivi.RESIDUAL_DTYPE.itemsize
        return b * sum(math.ceil(self.spec.quantized_tokens(n) * h * self.spec.token_bytes(d))
                       + (n - self.spec.quantized_tokens(n)) * exact for n in held)

    def _load_layer(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        kivi.load(self.stores[layer].rows(rows), self.basis.stored(k), self.basis.stored(v))

    def _attend(self, layer: int, q, k, v) -> torch.Tensor:
        store = self.stores[layer]
        kivi_append(store, self.basis.stored(k), self.basis.stored(v), self.slots.slot(layer), backend=self.backend)
        bsz, n_heads, _, dim = q.shape
        query = self.basis.queries(q.reshape(bsz, n_heads, dim)).contiguous()
        out = kivi_decode_attention(query, store, self.slots.used(layer), self.scale,
                                    workspace=self.workspaces[layer], backend=self.backend)
        return self.basis.output(out).to(q.dtype)


@dataclass
class Tail:
    """A request's tokens not yet quantized in a :class:`KiviPool`: their slots and exact (bf16) K/V
    ``[n, Hkv, D]``, after the first ``quantized`` tokens."""

    quantized: int
    slots: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class KiviPool(PagedPool):
    """Key groups of one block each, per-token value codes, a bf16 tail per request (the module docstring).
    ``paged_kernel``: the contiguous KIVI kernel reads this head dim (so does the paged one,
    :func:`kvlab.kernels.paged.paged_kivi_decode`)."""

    def __init__(self, spec: kivi.KiviSpec, shape: PoolShape, dtype: torch.dtype, device):
        spec.check_head_dim(shape.head_dim)
        self.spec, self.block_size, self.dtype, self.device = spec, shape.block_size, dtype, device
        self.paged_kernel = kernel_problem(spec, shape.head_dim) is None
        slots, heads, dim = shape.slots, shape.kv_heads, shape.head_dim

        def zeros(*size, dtype=kivi.SCALE_DTYPE):
            return torch.zeros(shape.num_layers, *size, dtype=dtype, device=device)

        self.k_codes = zeros(slots, heads, dim * spec.k_bits // 8, dtype=torch.uint8)
        self.k_scale, self.k_zero = zeros(shape.num_blocks, heads, dim), zeros(shape.num_blocks, heads, dim)
        self.v_codes = zeros(slots, heads, dim * spec.v_bits // 8, dtype=torch.uint8)
        groups = dim // spec.value_group
        self.v_scale, self.v_zero = zeros(slots, heads, groups), zeros(slots, heads, groups)
        self.tails: list[dict[int, Tail]] = [{} for _ in range(shape.num_layers)]  # per layer: owner -> its tail
        self.chunks: list[dict[int, tuple]] = [{} for _ in range(shape.num_layers)]  # owner -> its last write's rows

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        slots = slots.to(self.device)
        if first or owner not in self.tails[layer]:
            empty = k.new_zeros((0, *k.shape[1:]), dtype=kivi.RESIDUAL_DTYPE)
            self.tails[layer][owner] = Tail(0, slots[:0], empty, empty)
        tail = self.tails[layer][owner]
        ks, vs = torch.cat([tail.k, k.to(kivi.RESIDUAL_DTYPE)]), torch.cat([tail.v, v.to(kivi.RESIDUAL_DTYPE)])
        held = torch.cat([tail.slots, slots])
        nq = self.spec.quantized_tokens(tail.quantized + len(ks))
        flush = nq - tail.quantized
        if flush:
            self.quantize(layer, held[:flush], ks[:flush], vs[:flush])
        self.tails[layer][owner] = Tail(nq, held[flush:], ks[flush:], vs[flush:])
        # what the chunk's rows read exact: a first write (the prefill) in its own precision, as the
        # static prefill attends; later tokens as the bf16 tail holds them
        exact_k = k.float() if first else ks.float()
        exact_v = v.float() if first else vs.float()
        self.chunks[layer][owner] = (tail.quantized, exact_k, exact_v)

    def quantize(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Whole key groups (``slots`` start at a block's first slot) into codes and scales."""
        kc, ks, kz = kivi.quantize_keys(self.spec, k.transpose(0, 1)[None])
        vc, vs, vz = kivi.quantize_values(self.spec, v.transpose(0, 1)[None])
        blocks = slots[::self.spec.group] // self.block_size
        self.k_codes[layer, slots] = kc[0].transpose(0, 1)
        self.k_scale[layer, blocks], self.k_zero[layer, blocks] = ks[0].transpose(0, 1), kz[0].transpose(0, 1)
        self.v_codes[layer, slots] = vc[0].transpose(0, 1)
        self.v_scale[layer, slots], self.v_zero[layer, slots] = vs[0].transpose(0, 1), vz[0].transpose(0, 1)

    def dequantized(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of quantized tokens at ``slots`` (whole groups, token order), float32 ``[Hkv, n, D]``."""
        blocks = slots[::self.spec.group] // self.block_size
        keys = kivi.dequantize_keys(self.spec, self.k_codes[layer, slots].transpose(0, 1)[None],
                                    self.k_scale[layer, blocks].transpose(0, 1)[None],
                                    self.k_zero[layer, blocks].transpose(0, 1)[None])
        values = kivi.dequantize_values(self.spec, self.v_codes[layer, slots].transpose(0, 1)[None],
                                        self.v_scale[layer, slots].transpose(0, 1)[None],
                                        self.v_zero[layer, slots].transpose(0, 1)[None])
        return keys[0], values[0]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's K/V as stored (``slots``: its held slots from token 0): codes dequantized, tail exact."""
        slots = slots.to(self.device)
        tail = self.tails[layer][int(slots[0]) // self.block_size]
        keys, values = self.dequantized(layer, slots[:tail.quantized])
        return (torch.cat([keys, tail.k.transpose(0, 1).float()], 1).to(self.dtype),
                torch.cat([values, tail.v.transpose(0, 1).float()], 1).to(self.dtype))

    def decode(self, layer: int, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Decode rows through the paged kernel: each request's code blocks through its table, then its
        exact tail (gathered here, padded), as :meth:`attend` reads a decode row."""
        owners = tables[:, 0].tolist()  # a request's first block names it
        tails = [self.tails[layer][owner] for owner in owners]
        for owner in owners:
            self.chunks[layer].pop(owner, None)  # what attend would have read
        batch, heads, dim = len(tails), self.k_scale.shape[2], self.k_scale.shape[3]
        width = max(1, max(len(t.k) for t in tails))
        tail_k = torch.zeros(batch, heads, width, dim, dtype=kivi.RESIDUAL_DTYPE, device=self.device)
        tail_v = torch.zeros_like(tail_k)
        for b, tail in enumerate(tails):
            tail_k[b, :, :len(tail.k)] = tail.k.transpose(0, 1)
            tail_v[b, :, :len(tail.v)] = tail.v.transpose(0, 1)
        as_int = {"dtype": torch.int32, "device": self.device}
        quantized = torch.tensor([t.quantized for t in tails], **as_int)
        count = torch.tensor([len(t.k) for t in tails], **as_int)
        codes = PagedKiviCodes(self.spec, self.k_codes[layer], self.k_scale[layer], self.k_zero[layer],
                               self.v_codes[layer], self.v_scale[layer], self.v_zero[layer])
        return paged_kivi_decode(q, codes, tables, quantized, (tail_k, tail_v, count), scale)

    def attend(self, layer: int, q: torch.Tensor, held: torch.Tensor, scale: float, decode_from: int) -> torch.Tensor:
        held = held.to(self.device)
        owner = int(held[0]) // self.block_size
        start, exact_k, exact_v = self.chunks[layer].pop(owner)  # the chunk this step wrote (then attends)
        q_heads, n, d = q.shape
        m = len(held)
        nq = self.tails[layer][owner].quantized
        keys, values = self.dequantized(layer, held[:nq])  # [Hkv, nq, D]
        kv_heads = keys.shape[0]
        pos = torch.arange(m - n, m, device=q.device).view(n, 1)  # each row's position
        seen = torch.tensor([start if i < decode_from else self.spec.quantized_tokens(m - n + i + 1)
                             for i in range(n)], device=q.device).view(n, 1)  # tokens it reads dequantized
        t_exact = torch.arange(start, m, device=q.device).view(1, m - start)
        visible = torch.cat([torch.arange(nq, device=q.device).view(1, nq) < seen,
                             (t_exact >= seen) & (t_exact <= pos)], dim=1)  # [n, nq + m - start]
        k = torch.cat([keys, exact_k.transpose(0, 1)], 1)
        v = torch.cat([values, exact_v.transpose(0, 1)], 1)
        qf = q.float().view(kv_heads, q_heads // kv_heads, n, d)
        logits = torch.einsum("hgnd,htd->hgnt", qf, k) * scale
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("hgnt,htd->hgnd", probs, v).reshape(q_heads, n, d).to(q.dtype)


@dataclass(frozen=True)
class KiviStorage(PromptStorage):
    """KIVI's knobs; its label, bits, checks, and both engines' halves."""

    name = "kivi"
    summary = ("KIVI-style 2/4-bit cache: keys per channel over token groups, values per token, a bf16 "
               "residual of recent tokens (fast: fused kernel; hf: dequantize, then attend)")
    attends_own_queries = True  # a multi-token chunk after the prefill is read per row (KiviLayer.attend)
    prefill = None  # the prompt enters whole; the store loads it from a plain prefill cache

    nbits: int = field(default=2, metadata={"help": "bits per stored value (and key, unless key_bits): 2 or 4"})
    key_bits: int | None = field(default=None, metadata={
        "help": "bits per stored key, 2 or 4 (null: nbits); KIVI's K4V2 is key_bits 4, nbits 2"})
    q_group_size: int = field(default=32, metadata={
        "help": "tokens per key channel group G (16, 32, 64 or 128)"})
    residual_length: int = field(default=128, metadata={"help": "recent tokens kept in bf16 (R >= 0)"})
    value_group: int = field(default=32, metadata={
        "help": "head_dim elements per value scale and zero (16, 32, 64 or 128; must divide head_dim)"})

    def __post_init__(self):
        check_int("nbits", self.nbits, choices=(2, 4))
        if self.key_bits is not None:
            check_int("key_bits", self.key_bits, choices=(2, 4))
        check_int("q_group_size", self.q_group_size, choices=GROUPS)
        check_int("residual_length", self.residual_length, minimum=0)
        check_int("value_group", self.value_group, choices=GROUPS)

    @property
    def spec(self) -> kivi.KiviSpec:
        return kivi.KiviSpec(self.nbits, self.q_group_size, self.residual_length, self.value_group, self.key_bits)

    @property
    def bits(self) -> int:
        """Mean stored bits of K and V (3 for K4V2), codes only."""
        return (self.spec.k_bits + self.spec.v_bits) // 2

    @property
    def label(self) -> str:
        s = self.spec
        extra = "".join(f" {k}{v}" for k, v, default in (("g", s.group, 32), ("r", s.residual, 128),
                                                          ("vg", s.value_group, 32)) if v != default)
        return f"kivi k{s.k_bits}v{s.v_bits}{extra}"

    @property
    def kv_format(self) -> str:
        return self.spec.label

    def check(self, shape: ModelShape, cuda: bool) -> None:
        shape.check_full_attention("kivi stores")
        if shape.head_dim % self.value_group:
            raise PolicyError(f"value_group={self.value_group} does not divide {shape.name}'s head_dim "
                              f"{shape.head_dim}: use one of {', '.join(str(g) for g in GROUPS if shape.head_dim % g == 0) or 'none'}")
        why = kernel_problem(self.spec, shape.head_dim)
        if why and cuda:
            raise PolicyError(f"kivi's CUDA kernel cannot read {shape.name}: {why}")

    def basis(self, kv_heads: int, head_dim: int, device):
        """The basis K/V are stored in (:mod:`kvlab.storage.basis`)."""
        return ModelBasis()

    def make_cache(self, num_layers: int) -> Cache:
        return kivi_cache(num_layers, self.spec, self.basis)

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        """A quantized token's bytes (codes and scales; the bf16 ring is a fixed extra per sequence)."""
        return kv_heads * self.spec.token_bytes(head_dim)

    def store(self, layout: Layout, options: StoreOptions):
        return KiviSlotStore(layout, self, options.num_heads, options.device, options.scale, options.backend)

    def paged(self, kv_heads: int, head_dim: int, block_tokens: int = 16, element_size: int = 2):
        """Blocks of quantized tokens; a sequence's bf16 tail (``R + G - 1`` tokens of K and V at most)
        is held beside them."""
        tail = 2 * kv_heads * head_dim * kivi.RESIDUAL_DTYPE.itemsize * (self.spec.window - 1)
        return replace(super().paged(kv_heads, head_dim, block_tokens, element_size), sequence_bytes=tail)

    def paged_pool(self, shape: PoolShape, dtype: torch.dtype, device) -> KiviPool:
        return KiviPool(self.spec, shape, dtype, device)

    def block_size_problem(self, block_size: int) -> str | None:
        """A key group is one pool block (its per-channel scales, one per block)."""
        if self.q_group_size == block_size:
            return None
        return (f"kivi key groups of {self.q_group_size} tokens are stored in pool blocks of {block_size}: serve "
                f"it with block_size={self.q_group_size} (one block each), or q_group_size={block_size}")
