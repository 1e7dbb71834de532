"""The ``split`` variant of :mod:`kvlab.kernels.decode`'s kernel (imports triton; import this lazily): its
body, :func:`split_partial`, which :func:`kvlab.kernels.decode_entry.decode_kernel` runs.

Flash-decoding in two launches:

1. ``decode_kernel`` (``VARIANT="split"``), grid ``(B * Hkv, num_splits)``: one program reads one KV head's slots
   ``[split * split_len, min((split + 1) * split_len, length))`` once for all ``G = Hq / Hkv`` query
   heads of that KV head (``BLOCK_H >= 16`` rows, the unused ones masked, so both products are
   ``tl.dot`` on tensor cores), keeps an online softmax in float32 and writes the split's normalized
   output and log-sum-exp (base 2). A split that starts past the row's length runs zero iterations.
2. ``decode_reduce_kernel`` (:mod:`kvlab.kernels.decode_reduce`), grid ``(B * Hq,)``: merges the splits that saw tokens
   (``cdiv(length, split_len)`` of them) with their log-sum-exps.

The grid depends only on B, Hkv and the static capacity, the length is read on the device: the pair
is CUDA-graph capturable. Shape integers are not specialized (``do_not_specialize``), so one compiled
kernel per format, head dim and ``BLOCK_H`` serves every batch, capacity and split count.

Codes are read directly. fp8 (passed as uint8 and bitcast): the key scale multiplies the score
after the product, the value scale multiplies the value tile. int4/int2: each byte holds ``PACK``
neighbouring elements of the head dim; plane ``p`` (bits ``[p * BITS, (p + 1) * BITS)`` of every
byte) holds elements ``j * PACK + p``, so each plane is dequantized (one scale and zero per group,
shared by the plane's neighbours) and multiplied with the matching strided slice of q, and the
output planes are stored back strided. No interleaving in registers.
Both products run on float16 operands (bf16 tiles too: 11 bits of mantissa hold bf16's 8, and
triton's interpreter multiplies bf16 as raw integers), accumulating in float32; this assumes
``|q|, |k|, |v| < 6.5e4``, as K and V activations are.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_reduce import (
    dense_key_scores,
    query_planes,
    slot_block,
    split_result,
    split_state,
    store_plane,
)
from kvlab.kernels.jit_constants import FMT_FP8, FMT_INT


@triton.jit
def int_plane(raw, scale, zero, P: tl.constexpr, BITS: tl.constexpr):
    codes = (raw >> (P * BITS)) & ((1 << BITS) - 1)
    return (codes.to(tl.float32) * scale + zero).to(tl.float16)


@triton.jit
def split_partial(
    bh, split, b, h, start, end,
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, Hq, T, num_splits, G,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, QGROUP: tl.constexpr,
):
    """The ``split`` variant's split ``split`` of KV head ``bh`` (slots ``[start, end)``): its normalized
    partial output and base-2 log-sum-exp. :func:`kvlab.kernels.decode_entry.decode_kernel` calls it."""

    DP: tl.constexpr = D // PACK  # bytes (int) or elements (bf16/fp8) per plane of a row
    NG: tl.constexpr = D // QGROUP  # quantization groups per row (int formats)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = h * G + offs_h
    offs_j = tl.arange(0, DP)
    q_rows = q_ptr + (b * Hq + heads) * D

    q0, q1, q2, q3 = query_planes(q_rows, offs_j, mask_h, PACK, tl.float16)

    m_i, l_i, acc0, acc1, acc2, acc3 = split_state(BLOCK_H, DP)
    row0 = bh.to(tl.int64) * T  # first slot of this (b, h) in [B, Hkv, T, ...] buffers

    for n0 in range(start, end, BLOCK_N):
        mask_n, slots = slot_block(row0, n0, end, BLOCK_N)
        tile = slots[:, None] * DP + offs_j[None, :]
        if FMT == FMT_INT:
            groups = slots[:, None] * NG + offs_j[None, :] // (QGROUP // PACK)
            k_raw = tl.load(kc_ptr + tile, mask=mask_n[:, None], other=0).to(tl.int32)
            k_sc = tl.load(ks_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            k_zr = tl.load(kz_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q0, tl.trans(int_plane(k_raw, k_sc, k_zr, 0, BITS)))
            s += tl.dot(q1, tl.trans(int_plane(k_raw, k_sc, k_zr, 1, BITS)))
            if PACK == 4:
                s += tl.dot(q2, tl.trans(int_plane(k_raw, k_sc, k_zr, 2, BITS)))
                s += tl.dot(q3, tl.trans(int_plane(k_raw, k_sc, k_zr, 3, BITS)))
            s = s * qk_scale
        else:
            s = dense_key_scores(kc_ptr + tile, ks_ptr, slots, mask_n, q0, qk_scale, FMT)
        s = tl.where(mask_n[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(tl.float16)

        if FMT == FMT_INT:
            v_raw = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0).to(tl.int32)
            v_sc = tl.load(vs_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            v_zr = tl.load(vz_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, int_plane(v_raw, v_sc, v_zr, 0, BITS))
            acc1 = acc1 * alpha[:, None] + tl.dot(p, int_plane(v_raw, v_sc, v_zr, 1, BITS))
            if PACK == 4:
                acc2 = acc2 * alpha[:, None] + tl.dot(p, int_plane(v_raw, v_sc, v_zr, 2, BITS))
                acc3 = acc3 * alpha[:, None] + tl.dot(p, int_plane(v_raw, v_sc, v_zr, 3, BITS))
        elif FMT == FMT_FP8:
            v_raw = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0)
            v_sc = tl.load(vs_ptr + slots, mask=mask_n, other=0.0)
            v = (v_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_sc[:, None]).to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, v)
        else:
            v = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0.0).to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, v)

    inv_l, lse = split_result(m_i, l_i)
    part = (b * Hq + heads) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=mask_h)
    out_rows = part_out_ptr + part.to(tl.int64) * D
    store_plane(out_rows, offs_j, mask_h, acc0, inv_l, 0, PACK)
    if PACK >= 2:
        store_plane(out_rows, offs_j, mask_h, acc1, inv_l, 1, PACK)
    if PACK == 4:
        store_plane(out_rows, offs_j, mask_h, acc2, inv_l, 2, PACK)
        store_plane(out_rows, offs_j, mask_h, acc3, inv_l, 3, PACK)
