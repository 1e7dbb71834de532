"""Quantize-on-write in one launch: Triton on CUDA, ``KVFormat.write`` (the reference) elsewhere.

    quantize_write(store, x, positions)   # x [B, Hkv, n, D]; positions [n] or [B, n] on the device

Same contract as :meth:`kvlab.kernels.formats.KVFormat.write`: fixed-shape, no host sync, so a
CUDA graph can capture it (call once before capturing: triton compiles on the first call). Some
batch rows only: pass ``store.rows(slice(r0, r1))`` (views of the same contiguous buffers).
"""

from __future__ import annotations

import torch

from kvlab.kernels.formats import BF16Format, FormatError, FP8Format, IntFormat, KVStore

BACKENDS = ("auto", "triton", "reference")


def quantize_write(store: KVStore, x: torch.Tensor, positions: torch.Tensor, backend: str = "auto") -> None:
    """Quantize ``x [B, Hkv, n, D]`` into ``store``'s slots ``positions``."""
    if backend not in BACKENDS:
        raise FormatError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    fmt = store.format
    if backend == "reference" or (backend == "auto" and not x.is_cuda):
        fmt.write(store, x, positions)
        return
    if x.dim() != 4 or x.shape[:2] != store.codes.shape[:2] or x.shape[3] != store.head_dim:
        raise FormatError(f"write expects [B={store.batch}, Hkv={store.kv_heads}, n, D={store.head_dim}], "
                          f"got {list(x.shape)}")
    batch, kv_heads, n, dim = x.shape
    if positions.shape not in ((n,), (batch, n)):
        raise FormatError(f"positions must be [n={n}] or [B={batch}, n={n}], got {list(positions.shape)}")
    if x.device != store.device or positions.device != store.device:
        raise FormatError(f"x, positions and the store must share a device ({store.device}); "
                          f"got x on {x.device}, positions on {positions.device}")
    if x.stride(3) != 1 or not positions.is_contiguous() or not all(t.is_contiguous() for t in store.tensors()):
        raise FormatError("quantize_write needs x with a unit stride along D, contiguous positions and store")
    if dim & (dim - 1):
        raise FormatError(f"the write kernel needs a power-of-two head_dim, not {dim}; use backend='reference'")
    try:
        from kvlab.kernels import _write_kernels as kern  # imports triton
    except ImportError as err:
        raise RuntimeError(f"the write kernel needs triton ({err}); install it or pass backend='reference'") from err

    if isinstance(fmt, IntFormat):
        kind, bits, pack, group = 2, fmt.bits, 8 // fmt.bits, fmt.group
    elif isinstance(fmt, FP8Format):
        kind, bits, pack, group = 1, 8, 1, dim
    elif isinstance(fmt, BF16Format):
        kind, bits, pack, group = 0, 16, 1, dim
    else:
        raise FormatError(f"no write kernel for format {fmt.name}; use backend='reference'")
    codes = store.codes  # fp8 and bf16 codes are written as their bits
    if codes.dtype == torch.float8_e4m3fn:
        codes = codes.view(torch.uint8)
    elif codes.dtype == torch.bfloat16:
        codes = codes.view(torch.int16)
    scale = store.scale if store.scale is not None else codes  # unused pointers for bf16
    zero = store.zero if store.zero is not None else scale
    kern._quantize_write_kernel[(batch * kv_heads * n,)](
        x, positions, codes, scale, zero,
        kv_heads, n, store.capacity, x.stride(0), x.stride(1), x.stride(2), n if positions.dim() == 2 else 0,
        D=dim, FMT=kind, BITS=bits, PACK=pack, QGROUP=group,
        SCALE_F16=isinstance(fmt, IntFormat) and fmt.scale_dtype == torch.float16,
        num_warps=1 if dim <= 64 else 2,
    )
