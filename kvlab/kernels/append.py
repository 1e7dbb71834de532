"""Quantize-on-write in one launch: Triton on CUDA, ``KVFormat.write`` (the reference) elsewhere.

    quantize_write(store, x, positions)   # x [B, Hkv, n, D]; positions [n] or [B, n] on the device

Same contract as :meth:`kvlab.kernels.formats.KVFormat.write`: fixed-shape, no host sync, so a
CUDA graph can capture it (call once before capturing: triton compiles on the first call). Some
batch rows only: pass ``store.rows(slice(r0, r1))`` (views of the same contiguous buffers).
"""

from __future__ import annotations

import torch

from kvlab.kernels.formats import FormatError, KVStore
from kvlab.kernels.key_offset import shifted

BACKENDS = ("auto", "triton", "reference")


def quantize_write(store: KVStore, x: torch.Tensor, positions: torch.Tensor, backend: str = "auto",
                   offset: torch.Tensor | None = None) -> None:
    """Quantize ``x [B, Hkv, n, D]`` (minus ``offset [B, Hkv, D]`` float32, if given: a key offset,
    :mod:`kvlab.kernels.key_offset`) into ``store``'s slots ``positions``."""
    if backend not in BACKENDS:
        raise FormatError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    fmt = store.format
    if offset is not None and (offset.shape != (*x.shape[:2], x.shape[3]) or offset.dtype != torch.float32
                               or not offset.is_contiguous()):
        raise FormatError(f"offset must be a contiguous float32 [B, Hkv, D] = {[*x.shape[:2], x.shape[3]]}, "
                          f"got {offset.dtype} {list(offset.shape)}")
    if backend == "reference" or (backend == "auto" and not x.is_cuda):
        fmt.write(store, shifted(x, offset), positions)
        return
    fmt.check_write(store, x, positions)
    if fmt.kernel is None:
        raise FormatError(f"no write kernel for format {fmt.name}; use backend='reference'")
    batch, kv_heads, n, dim = x.shape
    if x.stride(3) != 1 or not positions.is_contiguous() or not all(t.is_contiguous() for t in store.tensors()):
        raise FormatError("quantize_write needs x with a unit stride along D, contiguous positions and store")
    if dim & (dim - 1):
        raise FormatError(f"the write kernel needs a power-of-two head_dim, not {dim}; use backend='reference'")
    try:
        from kvlab.kernels.append_kernel import quantize_write_kernel  # imports triton
    except ImportError as err:
        raise RuntimeError(f"the write kernel needs triton ({err}); install it or pass backend='reference'") from err

    codes = fmt.write_codes(store)  # fp8 and bf16 codes are written as their bits
    scale = store.scale if store.scale is not None else codes  # unused pointers for bf16
    zero = store.zero if store.zero is not None else scale
    quantize_write_kernel[(batch * kv_heads * n,)](
        x, positions, codes, scale, zero, offset if offset is not None else scale,
        kv_heads, n, store.capacity, x.stride(0), x.stride(1), x.stride(2), n if positions.dim() == 2 else 0,
        D=dim, FMT=fmt.kernel, BITS=fmt.bits, PACK=fmt.pack, QGROUP=fmt.group_size(dim), SCALE_F16=fmt.half_scales,
        OFFSET=offset is not None,
        num_warps=1 if dim <= 64 else 2,
    )
