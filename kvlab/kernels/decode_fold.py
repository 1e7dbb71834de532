"""The ``fold`` variant of :mod:`kvlab.kernels.decode`'s kernel (imports triton; import lazily): its body,
:func:`fold_partial`, which :func:`kvlab.kernels.decode_entry.decode_kernel` runs.

Same contract as the ``split`` variant in :mod:`kvlab.kernels.decode_split` (grid
``(B * Hkv, num_splits)``, normalized partial outputs and base-2 log-sum-exps merged by its reduce
kernel), but nothing is dequantized: the group scales and zeros are folded into the small operands.

Rows. A program's ``BLOCK_M`` rows are ``r = g * GP + h``: query head ``h`` of the KV head's ``G``
(``GP`` = ``G`` rounded up to a power of two) for quantization group ``g`` of the head dim (``NG``
groups for int formats, one otherwise). Every row of head ``h`` computes the same scores; the
copies cost nothing while ``NG * GP <= 16``, the rows ``tl.dot`` needs anyway (Llama's GQA 4 with
group >= 32 at head dim 128), and they let each row own one group of the output.

Keys, int: ``score = sum_g s_g * (q_g . c_g) + z_g * sum(q_g)``. Each group's bytes are loaded as a
``[BLOCK_N, GW]`` tile, its ``PACK`` planes (bits ``[p * BITS, (p + 1) * BITS)``: elements
``j * PACK + p``) become float16 ``u = 1 + c / 2**BITS`` with one shift and one AND-OR (the code
in the top mantissa bits of 1.0: exact, no conversion instruction) and go straight into ``tl.dot``
with the matching strided slice of q; ``2**BITS`` times the group's per-token scale multiplies the
``[BLOCK_M, BLOCK_N]`` result and ``(z - 2**BITS s) * sum(q_g)`` removes the offset: ``PACK * NG``
products of depth ``GW = group / PACK`` (>= 16, so int2 needs group >= 64) that together are one
product of depth ``D / PACK``. fp8: the key scale multiplies the score (as before).

Values, int: ``out[d] = sum_t p_t * s_{t,g(d)} * c_{t,d} + sum_t p_t * z_{t,g(d)}``. Row ``r`` scales
its probabilities by its group's scale (divided by the tile's largest, so the float16 products
stay normal; the largest multiplies the product's float32 result), multiplies them with the whole
code tile of each plane (as ``u``), and keeps only its group's columns at the end; the zero term
and the offset (the row sum of the float16 probabilities the product saw) are a float32 row sum.
fp8: the same with the per-token scale. So each byte is loaded once and unpacked once, and no
scale or zero is gathered per element.

Both products run on float16 operands with float32 accumulation (``|q|, |k|, |v| < 6.5e4``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_reduce import (
    dense_key_scores,
    query_slots,
    slot_block,
    split_result,
    split_state,
)
from kvlab.kernels.jit_constants import FMT_BF16, FMT_FP8, FMT_INT

# $4: four code bytes b0..b3 (b0 lowest); $0, $1: plane 0 (low nibbles) of b0, b1 and b2, b3 as
# float16 pairs (first element in the low half); $2, $3: plane 1 (high nibbles).
INT4_PLANES_PTX = tl.constexpr("""
{
.reg .b32 t0, t1;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 $0, t0, 6;
lop3.b32 $0, $0, 0x03C003C0, 0x3C003C00, 0xEA;
shl.b32 $1, t1, 6;
lop3.b32 $1, $1, 0x03C003C0, 0x3C003C00, 0xEA;
shl.b32 $2, t0, 2;
lop3.b32 $2, $2, 0x03C003C0, 0x3C003C00, 0xEA;
shl.b32 $3, t1, 2;
lop3.b32 $3, $3, 0x03C003C0, 0x3C003C00, 0xEA;
}
""")  # a constexpr: jit code may read no other globals


@triton.jit
def codes_unit(raw16, P: tl.constexpr, BITS: tl.constexpr):
    """Plane ``P`` of packed codes (bytes widened to int16) as float16 ``1 + c / 2**BITS``, exactly.

    The code goes to the top ``BITS`` mantissa bits of 1.0 (``0x3C00``): one shift and one AND-OR
    per code, no conversion instruction. Callers undo the affine map once per token and group:
    ``c = 2**BITS * (u - 1)``. (``0x6400 | c = 1024 + c`` would save the shift, but its offset of
    1024 cancels in float32 sums and costs three decimal digits.)
    """
    top: tl.constexpr = 10 - BITS  # lowest bit of the code in the float16 mantissa
    field = (raw16 << (top - P * BITS)) & (((1 << BITS) - 1) << top)
    return (field | 0x3C00).to(tl.int16).to(tl.float16, bitcast=True)  # a literal may widen the OR


@triton.jit
def int4_planes(raw):
    """Both planes of packed int4 codes (uint8) as float16 ``1 + c / 16``, as :func:`codes_unit` makes them.

    PTX on four bytes at once (``fold_asm``; compiled only, the interpreter cannot run it): ``prmt``
    spreads bytes ``b0, b1`` (and ``b2, b3``) to the two 16-bit halves of a register, then one shift
    and one ``lop3`` (``(x & mask) | 0x3C00``) per plane make two float16 codes at a time.
    tests/test_kernels.py checks this text against :func:`codes_unit` by emulating the three
    instructions for every byte.
    """
    return tl.inline_asm_elementwise(
        asm=INT4_PLANES_PTX, constraints="=r,=r,=r,=r,r", args=[raw], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=4)


@triton.jit
def _key_group(kc_ptr, k_sc, k_zr, slots, mask_n, qa, qb, qc, qd, qsum, qk_scale,
               GI: tl.constexpr, NG: tl.constexpr, DP: tl.constexpr, GW: tl.constexpr,
               PACK: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Scaled scores of group ``GI`` (planes in ``qa..qd``; ``qsum`` = the group's sum of q, pre-scaled;
    ``k_sc``/``k_zr``: the ``[BLOCK_N, NG]`` scales and zeros of the tile's tokens)."""
    offs = tl.arange(0, GW)
    raw = tl.load(kc_ptr + slots[:, None] * DP + (GI * GW + offs)[None, :], mask=mask_n[:, None], other=0)
    if ASM:
        u0, u1 = int4_planes(raw)
        part = tl.dot(qa, tl.trans(u0))
        part += tl.dot(qb, tl.trans(u1))
    else:
        raw = raw.to(tl.int16)
        part = tl.dot(qa, tl.trans(codes_unit(raw, 0, BITS)))
        part += tl.dot(qb, tl.trans(codes_unit(raw, 1, BITS)))
    if PACK == 4:
        part += tl.dot(qc, tl.trans(codes_unit(raw, 2, BITS)))
        part += tl.dot(qd, tl.trans(codes_unit(raw, 3, BITS)))
    sc = _column(k_sc, GI, NG) * (1 << BITS)
    zr = _column(k_zr, GI, NG)
    # With c = L * (u - 1), L = 2**BITS: s * (q . c) + z * sum(q) = L s * (q . u) + (z - L s) * sum(q)
    return part * (sc * qk_scale)[None, :] + qsum[:, None] * (zr - sc)[None, :]


@triton.jit
def _group_tile(ptr, slots, mask_n, NG: tl.constexpr):
    """The ``[BLOCK_N, NG]`` scales (or zeros) of the tile's tokens: one contiguous load, as float32."""
    offs = tl.arange(0, NG)
    return tl.load(ptr + slots[:, None] * NG + offs[None, :], mask=mask_n[:, None], other=0.0).to(tl.float32)


@triton.jit
def _column(tile, GI: tl.constexpr, NG: tl.constexpr):
    """Column ``GI`` of a ``[BLOCK_N, NG]`` tile (a sum over a row a thread holds whole: exact)."""
    if NG == 1:
        return tl.sum(tile, 1)
    return tl.sum(tl.where((tl.arange(0, NG) == GI)[None, :], tile, 0.0), 1)


@triton.jit
def _max_pair(a, b, c, d):
    return tl.maximum(a, c), tl.maximum(b, d)


@triton.jit
def _add_pair(a, b, c, d):
    return a + c, b + d


@triton.jit
def _store_rows(rows, offs_j, keep, acc, zacc, inv_l, P: tl.constexpr, PACK: tl.constexpr):
    tl.store(rows[:, None] + offs_j[None, :] * PACK + P, (acc + zacc[:, None]) * inv_l[:, None], mask=keep)


@triton.jit
def fold_partial(
    bh, split, b, start, end, row_g, mask_r, heads, q_rows,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, part_out_ptr, part_lse_ptr, qk_scale, Hq, T, num_splits,
    D: tl.constexpr, BLOCK_M: tl.constexpr, NG: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, ASM: tl.constexpr,
):
    """The ``fold`` variant's split ``split`` of KV head ``bh`` (slots ``[start, end)``, rows from
    :func:`~kvlab.kernels.decode_reduce.group_rows`): its normalized partial output and base-2 log-sum-exp.
    :func:`kvlab.kernels.decode_entry.decode_kernel` calls it."""

    DP: tl.constexpr = D // PACK  # bytes (int) or elements (bf16/fp8) of one row
    # NG: quantization groups of a row (int formats; 1 otherwise), each owning GP rows
    GW: tl.constexpr = DP // NG  # bytes of one group of one row
    offs_j = tl.arange(0, DP)

    # Query slices, one per (group, plane) slot: slot i is group i // PACK, plane i % PACK.
    q0, q1, q2, q3, q4, q5, q6, q7 = query_slots(q_rows, mask_r, NG * PACK, PACK, GW)
    # Each group's sum of q (for the zero term), times the softmax scale, which the group scale
    # also carries (folded into the score below).
    qs0 = (tl.sum(q0.to(tl.float32), 1) + tl.sum(q1.to(tl.float32), 1)) * qk_scale
    qs1 = qs0
    qs2 = qs0
    qs3 = qs0
    if PACK == 4:
        qs0 += (tl.sum(q2.to(tl.float32), 1) + tl.sum(q3.to(tl.float32), 1)) * qk_scale
        qs1 = (tl.sum(q4.to(tl.float32), 1) + tl.sum(q5.to(tl.float32), 1)
               + tl.sum(q6.to(tl.float32), 1) + tl.sum(q7.to(tl.float32), 1)) * qk_scale
    else:
        qs1 = (tl.sum(q2.to(tl.float32), 1) + tl.sum(q3.to(tl.float32), 1)) * qk_scale
        qs2 = (tl.sum(q4.to(tl.float32), 1) + tl.sum(q5.to(tl.float32), 1)) * qk_scale
        qs3 = (tl.sum(q6.to(tl.float32), 1) + tl.sum(q7.to(tl.float32), 1)) * qk_scale

    zacc = tl.zeros([BLOCK_M], tl.float32)
    m_i, l_i, acc0, acc1, acc2, acc3 = split_state(BLOCK_M, DP)
    row0 = bh.to(tl.int64) * T  # first slot of this (b, h) in [B, Hkv, T, ...] buffers

    for n0 in range(start, end, BLOCK_N):
        mask_n, slots = slot_block(row0, n0, end, BLOCK_N)
        if FMT == FMT_INT:
            k_sc = _group_tile(ks_ptr, slots, mask_n, NG)
            k_zr = _group_tile(kz_ptr, slots, mask_n, NG)
            if PACK == 2:
                s = _key_group(kc_ptr, k_sc, k_zr, slots, mask_n, q0, q1, q0, q0, qs0, qk_scale, 0, NG, DP, GW, PACK, BITS, ASM)
                if NG >= 2:
                    s += _key_group(kc_ptr, k_sc, k_zr, slots, mask_n, q2, q3, q0, q0, qs1, qk_scale, 1, NG, DP, GW,
                                    PACK, BITS, ASM)
                if NG == 4:
                    s += _key_group(kc_ptr, k_sc, k_zr, slots, mask_n, q4, q5, q0, q0, qs2, qk_scale, 2, NG, DP, GW,
                                    PACK, BITS, ASM)
                    s += _key_group(kc_ptr, k_sc, k_zr, slots, mask_n, q6, q7, q0, q0, qs3, qk_scale, 3, NG, DP, GW,
                                    PACK, BITS, ASM)
            else:
                s = _key_group(kc_ptr, k_sc, k_zr, slots, mask_n, q0, q1, q2, q3, qs0, qk_scale, 0, NG, DP, GW, PACK, BITS, ASM)
                if NG == 2:
                    s += _key_group(kc_ptr, k_sc, k_zr, slots, mask_n, q4, q5, q6, q7, qs1, qk_scale, 1, NG, DP, GW,
                                    PACK, BITS, ASM)
        else:
            s = dense_key_scores(kc_ptr + slots[:, None] * DP + offs_j[None, :], ks_ptr, slots, mask_n, q0,
                                 qk_scale, FMT)
        s = tl.where(mask_n[None, :], s, float("-inf"))

        tile = slots[:, None] * DP + offs_j[None, :]

        if FMT == FMT_INT:
            # Each row's group scale and zero per token, chosen among the NG loaded vectors.
            vs_t = _group_tile(vs_ptr, slots, mask_n, NG)
            vz_t = _group_tile(vz_ptr, slots, mask_n, NG)
            v_sc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            v_zr = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for gi in tl.static_range(NG):
                pick = (row_g == gi)[:, None]
                v_sc = tl.where(pick, _column(vs_t, gi, NG)[None, :], v_sc)
                v_zr = tl.where(pick, _column(vz_t, gi, NG)[None, :], v_zr)
        elif FMT == FMT_FP8:
            v_sc = tl.broadcast_to(tl.load(vs_ptr + slots, mask=mask_n, other=0.0)[None, :], [BLOCK_M, BLOCK_N])
        if FMT == FMT_BF16:
            s_max = tl.max(s, 1)
        else:
            s_max, top = tl.reduce((s, v_sc), 1, _max_pair)  # one pass over the rows for both maxima
            top = tl.where(top > 0, top, 1.0)

        m_new = tl.maximum(m_i, s_max)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        m_i = m_new

        if FMT == FMT_INT:
            pv = (p * (v_sc * (1.0 / top)[:, None])).to(tl.float16)
            # The products see u = 1 + c / L (L = 2**BITS): sum p s c = L top (pv . u - sum pv), with the
            # float16 pv the products see; the zero term and that offset go to zacc.
            unit = top * (1 << BITS)
            p_sum, z_sum = tl.reduce((p, p * v_zr - unit[:, None] * pv.to(tl.float32)), 1, _add_pair)
            l_i = l_i * alpha + p_sum
            zacc = zacc * alpha + z_sum
            v_raw = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0)
            if ASM:
                v0, v1 = int4_planes(v_raw)
            else:
                v_raw = v_raw.to(tl.int16)
                v0 = codes_unit(v_raw, 0, BITS)
                v1 = codes_unit(v_raw, 1, BITS)
            acc0 = acc0 * alpha[:, None] + tl.dot(pv, v0) * unit[:, None]
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1) * unit[:, None]
            if PACK == 4:
                acc2 = acc2 * alpha[:, None] + tl.dot(pv, codes_unit(v_raw, 2, BITS)) * unit[:, None]
                acc3 = acc3 * alpha[:, None] + tl.dot(pv, codes_unit(v_raw, 3, BITS)) * unit[:, None]
        elif FMT == FMT_FP8:
            l_i = l_i * alpha + tl.sum(p, 1)
            pv = (p * (v_sc * (1.0 / top)[:, None])).to(tl.float16)
            v_raw = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0)
            v = v_raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(pv, v) * top[:, None]
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(vc_ptr + tile, mask=mask_n[:, None], other=0.0).to(tl.float16)
            acc0 = acc0 * alpha[:, None] + tl.dot(p.to(tl.float16), v)

    inv_l, lse = split_result(m_i, l_i)
    part = (b * Hq + heads) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=mask_r & (row_g == 0))
    out_rows = part_out_ptr + part.to(tl.int64) * D
    # Row (g, h) holds head h's output for the columns of group g (bytes j with j // GW == g).
    keep = mask_r[:, None] & ((offs_j // GW)[None, :] == row_g[:, None])
    _store_rows(out_rows, offs_j, keep, acc0, zacc, inv_l, 0, PACK)
    if PACK >= 2:
        _store_rows(out_rows, offs_j, keep, acc1, zacc, inv_l, 1, PACK)
    if PACK == 4:
        _store_rows(out_rows, offs_j, keep, acc2, zacc, inv_l, 2, PACK)
        _store_rows(out_rows, offs_j, keep, acc3, zacc, inv_l, 3, PACK)
