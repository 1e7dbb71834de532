"""Pack low-bit integer codes along the last dimension: ``8 // bits`` codes per byte.

Byte ``j`` holds elements ``j * per_byte + p`` at bits ``[bits * p, bits * (p + 1))``, lowest first,
so a kernel that reads byte ``j`` gets neighbouring elements of the head dimension (the same
quantization group). Pure functions; the Triton kernels unpack the same layout.
"""

from __future__ import annotations

import torch


def codes_per_byte(bits: int) -> int:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, not {bits!r}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D]`` integer codes in ``[0, 2**bits)`` -> ``[..., D * bits // 8]`` uint8."""
    per_byte = codes_per_byte(bits)
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dimension {codes.shape[-1]} is not a multiple of {per_byte} ({bits}-bit codes)")
    grouped = codes.to(torch.int32).unflatten(-1, (codes.shape[-1] // per_byte, per_byte))
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., D * bits // 8]`` uint8 -> ``[..., D]`` uint8 codes (inverse of :func:`pack`)."""
    per_byte = codes_per_byte(bits)
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2).to(torch.uint8)
