"""Decode attention over block tables for a KIVI-style pool, in Triton (imports triton; import lazily
through :mod:`kvlab.kernels.paged`).

The pool (:class:`kvlab.storage.kivi.KiviPool`) keeps one key group per block: per slot, key and value
codes ``[slots, Hkv, D * bits / 8]`` and the values' scale and zero ``[slots, Hkv, D / VG]``; per block,
the keys' per-channel scale and zero ``[blocks, Hkv, D]``. Each request's tokens not yet quantized sit
beside the pool; the launcher gathers them into one padded bf16 ``[B, Hkv, TW, D]`` pair. Grid
``(B, Hkv)``: a program holds the ``G`` query heads of one KV head (``BLOCK_H >= 16`` rows) and reads
the request's ``nq / G`` code blocks through its table, one group per iteration, then its ``count``
exact tokens ``BLOCK_R`` at a time, in one float32 online softmax (base 2). The arithmetic is the
contiguous KIVI kernel's (:mod:`kvlab.kernels.kivi_triton`): a group's key scale and zero fold into the
query (``q . (c * s + z) = (q * s) . c + q . z``), values are dequantized plane by plane, the exact
tokens read as float16; float16 operands, float32 accumulation. Checked against the pool's own torch
read (:meth:`kvlab.storage.kivi.KiviPool.attend`) in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_reduce import online_step, query_planes, split_result, split_state, store_plane
from kvlab.kernels.kivi_triton import key_scores, ring_plane, value_plane


@triton.jit(do_not_specialize=["table_stride", "Hq", "GQ", "TW"])
def paged_kivi_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, tk_ptr, tv_ptr, table_ptr, nq_ptr, count_ptr, out_ptr,
    qk_scale, table_stride, Hq, GQ, TW,
    HKV: tl.constexpr, D: tl.constexpr, G: tl.constexpr, VG: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    KPACK: tl.constexpr = 8 // KBITS
    VPACK: tl.constexpr = 8 // VBITS
    KDP: tl.constexpr = D // KPACK  # key bytes per token: plane p of byte j is channel j * KPACK + p
    VDP: tl.constexpr = D // VPACK
    NVG: tl.constexpr = D // VG
    nq = tl.load(nq_ptr + b).to(tl.int32)
    count = tl.load(count_ptr + b).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQ
    heads = h * GQ + offs_h
    offs_k = tl.arange(0, KDP)
    offs_v = tl.arange(0, VDP)
    offs_g = tl.arange(0, G)
    q_rows = q_ptr + (b * Hq + heads).to(tl.int64) * D
    q0, q1, q2, q3 = query_planes(q_rows, offs_k, mask_h, KPACK, tl.float32)  # float32: scaled per group
    m_i, l_i, acc0, acc1, acc2, acc3 = split_state(BLOCK_H, VDP)
    table = table_ptr + b.to(tl.int64) * table_stride

    for gi in range(0, nq // G):  # code blocks: G tokens, one key scale and zero vector
        block = tl.load(table + gi).to(tl.int64)
        rows = (block * G + offs_g) * HKV + h  # the group's slots in [slots, Hkv, ...] buffers
        goff = (block * HKV + h) * D
        k_raw = tl.load(kc_ptr + rows[:, None] * KDP + offs_k[None, :]).to(tl.int32)
        s = key_scores(q0, k_raw, ks_ptr, kz_ptr, goff, offs_k, 0, KPACK, KBITS)
        s += key_scores(q1, k_raw, ks_ptr, kz_ptr, goff, offs_k, 1, KPACK, KBITS)
        if KPACK == 4:
            s += key_scores(q2, k_raw, ks_ptr, kz_ptr, goff, offs_k, 2, KPACK, KBITS)
            s += key_scores(q3, k_raw, ks_ptr, kz_ptr, goff, offs_k, 3, KPACK, KBITS)
        m_i, l_i, alpha, p = online_step(m_i, l_i, s * qk_scale)
        v_raw = tl.load(vc_ptr + rows[:, None] * VDP + offs_v[None, :]).to(tl.int32)
        vgroups = rows[:, None] * NVG + (offs_v[None, :] * VPACK) // VG
        acc0 = acc0 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 0, VBITS))
        acc1 = acc1 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 1, VBITS))
        if VPACK == 4:
            acc2 = acc2 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 2, VBITS))
            acc3 = acc3 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 3, VBITS))

    for r0 in range(0, count, BLOCK_R):  # the exact tokens, bf16
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < count
        rslots = (b * HKV + h).to(tl.int64) * TW + offs_r
        s = tl.dot(q0.to(tl.float16), tl.trans(ring_plane(tk_ptr, rslots, offs_k, mask_r, 0, KPACK, D)))
        s += tl.dot(q1.to(tl.float16), tl.trans(ring_plane(tk_ptr, rslots, offs_k, mask_r, 1, KPACK, D)))
        if KPACK == 4:
            s += tl.dot(q2.to(tl.float16), tl.trans(ring_plane(tk_ptr, rslots, offs_k, mask_r, 2, KPACK, D)))
            s += tl.dot(q3.to(tl.float16), tl.trans(ring_plane(tk_ptr, rslots, offs_k, mask_r, 3, KPACK, D)))
        s = tl.where(mask_r[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = online_step(m_i, l_i, s)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, ring_plane(tv_ptr, rslots, offs_v, mask_r, 0, VPACK, D))
        acc1 = acc1 * alpha[:, None] + tl.dot(p, ring_plane(tv_ptr, rslots, offs_v, mask_r, 1, VPACK, D))
        if VPACK == 4:
            acc2 = acc2 * alpha[:, None] + tl.dot(p, ring_plane(tv_ptr, rslots, offs_v, mask_r, 2, VPACK, D))
            acc3 = acc3 * alpha[:, None] + tl.dot(p, ring_plane(tv_ptr, rslots, offs_v, mask_r, 3, VPACK, D))

    inv_l, _ = split_result(m_i, l_i)
    out_rows = out_ptr + (b * Hq + heads).to(tl.int64) * D
    store_plane(out_rows, offs_v, mask_h, acc0, inv_l, 0, VPACK)
    store_plane(out_rows, offs_v, mask_h, acc1, inv_l, 1, VPACK)
    if VPACK == 4:
        store_plane(out_rows, offs_v, mask_h, acc2, inv_l, 2, VPACK)
        store_plane(out_rows, offs_v, mask_h, acc3, inv_l, 3, VPACK)
