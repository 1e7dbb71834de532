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
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.errors import PolicyError
from kvlab.kernels import kivi
from kvlab.kernels.kivi_decode import kernel_problem, kivi_append, kivi_decode_attention, make_kivi_workspace
from kvlab.storage import attention
from kvlab.storage.base import ModelShape, StoredLengthMixin, StoreOptions, check_int
from kvlab.storage.basis import ModelBasis
from kvlab.storage.loading import PromptStorage
from kvlab.storage.slots import Layout, SlotStore, StepSlots, uses_kernel

GROUPS = (16, 32, 64, 128)


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
