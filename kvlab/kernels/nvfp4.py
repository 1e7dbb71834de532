"""NVFP4 for K/V, the torch reference: E2M1 codes (two per byte), an FP8 E4M3 scale per 16 values and a
float32 second-level scale per token and KV head.

NVFP4 (NVIDIA's Blackwell 4-bit format) stores ``x ~ e2m1 * e4m3_block_scale * fp32_second_scale``.
The E2M1 grid is ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` with a sign bit; the block scale is an E4M3 float
(largest 448) per 16 consecutive values. NVFP4 defines the second level per tensor; a KV cache is
written a token at a time, so no tensor's amax is known when its first token is stored. This
reference takes the second level **per token and KV head** (``amax / (6 * 448)``: the block holding
the token's amax gets block scale 448 before E4M3 rounding), 4 bytes per token and head, computed from
the token alone like kvq-fp8's scale. A static per-tensor scale (calibrated, as serving engines load
one from a checkpoint) would save those 4 bytes: at head dim 128 the store is 64 + 8 + 4 bytes per
vector instead of 64 + 8.

Rounding: values to the nearest E2M1 point, ties to the even code (:func:`e2m1_round`); the block
scale by torch's float8_e4m3fn cast (round to nearest even, saturating at 448 here by a clamp).
Values above the grid after the E4M3 rounding of their scale saturate at +-6.

``four_over_six``: per block, also try scaling its amax to 4 instead of 6 (the grid near the top is
then 3, 4 rather than 4, 6) and keep whichever reconstructs the block with the smaller squared error
(Cook et al., "Four Over Six: More Accurate NVFP4 Quantization with Adaptive Block Scaling",
arXiv:2512.02010: evaluate both scales per block, keep the one with the lower error). Here the error is
the block's squared error, and the second level becomes ``amax / (4 * 448)`` so that the scale-to-4
choice never overflows E4M3; the paper's own second-level rule was not read. Cost: one more
quantization per block at write time, no bytes.

Serving engines' NVFP4 KV (e.g. vLLM's pull request #37192) keep the second level per tensor, loaded
from a checkpoint or derived dynamically; the per-token choice here is the difference.

Hardware: on Hopper a decode kernel reads these bytes and decodes in registers (E2M1 lookup times the
E4M3 scale), then does bf16 math: the bytes read are NVFP4's, the math is not. Blackwell's tensor cores
(``mxf4nvf4`` MMA) take E2M1 operands with their E4M3 block scales natively. This module is the CPU
reference only: dequantize, then attend.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 16  # values per E4M3 scale
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; bit 3 is the sign
E4M3_MAX = 448.0


def e2m1_values(device="cpu") -> torch.Tensor:
    """The 16 code values (codes 8..15 negative), float32."""
    return grid_tables(str(device))[0]


@functools.cache
def grid_tables(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the 16 code values, the 8 magnitudes, the 7 midpoints between them) on ``device``, made once per
    device, so a step (and a captured CUDA graph) only reads them."""
    grid = torch.tensor(E2M1_GRID, device=device)
    return torch.cat([grid, -grid]), grid, (grid[1:] + grid[:-1]) / 2


def e2m1_round(a: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of the E2M1 points nearest to ``a`` (ties to the even code), saturating at +-6."""
    _, _, mids = grid_tables(str(a.device))
    mag = a.abs().float().clamp(max=6.0).contiguous()
    idx = torch.bucketize(mag, mids)  # a tie lands on the lower point ...
    upper = idx.clamp(max=len(mids) - 1)
    tie = (mag == mids[upper]) & (idx == upper) & (upper % 2 == 1)  # ... and moves up when the upper code is even
    idx = idx + tie.long()
    sign = (a < 0) & (idx > 0)
    return (idx + 8 * sign.long()).to(torch.uint8)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` codes 0..15 -> ``[..., D / 2]`` bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def block_codes(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 codes of ``x [..., nb, 16]`` under per-block scales ``scale [..., nb, 1]`` (already E4M3-rounded,
    times the second level), and the squared error of each block's reconstruction."""
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = e2m1_round(x / safe)
    recon = e2m1_values(x.device)[codes.long()] * scale
    return codes, (recon - x).square().sum(-1, keepdim=True)


def quantize(x: torch.Tensor, four_over_six: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (D a multiple of 16) -> (codes uint8 ``[..., D/2]``, E4M3 block scales as uint8
    ``[..., D/16]``, float32 second-level scale ``[..., 1]``)."""
    x = x.float()
    *lead, d = x.shape
    blocks = x.reshape(*lead, d // BLOCK, BLOCK)
    top = 4.0 if four_over_six else 6.0
    amax = x.abs().amax(-1, keepdim=True)
    second = torch.where(amax > 0, amax / (top * E4M3_MAX), torch.ones_like(amax))
    block_amax = blocks.abs().amax(-1, keepdim=True)
    targets = (6.0, 4.0) if four_over_six else (6.0,)
    best = None
    for target in targets:
        fp8 = (block_amax / (target * second.unsqueeze(-1))).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        codes, err = block_codes(blocks, fp8.float() * second.unsqueeze(-1))
        if best is None:
            best = (codes, fp8, err)
        else:
            better = err < best[2]
            best = (torch.where(better, codes, best[0]), torch.where(better, fp8.float(), best[1].float())
                    .to(torch.float8_e4m3fn), torch.minimum(err, best[2]))
    codes, fp8, _ = best
    return pack_nibbles(codes.reshape(*lead, d)), fp8.squeeze(-1).view(torch.uint8), second


def dequantize(codes: torch.Tensor, scales: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., D]`` from :func:`quantize`'s three tensors."""
    values = e2m1_values(codes.device)[unpack_nibbles(codes).long()]
    *lead, d = values.shape
    block = scales.view(torch.float8_e4m3fn).float().unsqueeze(-1) * second.unsqueeze(-1)
    return (values.reshape(*lead, d // BLOCK, BLOCK) * block).reshape(*lead, d)


def token_bytes(head_dim: int) -> int:
    """Bytes of one vector: codes, E4M3 block scales, the float32 second level."""
    return head_dim // 2 + head_dim // BLOCK + 4
