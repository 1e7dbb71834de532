"""Triton kernels of :mod:`kvlab.kernels.kivi_decode` and their launch (imports triton; import lazily).

Flash-decoding over a :class:`kvlab.kernels.kivi.KiviStore`, in two launches:

1. ``kivi_decode_kernel``, grid ``(B * Hkv, num_splits + 1)``: one program per KV head and split.
   Splits ``0 .. num_splits - 1`` read ``split_groups`` quantized groups each; the last split reads
   the bf16 ring (``W = R + G`` slots, masked to the tokens it holds). Each writes its normalized
   output and log-sum-exp (base 2), ``-inf`` when it saw nothing. The constexpr ``VARIANT`` picks
   the program's body: ``split`` (:func:`split_partial`, below) or ``warp``
   (:mod:`kvlab.kernels.kivi_warp`).
2. :func:`kvlab.kernels.merge_triton.merge_partials_kernel`, grid ``(B * Hq,)``: merges the
   ``num_splits + 1`` partials.

The ``split`` variant puts the GQA group's query heads as the rows of one tile (``BLOCK_H >= 16``,
so products are ``tl.dot``) and reads one key group of G tokens per iteration. Keys are per
channel, so the scale and zero of a group are vectors over the head dim and fold into the query:
``q . (c * s + z) = (q * s) . c + q . z``: one product with the raw codes plus one dot with the
zeros per group, no dequantized key tile. Values are per token (a scale and zero per ``VG``
elements of each token) and are dequantized plane by plane as in :mod:`kvlab.kernels.decode_split`:
byte ``j`` holds elements ``j * PACK + p`` at bits ``[p * BITS, (p + 1) * BITS)``; key plane ``p``
pairs with the strided slice ``q[:, p::KPACK]``, value plane ``p`` writes the output's ``[:, p::VPACK]``.
Keys and values may differ in bits (KIVI's ``k_bits``/``v_bits``).
Products run on float16 operands with float32 accumulation (bf16 ring tiles are converted: 11 bits
of mantissa hold bf16's 8, and the interpreter multiplies bf16 as raw integers).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvlab.kernels.append_kernel import bf16_bits, f16_step  # the rounding steps kvlab's int formats use
from kvlab.kernels.decode_reduce import online_step, query_planes, split_state, store_plane
from kvlab.kernels.kivi_warp import code_partial, ring_partial
from kvlab.kernels.merge_triton import merge_partials


@triton.jit
def _plane(raw, P: tl.constexpr, BITS: tl.constexpr):
    return ((raw >> (P * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def key_scores(q_p, raw, ks_ptr, kz_ptr, goff, offs_j, P: tl.constexpr, PACK: tl.constexpr, BITS: tl.constexpr):
    """Plane ``P``'s part of ``q k^T`` for one per-channel group: ``(q * s) c^T + q . z``."""
    sc = tl.load(ks_ptr + goff + offs_j * PACK + P).to(tl.float32)
    zr = tl.load(kz_ptr + goff + offs_j * PACK + P).to(tl.float32)
    qs = (q_p * sc[None, :]).to(tl.float16)
    return tl.dot(qs, tl.trans(_plane(raw, P, BITS).to(tl.float16))) + tl.sum(q_p * zr[None, :], 1)[:, None]


@triton.jit
def value_plane(raw, vs_ptr, vz_ptr, vgroups, P: tl.constexpr, BITS: tl.constexpr):
    vs = tl.load(vs_ptr + vgroups).to(tl.float32)
    vz = tl.load(vz_ptr + vgroups).to(tl.float32)
    return (_plane(raw, P, BITS) * vs + vz).to(tl.float16)


@triton.jit
def ring_plane(ptr, rslots, offs_j, mask_r, P: tl.constexpr, PACK: tl.constexpr, D: tl.constexpr):
    return tl.load(ptr + rslots[:, None] * D + offs_j[None, :] * PACK + P, mask=mask_r[:, None],
                   other=0.0).to(tl.float16)


@triton.jit
def split_partial(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, rk_ptr, rv_ptr, part_out_ptr, part_lse_ptr,
                  qk_scale, b, h, bh, split, Hq, TQ, NKG, W, nq, length, split_groups, num_splits, GQ,
                  D: tl.constexpr, BLOCK_H: tl.constexpr, G: tl.constexpr, VG: tl.constexpr, BLOCK_R: tl.constexpr,
                  KBITS: tl.constexpr, KPACK: tl.constexpr, VBITS: tl.constexpr, VPACK: tl.constexpr):
    """The ``split`` variant of :func:`kivi_decode_kernel`'s program: ``split_groups`` key groups of G
    tokens, one group per iteration, or the ring (the last split) in strided planes."""
    is_ring = split == num_splits
    g_start = split * split_groups
    g_end = tl.where(is_ring, g_start, tl.minimum(g_start + split_groups, nq // G))
    r_end = tl.where(is_ring, W, 0)

    KDP: tl.constexpr = D // KPACK  # key bytes per token: plane p of byte j is channel j * KPACK + p
    VDP: tl.constexpr = D // VPACK
    NVG: tl.constexpr = D // VG
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQ
    heads = h * GQ + offs_h
    offs_k = tl.arange(0, KDP)
    offs_v = tl.arange(0, VDP)
    offs_g = tl.arange(0, G)
    q_rows = q_ptr + (b * Hq + heads) * D
    q0, q1, q2, q3 = query_planes(q_rows, offs_k, mask_h, KPACK, tl.float32)  # float32: scaled per group below

    m_i, l_i, acc0, acc1, acc2, acc3 = split_state(BLOCK_H, VDP)
    row_t = bh.to(tl.int64) * TQ
    row_g = bh.to(tl.int64) * NKG

    for gi in range(g_start, g_end):  # quantized groups: G tokens, one key scale/zero vector
        toks = row_t + gi * G + offs_g
        goff = (row_g + gi) * D
        k_raw = tl.load(kc_ptr + toks[:, None] * KDP + offs_k[None, :]).to(tl.int32)
        s = key_scores(q0, k_raw, ks_ptr, kz_ptr, goff, offs_k, 0, KPACK, KBITS)
        s += key_scores(q1, k_raw, ks_ptr, kz_ptr, goff, offs_k, 1, KPACK, KBITS)
        if KPACK == 4:
            s += key_scores(q2, k_raw, ks_ptr, kz_ptr, goff, offs_k, 2, KPACK, KBITS)
            s += key_scores(q3, k_raw, ks_ptr, kz_ptr, goff, offs_k, 3, KPACK, KBITS)
        m_i, l_i, alpha, p = online_step(m_i, l_i, s * qk_scale)
        v_raw = tl.load(vc_ptr + toks[:, None] * VDP + offs_v[None, :]).to(tl.int32)
        vgroups = toks[:, None] * NVG + (offs_v[None, :] * VPACK) // VG
        acc0 = acc0 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 0, VBITS))
        acc1 = acc1 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 1, VBITS))
        if VPACK == 4:
            acc2 = acc2 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 2, VBITS))
            acc3 = acc3 * alpha[:, None] + tl.dot(p, value_plane(v_raw, vs_ptr, vz_ptr, vgroups, 3, VBITS))

    first = nq % W  # ring slot of the oldest exact token
    count = length - nq
    for r0 in range(0, r_end, BLOCK_R):  # the ring: bf16, slots holding tokens nq .. length - 1
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = (offs_r < W) & ((offs_r - first + W) % W < count)
        rslots = bh.to(tl.int64) * W + offs_r
        s = tl.dot(q0.to(tl.float16), tl.trans(ring_plane(rk_ptr, rslots, offs_k, mask_r, 0, KPACK, D)))
        s += tl.dot(q1.to(tl.float16), tl.trans(ring_plane(rk_ptr, rslots, offs_k, mask_r, 1, KPACK, D)))
        if KPACK == 4:
            s += tl.dot(q2.to(tl.float16), tl.trans(ring_plane(rk_ptr, rslots, offs_k, mask_r, 2, KPACK, D)))
            s += tl.dot(q3.to(tl.float16), tl.trans(ring_plane(rk_ptr, rslots, offs_k, mask_r, 3, KPACK, D)))
        s = tl.where(mask_r[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, alpha, p = online_step(m_i, l_i, s)
        acc0 = acc0 * alpha[:, None] + tl.dot(p, ring_plane(rv_ptr, rslots, offs_v, mask_r, 0, VPACK, D))
        acc1 = acc1 * alpha[:, None] + tl.dot(p, ring_plane(rv_ptr, rslots, offs_v, mask_r, 1, VPACK, D))
        if VPACK == 4:
            acc2 = acc2 * alpha[:, None] + tl.dot(p, ring_plane(rv_ptr, rslots, offs_v, mask_r, 2, VPACK, D))
            acc3 = acc3 * alpha[:, None] + tl.dot(p, ring_plane(rv_ptr, rslots, offs_v, mask_r, 3, VPACK, D))

    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * Hq + heads) * (num_splits + 1) + split
    tl.store(part_lse_ptr + part, lse, mask=mask_h)
    out_rows = part_out_ptr + part.to(tl.int64) * D
    store_plane(out_rows, offs_v, mask_h, acc0, inv_l, 0, VPACK)
    store_plane(out_rows, offs_v, mask_h, acc1, inv_l, 1, VPACK)
    if VPACK == 4:
        store_plane(out_rows, offs_v, mask_h, acc2, inv_l, 2, VPACK)
        store_plane(out_rows, offs_v, mask_h, acc3, inv_l, 3, VPACK)


@triton.jit(do_not_specialize=["Hq", "Hkv", "TQ", "NKG", "W", "R", "split_groups", "num_splits", "GQ"])
def kivi_decode_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, rk_ptr, rv_ptr, len_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, Hq, Hkv, TQ, NKG, W, R, split_groups, num_splits, GQ,
    D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, BW: tl.constexpr, NW: tl.constexpr,
    ASM: tl.constexpr, VARIANT: tl.constexpr,
):
    """Split ``split`` of KV head ``bh``: ``split_groups`` code groups, or the ring (the last split).
    One entry for both variants, so :func:`launch_kivi` and one signature serve both; the constexpr
    ``VARIANT`` compiles one branch: ``"split"`` (:func:`split_partial`) or ``"warp"``
    (:mod:`kvlab.kernels.kivi_warp`'s :func:`~kvlab.kernels.kivi_warp.ring_partial` and
    :func:`~kvlab.kernels.kivi_warp.code_partial`; ``GP``, ``BW``, ``NW`` and ``ASM`` are warp's:
    ``NW`` warps, ``BW`` tokens per warp per block)."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    length = tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0)
    nq = tl.maximum(length - R, 0) // G * G  # tokens stored as codes (kivi.KiviSpec.quantized_tokens)
    if VARIANT == "warp":
        if split == num_splits:
            ring_partial(q_ptr, rk_ptr, rv_ptr, part_out_ptr, part_lse_ptr, qk_scale, b, h, bh, split, Hq, W, nq,
                         length, num_splits, GQ, D, BLOCK_H, BLOCK_R)
        else:
            code_partial(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, part_out_ptr, part_lse_ptr,
                         qk_scale, b, h, bh, split, Hq, TQ, NKG, nq, split_groups, num_splits, GQ,
                         D, GP, NG, G, BW, NW, KBITS, VBITS, ASM)
    else:
        VG: tl.constexpr = D // NG  # value group (elements)
        KPACK: tl.constexpr = 8 // KBITS  # codes per byte
        VPACK: tl.constexpr = 8 // VBITS
        split_partial(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, rk_ptr, rv_ptr, part_out_ptr,
                      part_lse_ptr, qk_scale, b, h, bh, split, Hq, TQ, NKG, W, nq, length, split_groups, num_splits,
                      GQ, D, BLOCK_H, G, VG, BLOCK_R, KBITS, KPACK, VBITS, VPACK)


def launch_constants(variant: str, spec, head_dim: int, gqa: int, num_warps: int = 4, block_r: int = 32):
    """``(kernel, constexprs, num_warps, tokens per iteration of the code loop)`` of a resolved variant
    (:func:`kvlab.kernels.kivi_decode.kivi_variant`): :func:`kivi_decode_kernel` with ``VARIANT``
    ``split`` (one key group per iteration) or ``warp`` (``warp``/``warp_asm``,
    :mod:`kvlab.kernels.kivi_warp`: one block of ``num_warps`` times ``min(G, 32)`` tokens).
    benchmarks/kernel_sass.py compiles the same."""
    gp = triton.next_power_of_2(gqa)
    bw = min(spec.group, 32)
    consts = dict(D=head_dim, G=spec.group, KBITS=spec.k_bits, VBITS=spec.v_bits, BLOCK_H=max(16, gp),
                  BLOCK_R=block_r, GP=gp, NG=head_dim // spec.value_group, BW=bw, NW=num_warps,
                  ASM=variant == "warp_asm", VARIANT="split" if variant == "split" else "warp")
    return kivi_decode_kernel, consts, num_warps, spec.group if variant == "split" else num_warps * bw


def launch_kivi(q, store, lengths, scale, workspace, out, variant="split"):
    """Both launches of one decode step (:func:`kvlab.kernels.kivi_decode.kivi_decode_attention`
    checks the arguments and resolves ``variant``)."""
    batch, q_heads, head_dim = q.shape
    spec, splits = store.spec, workspace.num_splits
    group = q_heads // store.kv_heads
    kernel, consts, warps, _ = launch_constants(variant, spec, head_dim, group, workspace.num_warps,
                                                workspace.block_r)
    kernel[(batch * store.kv_heads, splits + 1)](
        q, store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero,
        store.ring_k, store.ring_v, lengths, workspace.part_out, workspace.part_lse,
        float(scale) * math.log2(math.e), q_heads, store.kv_heads, store.k_codes.shape[2], store.k_scale.shape[2],
        spec.window, spec.residual, workspace.split_groups, splits, group, **consts, num_warps=warps,
    )
    return merge_partials(workspace.part_out, workspace.part_lse, out)


# -- append: write the ring slot, quantize the group that just filled (one launch per layer) ---------
@triton.jit
def _bf16_value(bits):
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _scale_zero(low, high, LEVELS: tl.constexpr):
    """float16 zero (rounded down) and scale (rounded up) as float32, and the scale's inverse."""
    zero = low.to(tl.float16)
    zero = tl.where(zero.to(tl.float32) > low, f16_step(zero, False), zero).to(tl.float32)
    exact = tl.math.div_rn(high - zero, tl.full(low.shape, LEVELS, tl.float32))
    scale = exact.to(tl.float16)
    scale = tl.where(scale.to(tl.float32) < exact, f16_step(scale, True), scale).to(tl.float32)
    inv = tl.where(scale > 0, tl.math.div_rn(tl.full(low.shape, 1.0, tl.float32), tl.where(scale > 0, scale, 1.0)),
                   0.0)
    return zero, scale, inv


@triton.jit(do_not_specialize=["Hkv", "W", "R", "TQ", "NKG", "ksb", "ksh", "vsb", "vsh"])
def _kivi_append_kernel(
    k_ptr, v_ptr, pos_ptr, rk_ptr, rv_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    Hkv, W, R, TQ, NKG, ksb, ksh, vsb, vsh,
    D: tl.constexpr, G: tl.constexpr, VG: tl.constexpr,
    KBITS: tl.constexpr, KPACK: tl.constexpr, VBITS: tl.constexpr, VPACK: tl.constexpr,
):
    bh = tl.program_id(0)
    b = bh // Hkv
    h = bh % Hkv
    pos = tl.load(pos_ptr).to(tl.int64)
    offs_d = tl.arange(0, D)
    kb = bf16_bits(tl.load(k_ptr + b.to(tl.int64) * ksb + h * ksh + offs_d).to(tl.float32))
    vb = bf16_bits(tl.load(v_ptr + b.to(tl.int64) * vsb + h * vsh + offs_d).to(tl.float32))
    ring = bh.to(tl.int64) * W + pos % W
    tl.store(rk_ptr + ring * D + offs_d, kb)
    tl.store(rv_ptr + ring * D + offs_d, vb)

    over = pos + 1 - R
    if (over >= G) and (over % G == 0):  # the ring holds R + G tokens: its oldest G become group `grp`
        grp = over // G - 1
        offs_g = tl.arange(0, G)
        slots = bh.to(tl.int64) * W + (over - G + offs_g) % W
        newest = (over - G + offs_g == pos)[:, None]  # the token just written (R = 0 only): from registers
        kt = tl.where(newest, _bf16_value(kb)[None, :], _bf16_value(tl.load(rk_ptr + slots[:, None] * D + offs_d[None, :])))
        vt = tl.where(newest, _bf16_value(vb)[None, :], _bf16_value(tl.load(rv_ptr + slots[:, None] * D + offs_d[None, :])))
        toks = bh.to(tl.int64) * TQ + grp * G + offs_g

        # keys: per channel over the G tokens
        KLEVELS: tl.constexpr = (1 << KBITS) - 1
        KDP: tl.constexpr = D // KPACK
        zero, scale, inv = _scale_zero(tl.min(kt, 0), tl.max(kt, 0), KLEVELS)
        codes = tl.minimum(tl.maximum(tl.floor((kt - zero[None, :]) * inv[None, :] + 0.5), 0.0), KLEVELS * 1.0)
        codes = tl.reshape(codes.to(tl.int32), [G, KDP, KPACK])
        packed = tl.sum(codes << (tl.arange(0, KPACK) * KBITS)[None, None, :], 2)
        tl.store(kc_ptr + toks[:, None] * KDP + tl.arange(0, KDP)[None, :], packed.to(tl.uint8))
        gof = (bh.to(tl.int64) * NKG + grp) * D
        tl.store(ks_ptr + gof + offs_d, scale.to(tl.float16))
        tl.store(kz_ptr + gof + offs_d, zero.to(tl.float16))

        # values: per token, groups of VG along the head dim
        VLEVELS: tl.constexpr = (1 << VBITS) - 1
        VDP: tl.constexpr = D // VPACK
        NVG: tl.constexpr = D // VG
        vg = tl.reshape(vt, [G, NVG, VG])
        vzero, vscale, vinv = _scale_zero(tl.min(vg, 2), tl.max(vg, 2), VLEVELS)
        vcodes = tl.minimum(tl.maximum(tl.floor((vg - vzero[:, :, None]) * vinv[:, :, None] + 0.5), 0.0),
                            VLEVELS * 1.0)
        vcodes = tl.reshape(vcodes.to(tl.int32), [G, VDP, VPACK])
        vpacked = tl.sum(vcodes << (tl.arange(0, VPACK) * VBITS)[None, None, :], 2)
        tl.store(vc_ptr + toks[:, None] * VDP + tl.arange(0, VDP)[None, :], vpacked.to(tl.uint8))
        offs_n = tl.arange(0, NVG)
        tl.store(vs_ptr + toks[:, None] * NVG + offs_n[None, :], vscale.to(tl.float16))
        tl.store(vz_ptr + toks[:, None] * NVG + offs_n[None, :], vzero.to(tl.float16))


def launch_kivi_append(store, k, v, position):
    """One launch: ``k``/``v [B, H, 1, D]`` into the ring at ``position`` (``[1]`` on the device), and the
    group that filled, if one did, quantized in place (no trash group write)."""
    spec = store.spec
    _kivi_append_kernel[(store.batch * store.kv_heads,)](
        k, v, position, store.ring_k.view(torch.int16), store.ring_v.view(torch.int16), store.k_codes, store.k_scale,
        store.k_zero, store.v_codes, store.v_scale, store.v_zero,
        store.kv_heads, spec.window, spec.residual, store.k_codes.shape[2], store.k_scale.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        D=store.head_dim, G=spec.group, VG=spec.value_group, KBITS=spec.k_bits, KPACK=8 // spec.k_bits,
        VBITS=spec.v_bits, VPACK=8 // spec.v_bits,
    )
