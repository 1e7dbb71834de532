"""KV storage formats: how one K or V tensor of one layer is stored, with a pure-torch reference.

Each format is an object that owns its layout and its arithmetic:

- ``alloc(batch, kv_heads, capacity, head_dim, device)`` -> a :class:`KVStore` of static buffers;
- ``write(store, x, positions)`` quantizes ``x [B, Hkv, n, D]`` into slots ``positions`` (into some
  batch rows only through ``store.rows(slice(r0, r1))``, a view of the same buffers);
- ``quantize(x)`` -> a :class:`KVStore` holding exactly ``x``'s tokens (the pure function tests use);
- ``dequantize(store, length)`` -> ``[B, Hkv, length, D]`` float32, the ground truth of the kernels;
- ``bytes_per_token(kv_heads, head_dim)``: bytes one token takes in one store (codes + scales);
- what the Triton kernels need to read it: ``kernel`` (the ``FMT`` code the kernels branch on),
  ``bits``, ``pack`` (codes per byte), ``group_size(head_dim)``, ``read_codes``/``write_codes``
  (the codes as the kernels take them), ``fold_reads(head_dim)``, ``asm_unpack`` and
  ``launch_config`` (the tuned launch geometry, :data:`TUNED_CONFIGS`).

A format's name is ``label`` (``fp8``, ``int4-g64``: :func:`format_label`), parsed back by
:func:`parse_format`; nothing else spells that syntax.

``write`` is made of fixed-shape torch ops only (no ``.item()``, no host sync, no allocation whose
size depends on data), so the fast engine can capture it in a CUDA graph: ``positions`` is a device
tensor, ``[n]`` (the same slots in every batch row) or ``[B, n]`` (a slot per row).

Formats (names in :data:`FORMATS`):

- ``bf16``: plain, for comparison.
- ``fp8``: float8_e4m3fn codes, one float32 scale per token and KV head (``amax / 448``), saturating.
- ``int4`` / ``int2``: asymmetric, a scale and a zero per ``group`` elements along the head dim
  (group 32, 64 or 128), ``x ~ code * scale + zero``; codes packed along the head dim
  (:mod:`kvlab.kernels.packing`). Scales and zeros are float16 by default (at group 32 they are a
  fifth of an int4 store's bytes; in float32 they would be a third); the zero is rounded down and
  the scale up, so every element still lies within ``scale / 2`` of its dequantized value.
  float16 assumes ``|x| < 6.5e4``, true of K and V activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvlab.errors import UserError
from kvlab.kernels import packing

FP8_MAX = 448.0  # largest finite float8_e4m3fn
GROUPS = (32, 64, 128)
GROUP_MARK = "-g"  # int4-g64: the name, then the group

# The ``FMT`` constexpr every Triton kernel branches on: which stored layout it reads.
FMT_BF16, FMT_FP8, FMT_INT = 0, 1, 2

BLOCK_N = 64  # slots per inner iteration of the decode kernels
PROGRAMS_PER_SM = 4  # split so that a full-length step has about this many programs per SM
VARIANTS = ("split", "fold", "fold_asm", "warp", "warp_asm", "warp2", "warp2_asm")


class FormatError(UserError):
    """A KV format got shapes or parameters it cannot store; the message names the fix."""


@dataclass(frozen=True)
class LaunchConfig:
    """Tuning knobs of the decode split kernel (none changes the result beyond float rounding).

    Defaults are a known-good flash-decoding shape; the formats tuned on the H200 override them in
    :data:`TUNED_CONFIGS` (``benchmarks/quant_attention.py --tune`` times the alternatives and prints
    the winners to paste). ``variant`` picks the kernel (:data:`VARIANTS`; ``None``: the launcher's
    ``DEFAULT_VARIANT`` at launch); a store the ``fold`` kernel cannot read (int2 with group 32)
    runs ``split``.
    """

    block_n: int = BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = PROGRAMS_PER_SM
    variant: str | None = None

    def __post_init__(self):
        if self.block_n not in (16, 32, 64, 128, 256):
            raise FormatError(f"block_n must be a power of two in 16..256, not {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16) or not 1 <= self.num_stages <= 6 or self.programs_per_sm < 1:
            raise FormatError(f"bad launch config {self}: num_warps in 1..16 (power of two), num_stages in 1..6")
        if self.variant is not None and self.variant not in VARIANTS:
            raise FormatError(f"variant must be one of {', '.join(VARIANTS)}, not {self.variant!r}")


# Launch configs measured best per format label ("bf16", "fp8", "int4-g64", ...): a format's
# ``launch_config``, read when a decode workspace is made without a config. The int formats read by
# the fold kernel (scales and zeros folded into the operands): on the H200 at the Llama-3.1-8B
# attention shape and 16k it took 0.42-0.67x split's time for int4 (g32/64/128) and int2-g64 at batch
# 1, 16 and 32, with the default geometry (benchmarks/quant_attention.py). fp8 and
# int4-g64 carry the winners of `quant_attention.py --tune --tune-formats int4-g64 fp8`
# (best geometric mean over batch 1/16/32): 128 slots per
# block, 3 stages, 2 programs per SM; against the default geometry int4-g64 0.66x/0.61x/0.81x the time
# at batch 1/16/32 and fp8 (now fold, was split) 0.73x/0.74x/0.77x. The other int formats keep the
# default geometry (not tuned). fp8 runs the ``warp_asm`` kernel (int4-g64 ran it before ``warp2_asm``)
# (:mod:`kvlab.kernels.decode_warp`: each warp its own split, 16-bit code words) at that geometry: on
# an H100 at the default geometry it took 0.71-0.94x fold_asm's time for int4-g64 and 0.79-0.86x
# fold's for fp8 at batch 1/16/32, and in the fast engine at batch 16 (the tuned geometry) its
# attention kernels read at 0.71x (int4-g64) and 0.94x (fp8) a copy of the same bytes.
# int4-g32 (slower) and int4-g128 (slower at batch 1) stay on fold_asm.
# int4-g64 runs ``warp2_asm`` (int4 quarters unpacked in place as float16 subnormals):
# on an H100 at this geometry it read at 0.87x / 0.74x copy bandwidth at batch 16 / 32 against
# warp_asm's 0.71x / 0.59x, with warp_asm's error (1.7e-3), and the int4 cache took 0.484x the full
# cache's decode J/token at batch 16 in the fast engine.
TUNED_CONFIGS: dict[str, LaunchConfig] = {
    **{f"int4-g{g}": LaunchConfig(variant="fold_asm") for g in (32, 128)},
    "int4-g64": LaunchConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=2, variant="warp2_asm"),
    "fp8": LaunchConfig(block_n=128, num_warps=4, num_stages=3, programs_per_sm=2, variant="warp_asm"),
    **{f"int2-g{g}": LaunchConfig(variant="fold") for g in (64, 128)},
}


class StoreBuffers:
    """One layer's static ``[B, Hkv, ...]`` buffers (:class:`KVStore`, :class:`kvlab.kernels.kivi.KiviStore`):
    batch rows, KV heads and device read off ``lead``, bytes summed over ``tensors()``."""

    @property
    def lead(self) -> torch.Tensor:
        """A ``[B, Hkv, ...]`` buffer every store of the class has."""
        raise NotImplementedError

    def tensors(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @property
    def batch(self) -> int:
        return self.lead.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.lead.shape[1]

    @property
    def device(self) -> torch.device:
        return self.lead.device

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass
class KVStore(StoreBuffers):
    """Static buffers of one K or V tensor: ``codes [B, Hkv, T, D * bits / 8]`` plus scales/zeros.

    ``scale``/``zero`` are ``None`` (bf16), ``[B, Hkv, T]`` (fp8) or ``[B, Hkv, T, D / group]`` (int).
    """

    format: KVFormat
    codes: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    head_dim: int

    @property
    def lead(self) -> torch.Tensor:
        return self.codes

    @property
    def capacity(self) -> int:
        return self.codes.shape[2]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.codes, self.scale, self.zero) if t is not None)

    def codes_as(self, dtype: torch.dtype | None) -> torch.Tensor:
        """The codes viewed as ``dtype`` (their bits unchanged; None: as stored)."""
        return self.codes if dtype is None else self.codes.view(dtype)

    def dequantize(self, length: int | None = None) -> torch.Tensor:
        return self.format.dequantize(self, length)

    def rows(self, rows: slice) -> KVStore:
        """Batch rows ``rows`` of this store, as views of its buffers: writing into the result writes
        into this store (each tensor stays contiguous, so the write kernel takes it too)."""
        if rows.step not in (None, 1):
            raise FormatError(f"rows must be a contiguous slice of batch rows, got a step of {rows.step}")
        start, stop, _ = rows.indices(self.batch)
        if start >= stop:
            raise FormatError(f"rows {start}:{stop} hold no batch row of a store of {self.batch}")
        return KVStore(self.format, *(t[start:stop] if t is not None else None
                                      for t in (self.codes, self.scale, self.zero)), self.head_dim)


class KVFormat:
    """Base class: subclasses set ``name``/``bits``/``kernel`` and implement the four hooks below."""

    name: ClassVar[str]
    bits: ClassVar[int]
    kernel: ClassVar[int | None] = None  # the FMT code of the Triton kernels (None: torch reference only)
    read_dtype: ClassVar[torch.dtype | None] = None  # the decode kernels read the codes viewed as this
    write_dtype: ClassVar[torch.dtype | None] = None  # the append kernel writes the codes' bits as this
    asm_unpack: ClassVar[bool] = False  # the fold kernel may unpack the codes with inline PTX (fold_asm)

    # -- hooks ------------------------------------------------------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        if head_dim <= 0 or head_dim % 16:
            raise FormatError(f"head_dim {head_dim} must be a positive multiple of 16")

    def empty(self, batch: int, kv_heads: int, capacity: int, head_dim: int,
              device: torch.device | str) -> KVStore:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> KVStore:
        raise NotImplementedError

    def _dequantize(self, store: KVStore, length: int) -> torch.Tensor:
        raise NotImplementedError

    def token_bytes(self, head_dim: int) -> int:
        """Bytes of one token of one KV head."""
        raise NotImplementedError

    # -- shared behaviour -------------------------------------------------------------------------
    @property
    def label(self) -> str:
        return self.name

    @property
    def pack(self) -> int:
        """Codes per byte (1: one code per element)."""
        return 1

    @property
    def half_scales(self) -> bool:
        """Whether scales and zeros are float16 (the append kernel rounds them toward safety)."""
        return False

    def group_size(self, head_dim: int) -> int:
        """Elements of the head dim sharing one scale (one per token: ``head_dim``)."""
        return head_dim

    def fold_reads(self, head_dim: int) -> bool:
        """Whether the ``fold`` decode kernel reads this format at ``head_dim``."""
        return True

    def warp_reads(self, head_dim: int) -> bool:
        """Whether the ``warp`` decode kernel reads this format at ``head_dim`` (else it runs ``fold``)."""
        return False

    @property
    def launch_config(self) -> LaunchConfig:
        """The tuned launch geometry of the decode kernels (:data:`TUNED_CONFIGS`), else the defaults."""
        return TUNED_CONFIGS.get(self.label) or LaunchConfig()

    def read_codes(self, store: KVStore) -> torch.Tensor:
        return store.codes_as(self.read_dtype)

    def write_codes(self, store: KVStore) -> torch.Tensor:
        return store.codes_as(self.write_dtype)

    def alloc(self, batch: int, kv_heads: int, capacity: int, head_dim: int,
              device: torch.device | str = "cpu") -> KVStore:
        """Zeroed static buffers for ``capacity`` tokens (zero codes dequantize to zeros)."""
        for what, value in (("batch", batch), ("kv_heads", kv_heads), ("capacity", capacity)):
            if value < 1:
                raise FormatError(f"{what} must be >= 1, not {value}")
        self.check_head_dim(head_dim)
        return self.empty(batch, kv_heads, capacity, head_dim, device)

    def bytes_per_token(self, kv_heads: int, head_dim: int) -> int:
        """Bytes one token takes in one store (K or V of one layer), codes and scales."""
        self.check_head_dim(head_dim)
        return kv_heads * self.token_bytes(head_dim)

    def dequantize(self, store: KVStore, length: int | None = None) -> torch.Tensor:
        """The first ``length`` slots (default: all) as float32 ``[B, Hkv, length, D]``."""
        length = store.capacity if length is None else length
        if not 0 <= length <= store.capacity:
            raise FormatError(f"length {length} outside the store's capacity {store.capacity}")
        return self._dequantize(store, length)

    def write(self, store: KVStore, x: torch.Tensor, positions: torch.Tensor) -> None:
        """Quantize ``x [B, Hkv, n, D]`` into slots ``positions`` (``[n]`` or ``[B, n]``, on device)."""
        self.check_write(store, x, positions)
        if positions.dtype != torch.int64:
            positions = positions.to(torch.int64)
        new = self.quantize(x)
        for dst, src in zip(store.tensors(), new.tensors(), strict=True):
            _put_slots(dst, src, positions)

    def check_write(self, store: KVStore, x: torch.Tensor, positions: torch.Tensor) -> None:
        """The shapes and devices a write takes (host-side metadata only: checking the slot values
        would need a sync)."""
        if x.dim() != 4 or x.shape[:2] != store.codes.shape[:2] or x.shape[3] != store.head_dim:
            raise FormatError(f"write expects [B={store.batch}, Hkv={store.kv_heads}, n, D={store.head_dim}], "
                              f"got {list(x.shape)}")
        n = x.shape[2]
        if positions.shape not in ((n,), (store.batch, n)):
            raise FormatError(f"positions must be [n={n}] or [B={store.batch}, n={n}], got {list(positions.shape)}")
        if positions.device != store.device or x.device != store.device:
            raise FormatError(f"x, positions and the store must share a device ({store.device}); "
                              f"got x on {x.device}, positions on {positions.device}")


def _put_slots(dst: torch.Tensor, src: torch.Tensor, positions: torch.Tensor) -> None:
    """``dst[:, :, positions] = src`` along dim 2, with one slot list or one per batch row."""
    if dst.dtype == torch.float8_e4m3fn:  # index_copy_/scatter_ have no fp8 kernels: move the bytes
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    if positions.dim() == 1:
        dst.index_copy_(2, positions, src)
        return
    batch, n = positions.shape
    index = positions.view(batch, 1, n, *([1] * (src.dim() - 3))).expand_as(src)
    dst.scatter_(2, index, src)


class BF16Format(KVFormat):
    """Plain bfloat16: the baseline the quantized formats are compared with."""

    name = "bf16"
    bits = 16
    kernel = FMT_BF16
    write_dtype = torch.int16

    def empty(self, batch, kv_heads, capacity, head_dim, device):
        codes = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=torch.bfloat16, device=device)
        return KVStore(self, codes, None, None, head_dim)

    def quantize(self, x):
        return KVStore(self, x.to(torch.bfloat16), None, None, x.shape[-1])

    def _dequantize(self, store, length):
        return store.codes[:, :, :length].float()

    def token_bytes(self, head_dim):
        return 2 * head_dim


class FP8Format(KVFormat):
    """float8_e4m3fn codes with one float32 scale per token and KV head, saturating at +-448."""

    name = "fp8"
    bits = 8
    kernel = FMT_FP8
    read_dtype = write_dtype = torch.uint8  # triton reads fp8 codes as bytes and bitcasts them

    def empty(self, batch, kv_heads, capacity, head_dim, device):
        codes = torch.zeros(batch, kv_heads, capacity, head_dim, dtype=torch.float8_e4m3fn, device=device)
        scale = torch.zeros(batch, kv_heads, capacity, dtype=torch.float32, device=device)
        return KVStore(self, codes, scale, None, head_dim)

    def quantize(self, x):
        xf = x.float()
        scale = xf.abs().amax(-1).clamp_min(1e-30) / FP8_MAX
        codes = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return KVStore(self, codes, scale, None, x.shape[-1])

    def _dequantize(self, store, length):
        return store.codes[:, :, :length].float() * store.scale[:, :, :length].unsqueeze(-1)

    def warp_reads(self, head_dim: int) -> bool:
        return True

    def token_bytes(self, head_dim):
        return head_dim + 4


class IntFormat(KVFormat):
    """Asymmetric ``bits``-bit integers, a scale and a zero per ``group`` elements of the head dim."""

    kernel = FMT_INT

    def __init__(self, group: int = 64, scale_dtype: torch.dtype = torch.float16):
        if group not in GROUPS:
            raise FormatError(f"group must be one of {GROUPS}, not {group!r}")
        if scale_dtype not in (torch.float16, torch.float32):
            raise FormatError(f"scale_dtype must be torch.float16 or torch.float32, not {scale_dtype}")
        self.group = group
        self.scale_dtype = scale_dtype

    @property
    def label(self) -> str:
        return format_label(self.name, self.group)

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def pack(self) -> int:
        return packing.codes_per_byte(self.bits)

    @property
    def half_scales(self) -> bool:
        return self.scale_dtype == torch.float16

    def group_size(self, head_dim: int) -> int:
        return self.group

    def fold_reads(self, head_dim: int) -> bool:
        """Per-group products at least 16 deep, at most 8 slices of q."""
        return self.group // self.pack >= 16 and (head_dim // self.group) * self.pack <= 8

    def __repr__(self) -> str:
        return f"{type(self).__name__}(group={self.group}, scale_dtype={self.scale_dtype})"

    def check_head_dim(self, head_dim):
        super().check_head_dim(head_dim)
        if head_dim % self.group:
            fits = [g for g in GROUPS if head_dim % g == 0]
            fix = (f"pick a group (q_group_size) from {', '.join(map(str, fits))}" if fits else
                   f"no group this format has ({', '.join(map(str, GROUPS))}) divides it; store it with a format "
                   f"without groups (kvq-fp8) or quanto/hqq with q_group_size {head_dim}")
            raise FormatError(f"head_dim {head_dim} is not a multiple of group {self.group}; {fix}")

    def empty(self, batch, kv_heads, capacity, head_dim, device):
        codes = torch.zeros(batch, kv_heads, capacity, head_dim * self.bits // 8, dtype=torch.uint8, device=device)
        groups = (batch, kv_heads, capacity, head_dim // self.group)
        scale = torch.zeros(groups, dtype=self.scale_dtype, device=device)
        zero = torch.zeros(groups, dtype=self.scale_dtype, device=device)
        return KVStore(self, codes, scale, zero, head_dim)

    def quantize(self, x):
        self.check_head_dim(x.shape[-1])
        xg = x.float().unflatten(-1, (x.shape[-1] // self.group, self.group))
        low, high = xg.amin(-1), xg.amax(-1)
        zero = round_toward(low, self.scale_dtype, down=True)
        scale = round_toward((high - zero.float()) / self.levels, self.scale_dtype, down=False)
        inv = torch.where(scale > 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
        # floor(v + 0.5), not round-half-even: the same steps as the Triton write kernel
        codes = ((xg - zero.float().unsqueeze(-1)) * inv.unsqueeze(-1) + 0.5).floor().clamp(0, self.levels)
        return KVStore(self, packing.pack(codes.flatten(-2), self.bits), scale, zero, x.shape[-1])

    def _dequantize(self, store, length):
        codes = packing.unpack(store.codes[:, :, :length], self.bits).float()
        codes = codes.unflatten(-1, (store.head_dim // self.group, self.group))
        scale = store.scale[:, :, :length].float().unsqueeze(-1)
        zero = store.zero[:, :, :length].float().unsqueeze(-1)
        return (codes * scale + zero).flatten(-2)

    def token_bytes(self, head_dim):
        groups = head_dim // self.group
        return head_dim * self.bits // 8 + 2 * groups * torch.finfo(self.scale_dtype).bits // 8


class Int4Format(IntFormat):
    name = "int4"
    bits = 4
    asm_unpack = True

    def warp_reads(self, head_dim: int) -> bool:
        return self.fold_reads(head_dim)


class Int2Format(IntFormat):
    name = "int2"
    bits = 2


def round_toward(x: torch.Tensor, dtype: torch.dtype, down: bool) -> torch.Tensor:
    """``x`` (float32) cast to ``dtype`` rounding down (or up) instead of to nearest."""
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    bound = torch.full_like(y, float("-inf") if down else float("inf"))
    wrong = y.float() > x if down else y.float() < x
    return torch.where(wrong, torch.nextafter(y, bound), y)


FORMATS: dict[str, type[KVFormat]] = {cls.name: cls for cls in (BF16Format, FP8Format, Int4Format, Int2Format)}


def make_format(name: str, group: int | None = None, **kwargs) -> KVFormat:
    """The format called ``name``; ``group`` (int formats only) defaults to 64."""
    if name not in FORMATS:
        raise FormatError(f"unknown KV format {name!r}; formats: {', '.join(FORMATS)}")
    cls = FORMATS[name]
    if issubclass(cls, IntFormat):
        return cls(group=64 if group is None else group, **kwargs)
    if group is not None or kwargs:
        raise FormatError(f"format {name} takes no group or other parameters (only {', '.join(_int_names())} do)")
    return cls()


def _int_names() -> list[str]:
    return [n for n, c in FORMATS.items() if issubclass(c, IntFormat)]


def format_label(name: str, group: int | None = None) -> str:
    """The label of format ``name`` with quantization ``group`` (int formats): ``fp8``, ``int4-g64``."""
    return name if group is None else f"{name}{GROUP_MARK}{group}"


def parse_format(label: str) -> KVFormat:
    """The format a label names (:func:`format_label`'s inverse): ``fp8``, ``int4-g64``."""
    name, mark, group = label.partition(GROUP_MARK)
    if not mark:
        return make_format(name)
    if not group.isdigit():
        raise FormatError(f"format {label!r}: the group after {GROUP_MARK!r} must be a number such as {GROUPS[1]}")
    return make_format(name, int(group))
