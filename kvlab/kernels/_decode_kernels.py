"""Triton kernels of :mod:`kvlab.kernels.triton_decode` (imports triton; import this lazily).

Flash-decoding in two launches:

1. ``_decode_split_kernel``, grid ``(B * Hkv, num_splits)``: one program reads one KV head's slots
   ``[split * split_len, min((split + 1) * split_len, length))`` once for all ``G = Hq / Hkv`` query
   heads of that KV head (``BLOCK_H >= 16`` rows, the unused ones masked, so both products are
   ``tl.dot`` on tensor cores), keeps an online softmax in float32 and writes the split's normalized
   output and log-sum-exp (base 2). A split that starts past the row's length runs zero iterations.
2. ``_decode_reduce_kernel``, grid ``(B * Hq,)``: merges the splits that saw tokens
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

FMT_BF16 = 0
FMT_FP8 = 1
FMT_INT = 2


@triton.jit
def _load_q_plane(q_rows, offs_j, mask_h, P: tl.constexpr, PACK: tl.constexpr):
    q = tl.load(q_rows[:, None] + offs_j[None, :] * PACK + P, mask=mask_h[:, None], other=0.0)
    return q.to(tl.float16)


@triton.jit
def _int_plane(raw, scale, zero, P: tl.constexpr, BITS: tl.constexpr):
    codes = (raw >> (P * BITS)) & ((1 << BITS) - 1)
    return (codes.to(tl.float32) * scale + zero).to(tl.float16)


@triton.jit
def _store_plane(rows, offs_j, mask_h, acc, inv_l, P: tl.constexpr, PACK: tl.constexpr):
    tl.store(rows[:, None] + offs_j[None, :] * PACK + P, acc * inv_l[:, None], mask=mask_h[:, None])


@triton.jit(do_not_specialize=["Hq", "Hkv", "T", "split_len", "num_splits", "G"])
def _decode_split_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, len_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, Hq, Hkv, T, split_len, num_splits, G,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, QGROUP: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), T)
    start = split * split_len
    end = tl.minimum(start + split_len, length)

    DP: tl.constexpr = D // PACK  # bytes (int) or elements (bf16/fp8) per plane of a row
    NG: tl.constexpr = D // QGROUP  # quantization groups per row (int formats)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = h * G + offs_h
    offs_j = tl.arange(0, DP)
    q_rows = q_ptr + (b * Hq + heads) * D

    q0 = _load_q_plane(q_rows, offs_j, mask_h, 0, PACK)
    q1 = q0
    q2 = q0
    q3 = q0
    if PACK >= 2:
        q1 = _load_q_plane(q_rows, offs_j, mask_h, 1, PACK)
    if PACK == 4:
        q2 = _load_q_plane(q_rows, offs_j, mask_h, 2, PACK)
        q3 = _load_q_plane(q_rows, offs_j, mask_h, 3, PACK)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, DP], tl.float32)
    acc1 = tl.zeros([BLOCK_H, DP], tl.float32)
    acc2 = tl.zeros([BLOCK_H, DP], tl.float32)
    acc3 = tl.zeros([BLOCK_H, DP], tl.float32)
    row0 = bh.to(tl.int64) * T  # first slot of this (b, h) in [B, Hkv, T, ...] buffers

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        slots = row0 + offs_n
        tile = slots[:, None] * DP + offs_j[None, :]
        if FMT == 2:
            groups = slots[:, None] * NG + offs_j[None, :] // (QGROUP // PACK)
            k_raw = tl.load(kc_ptr + tile, mask=mask_n[:, None], other=0).to(tl.int32)
            k_sc = tl.load(ks_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            k_zr = tl.load(kz_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q0, tl.trans(_int_plane(k_raw, k_sc, k_zr, 0, BITS)))
            s += tl.dot(q1, tl.trans(_int_plane(k_raw, k_sc, k_zr, 1, BITS)))
            if PACK == 4:
                s += tl.dot(q2, tl.trans(_int_plane(k_raw, k_sc, k_zr, 2, BITS)))
                s += tl.dot(q3, tl.trans(_int_plane(k_raw, k_sc, k_zr, 3, BITS)))
            s = s * qk_scale
        elif FMT == 1:
            k_raw = tl.load(kc_ptr + tile, mask=mask_n[:, None], other=0)
            k = k_raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            k_sc = tl.load(ks_ptr + slots, mask=mask_n, other=0.0)
            s = tl.dot(q0, tl.trans(k)) * (k_sc * qk_scale)[None, :]
        else:
            k = tl.load(kc_ptr + tile, mask=mask_n[:, None], other=0.0).to(tl.float16)
            s = tl.dot(q0, tl.trans(k)) * qk_scale
        s = tl.where(mask_n[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        p = p.to(tl.float16)

        if FMT == 2:
            v_raw = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0).to(tl.int32)
            v_sc = tl.load(vs_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            v_zr = tl.load(vz_ptr + groups, mask=mask_n[:, None], other=0.0).to(tl.float32)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, _int_plane(v_raw, v_sc, v_zr, 0, BITS))
            acc1 = acc1 * alpha[:, None] + tl.dot(p, _int_plane(v_raw, v_sc, v_zr, 1, BITS))
            if PACK == 4:
                acc2 = acc2 * alpha[:, None] + tl.dot(p, _int_plane(v_raw, v_sc, v_zr, 2, BITS))
                acc3 = acc3 * alpha[:, None] + tl.dot(p, _int_plane(v_raw, v_sc, v_zr, 3, BITS))
        elif FMT == 1:
            v_raw = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0)
            v_sc = tl.load(vs_ptr + slots, mask=mask_n, other=0.0)
            v = (v_raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_sc[:, None]).to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, v)
        else:
            v = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0.0).to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(p, v)

    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * Hq + heads) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=mask_h)
    out_rows = part_out_ptr + part.to(tl.int64) * D
    _store_plane(out_rows, offs_j, mask_h, acc0, inv_l, 0, PACK)
    if PACK >= 2:
        _store_plane(out_rows, offs_j, mask_h, acc1, inv_l, 1, PACK)
    if PACK == 4:
        _store_plane(out_rows, offs_j, mask_h, acc2, inv_l, 2, PACK)
        _store_plane(out_rows, offs_j, mask_h, acc3, inv_l, 3, PACK)


@triton.jit(do_not_specialize=["Hq", "T", "split_len", "num_splits"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, len_ptr, out_ptr, Hq, T, split_len, num_splits,
    D: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    bq = tl.program_id(0)
    b = bq // Hq
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), T)
    n_valid = tl.cdiv(length, split_len)  # splits that saw at least one token
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < n_valid
    base = bq.to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # length 0: no split saw a token; keep exp2 finite
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)
    parts = tl.load(part_out_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + bq.to(tl.int64) * D + offs_d, out.to(out_ptr.dtype.element_ty))
