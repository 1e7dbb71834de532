"""A fused decode kernel for NVFP4 K/V (:mod:`kvlab.kernels.nvfp4`): it reads the packed E2M1 codes, the
E4M3 block scales and the float32 second level of each slot, decodes them in registers (the code's
grid value times its block's scale times the vector's second level) and runs an online softmax over
the slots. The bytes read are NVFP4's; the math is float32 on CUDA cores, as a Hopper kernel must do
it (Blackwell's tensor cores would take E2M1 operands with their E4M3 scales natively).

One program per (row, query head); slots in blocks of ``BLOCK_N``. E4M3 bytes are decoded by their
bit fields (sign, 4-bit exponent with bias 7, 3-bit mantissa; exponent 0 subnormal), which equals
torch's ``float8_e4m3fn`` for every finite code (a test checks all 256 but the two NaNs). Tested in
the Triton interpreter against the torch reference (dequantize, then attend); not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels import nvfp4
from kvlab.kernels.online_softmax import online_softmax_block


@triton.jit
def e4m3_value(bits):
    """float32 of E4M3 bytes given as int32 (finite codes)."""
    sign = (bits >> 7) & 1
    exp = (bits >> 3) & 15
    man = (bits & 7).to(tl.float32)
    normal = (1.0 + man / 8.0) * tl.exp2((exp - 7).to(tl.float32))
    value = tl.where(exp > 0, normal, man / 8.0 * 0.015625)  # subnormal: m/8 * 2^-6
    return tl.where(sign == 1, -value, value)


@triton.jit
def e4m3_kernel(bits_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Every byte of ``bits_ptr`` decoded by :func:`e4m3_value` (its test compares torch's cast)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    bits = tl.load(bits_ptr + idx, mask=idx < n, other=0).to(tl.int32)
    tl.store(out_ptr + idx, e4m3_value(bits), mask=idx < n)


@triton.jit
def nvfp4_vectors(codes_ptr, scales_ptr, second_ptr, grid_ptr, rows, cols, D: tl.constexpr):
    """float32 ``[len(rows), D]`` vectors of the slots ``rows``."""
    byte = tl.load(codes_ptr + rows[:, None] * (D // 2) + (cols // 2)[None, :]).to(tl.int32)
    code = (byte >> ((cols % 2) * 4)[None, :]) & 15  # the even element in the low nibble
    block = tl.load(scales_ptr + rows[:, None] * (D // 16) + (cols // 16)[None, :]).to(tl.int32)
    second = tl.load(second_ptr + rows)
    return tl.load(grid_ptr + code) * e4m3_value(block) * second[:, None]


@triton.jit
def nvfp4_decode_kernel(q_ptr, kc_ptr, ks_ptr, k2_ptr, vc_ptr, vs_ptr, v2_ptr, grid_ptr, out_ptr, used_ptr,
                        scale, n_heads, groups, cap, D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // n_heads
    head = pid % n_heads
    seg = row * (n_heads // groups) + head // groups  # the (row, KV head) segment of cap slots
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + pid * D + cols)
    used = tl.load(used_ptr + row)
    m = tl.full((), float("-inf"), tl.float32)
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for start in range(0, cap, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        rows = seg * cap + tl.minimum(slots, cap - 1)
        k = nvfp4_vectors(kc_ptr, ks_ptr, k2_ptr, grid_ptr, rows, cols, D)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(slots < used, s, float("-inf"))
        v = nvfp4_vectors(vc_ptr, vs_ptr, v2_ptr, grid_ptr, rows, cols, D)
        m, denom, acc = online_softmax_block(m, denom, acc, s, v)
    tl.store(out_ptr + pid * D + cols, acc / denom)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """float32 of uint8 E4M3 bytes through the kernel's decoder."""
    flat = bits.reshape(-1).contiguous()
    out = torch.empty(flat.shape, dtype=torch.float32, device=bits.device)
    e4m3_kernel[(triton.cdiv(flat.numel(), 256),)](flat, out, flat.numel(), BLOCK=256)
    return out.view(bits.shape)


def fused_nvfp4_decode(q: torch.Tensor, key_parts, value_parts, used: torch.Tensor, rot, scale: float,
                       block_n: int = 16) -> torch.Tensor:
    """Attention of ``q [B, Hq, 1, D]`` over the first ``used`` slots (``[1]`` or ``[B]``) of NVFP4 K/V
    (each ``(codes [B, Hkv, C, D/2], E4M3 scales as uint8 [B, Hkv, C, D/16], second level [B, Hkv, C, 1])``,
    :func:`kvlab.kernels.nvfp4.quantize`); float32 ``[B, Hq, D]``. ``rot`` must be None (NVFP4 keeps K/V
    unrotated); it is in the signature the codec stores call every fused decode with."""
    if rot is not None:
        raise ValueError("fused_nvfp4_decode reads unrotated NVFP4 K/V; a rotated store needs its own kernel")
    bsz, n_heads, _, d = q.shape
    kc, ks, k2 = key_parts
    vc, vs, v2 = value_parts
    n_kv, cap = kc.shape[1], kc.shape[2]
    qf = q.float().reshape(bsz * n_heads, d).contiguous()
    out = torch.empty_like(qf)
    used = used.to(torch.int32).expand(bsz).contiguous()
    nvfp4_decode_kernel[(bsz * n_heads,)](
        qf, kc.contiguous(), ks.contiguous(), k2.float().contiguous(), vc.contiguous(), vs.contiguous(),
        v2.float().contiguous(), nvfp4.e2m1_values(q.device), out, used, scale, n_heads, n_heads // n_kv, cap,
        D=d, BLOCK_N=block_n)
    return out.view(bsz, n_heads, d)
