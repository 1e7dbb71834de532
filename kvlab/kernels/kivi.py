"""KIVI-style 2-/4-bit KV storage (Liu et al. 2024, github.com/jy-yuan/KIVI), pure torch: the ground
truth of the fused kernel (:mod:`kvlab.kernels.kivi_decode`) and the CPU path.

Keys have outlier channels, so keys are quantized **per channel** over groups of ``group`` (G)
tokens; values **per token**, a scale and a zero per ``value_group`` elements of the head dim; both
asymmetric (``x ~ code * scale + zero``), codes packed along the head dim (:mod:`kvlab.kernels.packing`),
scales and zeros float16 (zero rounded down, scale up, as kvlab's ``int`` formats). The most recent
tokens stay in bf16 in a ring of ``W = R + G`` slots (``R = residual``): token ``t`` sits in ring slot
``t % W`` until it is quantized.

The boundary is a pure function of the length: the first ``n_q = G * max(0, (length - R) // G)`` tokens
are quantized, the last ``length - n_q`` (``R <= . < R + G`` once ``length >= R``) are in the ring.
So every step keeps at least the last R tokens exact, and each time the ring reaches ``R + G``
tokens its oldest G are quantized together (keys form one per-channel group, values G per-token
rows). KIVI's own code (``models/llama_kivi.py``) flushes differently: keys R at a time (its key
residual holds ``length % R`` tokens), values one per step (exactly R). One boundary for K and V
keeps the kernel to one split of exact tokens and one of codes; it keeps more exact keys than KIVI.
Defaults: G = 32 and R = 128 (the paper's setting; ``example.py`` uses R = 32), value groups of 32.

:func:`append` is made of fixed-shape ops with the position on the device (CUDA-graph capturable):
every step it quantizes the group that would be flushed and writes it to its group, or to a spare
"trash" group past the capacity when no group filled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.kernels import packing
from kvlab.kernels.formats import FormatError, StoreBuffers, round_toward

SCALE_DTYPE = torch.float16
RESIDUAL_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class KiviSpec:
    """Bits (2 or 4; ``key_bits``, when given, for the keys: KIVI's ``k_bits``/``v_bits``), key group
    G (tokens per channel group), residual R (exact recent tokens), value group (head-dim elements
    per value scale)."""

    bits: int = 2
    group: int = 32
    residual: int = 128
    value_group: int = 32
    key_bits: int | None = None

    def __post_init__(self):
        if self.bits not in (2, 4) or self.key_bits not in (None, 2, 4):
            raise FormatError(f"KIVI bits must be 2 or 4, not {self.bits!r} (key_bits {self.key_bits!r})")
        if self.group not in (16, 32, 64, 128):
            raise FormatError(f"KIVI key group must be 16, 32, 64 or 128 tokens, not {self.group!r}")
        if self.value_group not in (16, 32, 64, 128):
            raise FormatError(f"KIVI value group must be 16, 32, 64 or 128, not {self.value_group!r}")
        if self.residual < 0:
            raise FormatError(f"KIVI residual must be >= 0 tokens, not {self.residual!r}")

    @property
    def label(self) -> str:
        bits = f"{self.bits}" if self.k_bits == self.v_bits else f"-k{self.k_bits}v{self.v_bits}"
        vg = "" if self.value_group == 32 else f"-vg{self.value_group}"
        return f"kivi{bits}-g{self.group}-r{self.residual}{vg}"

    @property
    def k_bits(self) -> int:
        return self.key_bits or self.bits

    @property
    def v_bits(self) -> int:
        return self.bits

    @property
    def window(self) -> int:
        """Ring slots: the residual plus one group filling up."""
        return self.residual + self.group

    def quantized_tokens(self, length: int) -> int:
        """How many leading tokens of a ``length``-token sequence are stored as codes."""
        return self.group * max(0, (length - self.residual) // self.group)

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim <= 0 or head_dim % self.value_group:
            raise FormatError(f"head_dim {head_dim} must be a positive multiple of the value group "
                              f"{self.value_group}")

    def token_bytes(self, head_dim: int) -> float:
        """Bytes of one quantized token of one KV head, K and V (the ring is fixed, not per token)."""
        codes = head_dim * (self.k_bits + self.v_bits) // 8
        key_scales = 2 * head_dim * 2 / self.group  # scale + zero per channel, shared by G tokens
        value_scales = 2 * (head_dim // self.value_group) * 2
        return codes + key_scales + value_scales


@dataclass
class KiviStore(StoreBuffers):
    """One layer's K and V: codes for ``capacity`` tokens (rounded up to groups, plus one trash
    group) and the bf16 ring.

    ``k_codes [B, H, Cq + G, D*k_bits/8]``, ``k_scale``/``k_zero [B, H, Cq/G + 1, D]`` (per channel per
    group), ``v_codes [B, H, Cq + G, D*v_bits/8]``, ``v_scale``/``v_zero [B, H, Cq + G, D/value_group]``,
    ``ring_k``/``ring_v [B, H, W, D]``. The last group of each code buffer is the trash group.
    """

    spec: KiviSpec
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    ring_k: torch.Tensor
    ring_v: torch.Tensor
    head_dim: int

    @property
    def lead(self) -> torch.Tensor:
        return self.ring_k

    @property
    def groups(self) -> int:
        """Key groups that hold tokens (the trash group excluded)."""
        return self.k_scale.shape[2] - 1

    @property
    def capacity(self) -> int:
        """Most tokens the store can hold."""
        return self.groups * self.spec.group + self.spec.residual + self.spec.group - 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_codes, self.k_scale, self.k_zero, self.v_codes, self.v_scale, self.v_zero,
                self.ring_k, self.ring_v)

    def rows(self, rows: slice) -> KiviStore:
        """Batch rows ``rows`` as views of the same buffers (writing into them writes into this store)."""
        start, stop, _ = rows.indices(self.batch)
        return KiviStore(self.spec, *(t[start:stop] for t in self.tensors()), self.head_dim)


def alloc(spec: KiviSpec, batch: int, kv_heads: int, capacity: int, head_dim: int,
          device: torch.device | str = "cpu") -> KiviStore:
    """Zeroed buffers for up to ``capacity`` tokens per row."""
    spec.check_head_dim(head_dim)
    groups = spec.quantized_tokens(capacity) // spec.group
    tokens = (groups + 1) * spec.group

    def zeros(*shape, dtype=SCALE_DTYPE):
        return torch.zeros(batch, kv_heads, *shape, dtype=dtype, device=device)

    return KiviStore(spec, zeros(tokens, head_dim * spec.k_bits // 8, dtype=torch.uint8), zeros(groups + 1, head_dim),
                     zeros(groups + 1, head_dim), zeros(tokens, head_dim * spec.v_bits // 8, dtype=torch.uint8),
                     zeros(tokens, head_dim // spec.value_group), zeros(tokens, head_dim // spec.value_group),
                     zeros(spec.window, head_dim, dtype=RESIDUAL_DTYPE),
                     zeros(spec.window, head_dim, dtype=RESIDUAL_DTYPE), head_dim)


# -- quantization ------------------------------------------------------------------------------------
def _asymmetric(x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (float, in ``[0, levels]``), scale and zero of ``x`` with the range taken along ``dim``."""
    low, high = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    zero = round_toward(low, SCALE_DTYPE, down=True)
    scale = round_toward((high - zero.float()) / levels, SCALE_DTYPE, down=False)
    inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    codes = ((x - zero.float()) * inv + 0.5).floor().clamp(0, levels)
    return codes, scale, zero


def quantize_keys(spec: KiviSpec, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k [B, H, n * G, D]`` -> codes ``[B, H, n * G, D*k_bits/8]``, scale and zero ``[B, H, n, D]``."""
    b, h, t, d = k.shape
    if t % spec.group:
        raise FormatError(f"keys are quantized in whole groups of {spec.group} tokens, got {t}")
    kg = k.float().view(b, h, t // spec.group, spec.group, d)
    codes, scale, zero = _asymmetric(kg, 3, (1 << spec.k_bits) - 1)
    return packing.pack(codes.view(b, h, t, d), spec.k_bits), scale.squeeze(3), zero.squeeze(3)


def quantize_values(spec: KiviSpec, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``v [B, H, n, D]`` -> codes ``[B, H, n, D*v_bits/8]``, scale and zero ``[B, H, n, D/value_group]``."""
    vg = v.float().unflatten(-1, (v.shape[-1] // spec.value_group, spec.value_group))
    codes, scale, zero = _asymmetric(vg, -1, (1 << spec.v_bits) - 1)
    return packing.pack(codes.flatten(-2), spec.v_bits), scale.squeeze(-1), zero.squeeze(-1)


def dequantize_keys(spec: KiviSpec, codes, scale, zero) -> torch.Tensor:
    b, h, t, _ = codes.shape
    d = scale.shape[-1]
    c = packing.unpack(codes, spec.k_bits).float().view(b, h, t // spec.group, spec.group, d)
    return (c * scale.float().unsqueeze(3) + zero.float().unsqueeze(3)).view(b, h, t, d)


def dequantize_values(spec: KiviSpec, codes, scale, zero) -> torch.Tensor:
    c = packing.unpack(codes, spec.v_bits).float()
    c = c.unflatten(-1, (c.shape[-1] // spec.value_group, spec.value_group))
    return (c * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)).flatten(-2)


# -- writing -----------------------------------------------------------------------------------------
def load(store: KiviStore, k: torch.Tensor, v: torch.Tensor) -> None:
    """Fill a store (or a ``store.rows(...)`` view) with a prefill's ``[B, H, n, D]`` K/V: the first
    ``quantized_tokens(n)`` as codes, the rest into their ring slots."""
    spec, n = store.spec, k.shape[2]
    if n > store.capacity:
        raise FormatError(f"{n} tokens do not fit a store of capacity {store.capacity}")
    nq = spec.quantized_tokens(n)
    k, v = k.to(RESIDUAL_DTYPE), v.to(RESIDUAL_DTYPE)  # codes come from the bf16 values, as after a flush
    if nq:
        for dst, src in zip((store.k_codes, store.k_scale, store.k_zero), quantize_keys(spec, k[:, :, :nq]),
                            strict=True):
            dst[:, :, :src.shape[2]].copy_(src)
        for dst, src in zip((store.v_codes, store.v_scale, store.v_zero), quantize_values(spec, v[:, :, :nq]),
                            strict=True):
            dst[:, :, :nq].copy_(src)
    slots = torch.arange(nq, n, device=k.device) % spec.window
    store.ring_k.index_copy_(2, slots, k[:, :, nq:])
    store.ring_v.index_copy_(2, slots, v[:, :, nq:])


def append(store: KiviStore, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor) -> None:
    """Write one token per row (``[B, H, 1, D]``) at ``position`` (a ``[1]`` int64 device tensor, the
    same for every row), then quantize the ring's oldest group if the ring just reached ``R + G``.

    Fixed-shape ops only: the flush always runs, into the trash group when no group filled.
    """
    spec, g = store.spec, store.spec.group
    ring_slot = position % spec.window
    store.ring_k.index_copy_(2, ring_slot, k.to(RESIDUAL_DTYPE))
    store.ring_v.index_copy_(2, ring_slot, v.to(RESIDUAL_DTYPE))
    length = position + 1
    over = length - spec.residual
    full = (over >= g) & (over % g == 0)
    group = torch.where(full, over // g - 1, torch.full_like(over, store.groups))  # [1]
    first = torch.where(full, over - g, torch.zeros_like(over))  # first token of the flushed group
    tokens = first + torch.arange(g, device=position.device)
    ring = tokens % spec.window
    kc, ks, kz = quantize_keys(spec, store.ring_k.index_select(2, ring))
    vc, vs, vz = quantize_values(spec, store.ring_v.index_select(2, ring))
    store.k_scale.index_copy_(2, group, ks)
    store.k_zero.index_copy_(2, group, kz)
    dst = group * g + torch.arange(g, device=position.device)
    for buf, src in ((store.k_codes, kc), (store.v_codes, vc), (store.v_scale, vs), (store.v_zero, vz)):
        buf.index_copy_(2, dst, src)


# -- reading -----------------------------------------------------------------------------------------
def dequantize(store: KiviStore, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``length`` tokens in token order, float32 ``[B, H, length, D]``:
    dequantized groups, then the ring's exact tokens."""
    spec = store.spec
    if not 0 <= length <= store.capacity:
        raise FormatError(f"length {length} outside the store's capacity {store.capacity}")
    nq = spec.quantized_tokens(length)
    keys = dequantize_keys(spec, store.k_codes[:, :, :nq], store.k_scale[:, :, :nq // spec.group],
                           store.k_zero[:, :, :nq // spec.group])
    values = dequantize_values(spec, store.v_codes[:, :, :nq], store.v_scale[:, :, :nq], store.v_zero[:, :, :nq])
    slots = torch.arange(nq, length, device=store.device) % spec.window
    keys = torch.cat([keys, store.ring_k.index_select(2, slots).float()], dim=2)
    values = torch.cat([values, store.ring_v.index_select(2, slots).float()], dim=2)
    return keys, values


def attend(q: torch.Tensor, store: KiviStore, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` of one query per row (``q [B, Hq, D]``) over each row's first
    ``lengths[b]`` tokens, K/V as stored (groups dequantized, ring exact); float32 ``[B, Hq, D]``.
    GQA: query head ``h`` reads KV head ``h // (Hq / H)``. Reads ``lengths`` on the host."""
    batch, q_heads, d = q.shape
    if q_heads % store.kv_heads or d != store.head_dim or batch != store.batch:
        raise FormatError(f"q {list(q.shape)} does not fit a store of B={store.batch}, H={store.kv_heads}, "
                          f"D={store.head_dim}")
    out = torch.zeros(batch, q_heads, d, dtype=torch.float32, device=q.device)
    group = q_heads // store.kv_heads
    for b, n in enumerate(lengths.tolist()):
        if n <= 0:
            continue
        keys, values = dequantize(store.rows(slice(b, b + 1)), n)
        qf = q[b].float().view(store.kv_heads, group, d)
        probs = torch.softmax(torch.einsum("hgd,htd->hgt", qf, keys[0]) * scale, dim=-1)
        out[b] = torch.einsum("hgt,htd->hgd", probs, values[0]).reshape(q_heads, d)
    return out
