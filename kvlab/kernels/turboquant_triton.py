"""A fused decode kernel for rotated codebook K/V (:mod:`kvlab.kernels.turboquant`): it reads the packed
codes and the float32 norms, looks the codes up in the codebook (renormalizing the centroid vector
with norm correction) and runs an online softmax over the slots, all in registers; the query comes
in rotated and the output leaves in the rotated basis (the caller rotates it back once).

One program per (row, query head); slots in blocks of ``BLOCK_N``. Codes of ``BITS`` bits are packed
low bit first (:func:`kvlab.kernels.turboquant.pack_bits`); a code may straddle two bytes, so each is
read as a 16-bit window. Key and value codebooks only (the 4bit, k3v4 and 3bit presets); k8v4's FP8
keys stay on the torch reference. Tested in the Triton interpreter against
:func:`kvlab.kernels.turboquant.rotated_decode`; not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvlab.kernels.online_softmax import online_softmax_block


@triton.jit
def _codes(ptr, rows, cols, row_bytes, n_bytes, BITS: tl.constexpr):
    """Codes at (rows, cols) of a ``[slots, row_bytes]`` packed array, as int32."""
    bit = cols * BITS
    byte = bit // 8
    shift = bit % 8
    base = ptr + rows[:, None] * row_bytes + byte[None, :]
    lo = tl.load(base).to(tl.int32)
    hi = tl.load(base + 1, mask=(byte[None, :] + 1) < n_bytes, other=0).to(tl.int32)
    return ((lo | (hi << 8)) >> shift[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _vectors(codes_ptr, norm_ptr, table_ptr, rows, cols, row_bytes, NC: tl.constexpr, BITS: tl.constexpr):
    c = tl.load(table_ptr + _codes(codes_ptr, rows, cols, row_bytes, row_bytes, BITS))
    norm = tl.load(norm_ptr + rows)
    if NC:
        c = c / tl.maximum(tl.sqrt(tl.sum(c * c, axis=1)), 1e-12)[:, None]
    return c * norm[:, None]


@triton.jit
def _decode_kernel(q_ptr, kc_ptr, kn_ptr, vc_ptr, vn_ptr, ktab_ptr, vtab_ptr, out_ptr, used_ptr, scale,
                   n_heads, groups, cap, k_row_bytes, v_row_bytes,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
                   K_NC: tl.constexpr, V_NC: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // n_heads
    head = pid % n_heads
    seg = row * (n_heads // groups) + head // groups  # the (row, KV head) segment of C slots
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + pid * D + cols)
    used = tl.load(used_ptr + row)
    m = tl.full((), float("-inf"), tl.float32)
    denom = tl.zeros((), tl.float32)
    acc = tl.zeros((D,), tl.float32)
    for start in range(0, cap, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        rows = seg * cap + tl.minimum(slots, cap - 1)
        k = _vectors(kc_ptr, kn_ptr, ktab_ptr, rows, cols, k_row_bytes, K_NC, K_BITS)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(slots < used, s, float("-inf"))
        v = _vectors(vc_ptr, vn_ptr, vtab_ptr, rows, cols, v_row_bytes, V_NC, V_BITS)
        m, denom, acc = online_softmax_block(m, denom, acc, s, v)
    tl.store(out_ptr + pid * D + cols, acc / denom)


def fused_rotated_decode(q: torch.Tensor, key_parts, value_parts, used: torch.Tensor, rot: torch.Tensor,
                         scale: float, key_book, value_book, block_n: int = 16) -> torch.Tensor:
    """What :func:`kvlab.kernels.turboquant.rotated_decode` computes, reading the codes in the kernel:
    ``q [B, Hq, 1, D]``; ``key_parts``/``value_parts`` (packed codes ``[B, Hkv, C, D bits / 8]``, norms
    ``[B, Hkv, C, 1]``); ``used`` the slots attended (``[1]`` or ``[B]``); float32 ``[B, Hq, D]``."""
    bsz, n_heads, _, d = q.shape
    kc, kn = key_parts
    vc, vn = value_parts
    n_kv, cap = kc.shape[1], kc.shape[2]
    groups = n_heads // n_kv
    qr = torch.matmul(q.float().reshape(bsz, n_kv, groups, d), rot).reshape(bsz * n_heads, d).contiguous()
    out = torch.empty_like(qr)
    used = used.to(torch.int32).expand(bsz).contiguous()
    ktab = key_book.tables(d, q.device)[0]
    vtab = value_book.tables(d, q.device)[0]
    _decode_kernel[(bsz * n_heads,)](
        qr, kc.contiguous(), kn.contiguous(), vc.contiguous(), vn.contiguous(), ktab, vtab, out, used, scale,
        n_heads, groups, cap, kc.shape[-1], vc.shape[-1],
        D=d, BLOCK_N=block_n, K_BITS=key_book.bits, V_BITS=value_book.bits,
        K_NC=key_book.norm_correction, V_NC=value_book.norm_correction)
    back = torch.matmul(out.view(bsz, n_kv, groups, d), rot.transpose(-1, -2))
    return back.reshape(bsz, n_heads, d)
