"""Decode attention over block tables for a kvq pool, in Triton (imports triton; import lazily through
:mod:`kvlab.kernels.paged`).

One query token per request, its K/V read in place from the pool's :class:`~kvlab.kernels.formats.KVStore`
s (batch 1, the token axis is the pool's slots: codes ``[1, Hkv, slots, D * bits / 8]``, scales and
zeros beside them) through the request's block table. Grid ``(B, Hkv)``: a program holds the ``G`` query
heads of one KV head (padded to ``BLOCK_H >= 16`` rows for ``tl.dot``) and walks the request's first
``length`` tokens ``BLOCK_N`` at a time: token ``t`` lives in slot ``table[t // BS] * BS + t % BS``, so a
tile may span several blocks and any block size works. Each tile's codes are dequantized in registers
(the ``split`` kernel's arithmetic, :mod:`kvlab.kernels.decode_split`: fp8 codes bitcast, the key scale
on the score and the value scale on the tile; int codes as ``PACK`` strided planes of one scale and zero
per group, each multiplied with the matching slice of q) and folded into a float32 online softmax
(base 2); float16 operands, float32 accumulation. The key offset a pool subtracts needs no term here:
``q . m`` is the same for every key of a request (:mod:`kvlab.kernels.key_offset`).

The grid depends only on B and Hkv and the lengths are read on the device, so a launch is CUDA-graph
capturable. Checked against :func:`kvlab.kernels.paged.paged_kvq_reference` in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_reduce import dense_key_scores, query_planes, split_result, split_state, store_plane
from kvlab.kernels.decode_split import int_plane
from kvlab.kernels.jit_constants import FMT_FP8, FMT_INT


@triton.jit(do_not_specialize=["table_stride", "S", "Hq", "G"])
def paged_kvq_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, table_ptr, len_ptr, out_ptr,
    qk_scale, table_stride, S, Hq, G,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, QGROUP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    DP: tl.constexpr = D // PACK  # bytes (int) or elements (bf16/fp8) per plane of a row
    NG: tl.constexpr = D // QGROUP  # quantization groups per row (int formats)
    length = tl.load(len_ptr + b).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = h * G + offs_h
    offs_j = tl.arange(0, DP)
    q_rows = q_ptr + (b * Hq + heads).to(tl.int64) * D
    q0, q1, q2, q3 = query_planes(q_rows, offs_j, mask_h, PACK, tl.float16)
    m_i, l_i, acc0, acc1, acc2, acc3 = split_state(BLOCK_H, DP)
    row0 = h.to(tl.int64) * S  # this KV head's first slot in the [1, Hkv, S, ...] buffers
    table = table_ptr + b.to(tl.int64) * table_stride

    for n0 in range(0, length, BLOCK_N):
        offs_t = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_t < length
        block = tl.load(table + offs_t // BS, mask=mask_n, other=0).to(tl.int64)
        slots = row0 + block * BS + offs_t % BS
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

        m_new = tl.maximum(m_i, tl.max(s, 1))  # every tile holds a token (t < length): m_new is finite
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

    inv_l, _ = split_result(m_i, l_i)
    out_rows = out_ptr + (b * Hq + heads).to(tl.int64) * D
    store_plane(out_rows, offs_j, mask_h, acc0, inv_l, 0, PACK)
    if PACK >= 2:
        store_plane(out_rows, offs_j, mask_h, acc1, inv_l, 1, PACK)
    if PACK == 4:
        store_plane(out_rows, offs_j, mask_h, acc2, inv_l, 2, PACK)
        store_plane(out_rows, offs_j, mask_h, acc3, inv_l, 3, PACK)
