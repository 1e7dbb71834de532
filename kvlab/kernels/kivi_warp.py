"""The ``warp`` variant of the KIVI decode kernel (imports triton; import lazily): what
:func:`kvlab.kernels.kivi_triton.kivi_decode_kernel` runs under ``VARIANT == "warp"``
(:func:`code_partial` for a code split, :func:`ring_partial` for the ring), the ``split`` variant
(:func:`kvlab.kernels.kivi_triton.split_partial`) rebuilt on the ideas of :mod:`kvlab.kernels.decode_warp`.

Same contract as ``split`` (grid ``(B * Hkv, num_splits + 1)``, splits of ``split_groups`` code
groups, the last program reads the bf16 ring; normalized partial outputs and base-2 log-sum-exps
merged by :func:`kvlab.kernels.merge_triton.merge_partials`), same store layout. What differs in the
code splits, and why (SASS per quantized token, ``benchmarks/kernel_sass.py --kivi``):

- Warps own key groups. A block is ``W`` warps times ``BW`` tokens (``BW`` divides the key group
  G), every tile is ``[W, ...]`` and every product is batched over ``W`` (one batch entry per warp),
  so each warp runs its own online softmax and the ``W`` partial softmaxes merge once, after the
  loop (the split variant reduced its ``[16, G]`` score tile across warps each group).
- Keys are per channel, so a warp folds its group's scale and zero vectors into the query once per
  group: with ``c = L (u - 1)`` (``u`` the code as float16 ``1 + c / L``, see below),
  ``qk (q . (s c + z)) = sum_d qf_d u_d + bias`` with ``qf = qk L q s`` (float16, the product's
  operand) and ``bias = qk q . z - sum_d qf_d`` (float32, the product's accumulator input). The
  split variant multiplied and converted a ``[16, D]`` query per group in every warp and added the
  zero term per plane.
- Query rows sit in the tensor core's 8-wide N: keys as ``u qf^T`` with the tokens in M, values as
  ``out^T = v^T pv^T`` with the head-dim words in M. The key product has ``GP`` rows (the GQA group
  rounded up to a power of two), not 16. The key planes are joined along the depth into one product
  of depth D (plane-major order ``P * KW + word``; the query is loaded and folded in that order), so
  the folded query is one operand per group, not one per plane: the joins only relabel registers.
- Values are per token, a scale and a zero per ``VG`` elements: rows ``r = g * GP + h`` (query head
  ``h`` for value group ``g``, ``NG = D / VG`` groups) multiply the probabilities by their group's
  per-token scale, ``pv = p s_g`` (float16), and keep only their group's words of the output. The
  ``1`` of ``u`` comes off at the end through one more small product (``ones . pv^T``, the row sums
  of ``pv`` as the product saw them). No value is dequantized (the split variant gathered a scale
  and a zero per code element).
- Sums over tokens wait for the end: the zero term ``sum_t p z_g`` and the softmax's ``sum_t p`` are
  kept per token (rescaled by ``alpha`` like the outputs) and summed once after the loop, not
  reduced across lanes every block.
- Codes are read as int16 words: a key word is one token's 8 (2-bit) or 4 (4-bit) neighbouring
  channels, element ``P`` at bits ``[BITS P, BITS (P + 1))``; plane ``P`` (elements ``word * KP + P``)
  is one operand slice. Values are loaded transposed (``[words, tokens]``, the product's first
  operand; triton reads pairs of tokens with ``ldmatrix.trans``). A plane becomes float16
  ``1 + c / L`` with one AND-OR on a shifted word, two codes per instruction (PTX ``lop3`` with
  ``ASM``, the portable :func:`word_plane` otherwise): 2-bit planes ``2i`` and ``2i + 1`` share one
  shift (landing at bits ``[6, 8)``, ``L = 16``, and ``[8, 10)``, ``L = 4``), 4-bit planes use
  :data:`kvlab.kernels.decode_words.INT4_WORDS_PTX` (``L = 16``).
- Per-token value scales and zeros are one 16/32/64-bit load per token (all its groups).
- Full blocks run without masks; the last block of a split masks whole warps (a warp past the split
  reads the split's first group again and its scores become ``-inf``), so no load is ever masked.

The ring split runs :func:`ring_partial`: the split variant's bf16 ring loop on whole rows.
Offsets inside one ``(b, h)`` are int32. Static cost (``benchmarks/kernel_sass.py --kivi``, sm_90,
D 128, GQA 4, G 32, 4 warps): 27.4 SASS instructions per quantized token for k2v2 against the split
variant's 96.4 (k4v2 28.9 against 101.2).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_reduce import online_step
from kvlab.kernels.decode_warp import zero_planes
from kvlab.kernels.decode_words import INT4_WORDS_PTX, words_ptx

# $8: two int16 words of eight 2-bit codes each (first word in the low half); $0..$7: plane P (bits
# [2P, 2P + 2)) of both words as float16 1 + c / L, L = 16 for even P (code at bits [6, 8)), 4 for
# odd P (bits [8, 10)): one shift per pair of planes, one AND-OR per plane, two codes at a time.
INT2_WORDS_PTX = words_ptx((0x00C000C0, 0x03000300))


def plane_unit(plane: int, bits: int) -> int:
    """``L`` of plane ``plane`` of ``bits``-bit words: the plane's float16 holds ``1 + c / L``."""
    return 4 if bits == 2 and plane % 2 else 16


@triton.jit
def word_plane(w, P: tl.constexpr, BITS: tl.constexpr):
    """Plane ``P`` (bits ``[BITS P, BITS (P + 1))``) of int16 words as float16 ``1 + c / L`` (``L``:
    :func:`plane_unit`), exactly: the portable twin of :data:`INT2_WORDS_PTX` and ``INT4_WORDS_PTX``.
    The field lands at bits ``[6, 10)`` (4-bit) or ``[6, 8)``/``[8, 10)`` (2-bit, even/odd ``P``), the
    top of the float16 mantissa of 1.0; no conversion instruction."""
    if BITS == 4:
        SHIFT: tl.constexpr = 6 - 4 * P
        MASK: tl.constexpr = 0x03C0
    else:
        SHIFT: tl.constexpr = 6 - 4 * (P // 2)
        MASK: tl.constexpr = 0x00C0 << (2 * (P % 2))
    if SHIFT >= 0:
        field = (w << SHIFT) & MASK
    else:
        field = (w >> (-SHIFT)) & MASK
    return (field | 0x3C00).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _unit(P: tl.constexpr, BITS: tl.constexpr):
    """:func:`plane_unit` in jit code (a float)."""
    if BITS == 2 and P % 2 == 1:
        return 4.0
    return 16.0


@triton.jit
def _asm_planes(w, BITS: tl.constexpr):
    """All planes of an int16 word tile by PTX (compiled only; pairs of words in one register)."""
    if BITS == 2:
        return tl.inline_asm_elementwise(
            asm=INT2_WORDS_PTX, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[w],
            dtype=(tl.float16,) * 8, is_pure=True, pack=2)
    a, b, c, d = tl.inline_asm_elementwise(
        asm=INT4_WORDS_PTX, constraints="=r,=r,=r,=r,r", args=[w],
        dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    return a, b, c, d, a, b, c, d


@triton.jit
def word_planes(w, BITS: tl.constexpr, ASM: tl.constexpr):
    """The ``16 / BITS`` planes of an int16 word tile (8 values; 4-bit repeats its four)."""
    if ASM:
        return _asm_planes(w, BITS)
    if BITS == 2:
        return (word_plane(w, 0, 2), word_plane(w, 1, 2), word_plane(w, 2, 2), word_plane(w, 3, 2),
                word_plane(w, 4, 2), word_plane(w, 5, 2), word_plane(w, 6, 2), word_plane(w, 7, 2))
    a = word_plane(w, 0, 4)
    b = word_plane(w, 1, 4)
    c = word_plane(w, 2, 4)
    d = word_plane(w, 3, 4)
    return a, b, c, d, a, b, c, d


# -- keys: the query folded per group ----------------------------------------------------------------
@triton.jit
def _plane_major(KP: tl.constexpr, KW: tl.constexpr):
    """Head-dim element of each position ``k = P * KW + word`` of the key product's depth: planes
    one after the other, each ``KW`` deep (``word * KP + P``)."""
    k = tl.arange(0, KP * KW)
    return (k % KW) * KP + k // KW


@triton.jit
def _fold(qu, qz, ks, kz, goff, dk):
    """Each warp's group folded into the query: ``(qf [W, D, GP] float16, bias [W, GP])`` with
    ``qf = qk L q s`` and ``bias = qk q . z - sum qf`` (the float16 ``qf`` the product sees, so the
    ``1`` of ``u`` cancels exactly). ``qu = qk L q``, ``qz = qk q``: ``[D, GP]`` in plane-major depth
    order ``dk``; ``goff [W]``: the groups' first scale."""
    offs = goff[:, None] + dk[None, :]
    sc = tl.load(ks + offs).to(tl.float32)
    zr = tl.load(kz + offs).to(tl.float32)
    qf = (qu[None, :, :] * sc[:, :, None]).to(tl.float16)
    bias = tl.sum(qz[None, :, :] * zr[:, :, None] - qf.to(tl.float32), 1)
    return qf, bias


@triton.jit
def _planes_along_k(w, BITS: tl.constexpr, ASM: tl.constexpr):
    """The planes of a key word tile ``[W, BW, KW]`` side by side along the depth: ``[W, BW, D]``,
    position ``P * KW + word`` (one product of depth D instead of one per plane)."""
    u0, u1, u2, u3, u4, u5, u6, u7 = word_planes(w, BITS, ASM)
    if BITS == 2:
        # [W, BW, word, a, b, c] holds plane 4a + 2b + c (each join adds the last dim)
        t = tl.join(tl.join(tl.join(u0, u4), tl.join(u2, u6)), tl.join(tl.join(u1, u5), tl.join(u3, u7)))
        t = tl.permute(t, (0, 1, 3, 4, 5, 2))
    else:  # [W, BW, word, a, b] holds plane 2a + b
        t = tl.join(tl.join(u0, u2), tl.join(u1, u3))
        t = tl.permute(t, (0, 1, 3, 4, 2))
    return tl.reshape(t, [w.shape[0], w.shape[1], w.shape[2] * (16 // BITS)])


@triton.jit
def _key_scores(kc, ks, kz, slots, goff, qu, qz, dk,
                KP: tl.constexpr, KW: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """Scaled scores ``[W, GP, BW]`` (base 2) of the warps' tokens ``slots [W, BW]``."""
    qf, bias = _fold(qu, qz, ks, kz, goff, dk)
    w = tl.load(kc + slots[:, :, None] * KW + tl.arange(0, KW)[None, None, :])
    u = _planes_along_k(w, BITS, ASM)
    part = tl.broadcast_to(bias[:, None, :], [w.shape[0], w.shape[1], bias.shape[1]])
    return tl.permute(tl.dot(u, qf, part), (0, 2, 1))


# -- values: rows per value group --------------------------------------------------------------------
@triton.jit
def _rows(x, NG: tl.constexpr):
    """``[W, GP, BW]`` -> ``[W, NG * GP, BW]``: row ``g * GP + h`` is row ``h`` (one copy per value group)."""
    if NG == 1:
        return x
    return tl.reshape(tl.broadcast_to(x[:, None, :, :], [x.shape[0], NG, x.shape[1], x.shape[2]]),
                      [x.shape[0], NG * x.shape[1], x.shape[2]])


@triton.jit
def _row_vec(x, NG: tl.constexpr):
    """``[W, GP]`` -> ``[W, NG * GP]``, as :func:`_rows`."""
    if NG == 1:
        return x
    return tl.reshape(tl.broadcast_to(x[:, None, :], [x.shape[0], NG, x.shape[1]]), [x.shape[0], NG * x.shape[1]])


@triton.jit
def _half(w, SHIFT: tl.constexpr):
    return (w >> SHIFT).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _by_group(ptr, slots, row_g, NG: tl.constexpr):
    """``[W, NG * GP, BW]``: row ``r`` takes the float16 scale (or zero) of its value group
    ``row_g[r]`` of each token, all of a token's groups in one 16/32/64-bit load."""
    g = row_g[None, :, None]
    if NG == 1:
        return tl.load(ptr + slots).to(tl.float32)[:, None, :]
    elif NG == 2:
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + slots)[:, None, :]
        return tl.where(g == 0, _half(w, 0), _half(w, 16))
    w = tl.load(ptr.to(tl.pointer_type(tl.int64)) + slots)[:, None, :]
    out = tl.where(g == 0, _half(w, 0), _half(w, 16))
    out = tl.where(g == 2, _half(w, 32), out)
    return tl.where(g == 3, _half(w, 48), out)


@triton.jit
def _block(kc, ks, kz, vc, vs, vz, slots, goff, valid, row_g, ones, qu, qz, dk,
           m_i, l_i, zacc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_one,
           NG: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr, KBITS: tl.constexpr,
           VP: tl.constexpr, VW: tl.constexpr, VBITS: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr):
    """One block (``BW`` tokens per warp, ``slots [W, BW]``): the online softmax state, updated."""
    s = _key_scores(kc, ks, kz, slots, goff, qu, qz, dk, KP, KW, KBITS, ASM)
    if MASKED:
        s = tl.where(valid[:, None, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, :, None])
    l_i = l_i * alpha[:, :, None] + p  # summed over the tokens after the loop
    p_rows = _rows(p, NG)
    alpha_rows = _row_vec(alpha, NG)
    pv = (p_rows * _by_group(vs, slots, row_g, NG)).to(tl.float16)
    zacc = zacc * alpha_rows[:, :, None] + p_rows * _by_group(vz, slots, row_g, NG)  # summed after the loop
    # the words transposed ([W, VW, BW]): the value product's first operand, tokens along k
    w = tl.load(vc + slots[:, None, :] * VW + tl.arange(0, VW)[None, :, None])
    v0, v1, v2, v3, v4, v5, v6, v7 = word_planes(w, VBITS, ASM)
    pvt = tl.permute(pv, (0, 2, 1))
    f = alpha_rows[:, None, :]
    acc0 = tl.dot(v0, pvt, acc0 * f)
    acc1 = tl.dot(v1, pvt, acc1 * f)
    acc2 = tl.dot(v2, pvt, acc2 * f)
    acc3 = tl.dot(v3, pvt, acc3 * f)
    if VP == 8:
        acc4 = tl.dot(v4, pvt, acc4 * f)
        acc5 = tl.dot(v5, pvt, acc5 * f)
        acc6 = tl.dot(v6, pvt, acc6 * f)
        acc7 = tl.dot(v7, pvt, acc7 * f)
    acc_one = tl.dot(ones, pvt, acc_one * f)  # sum_t pv per row (every row of the 16)
    return m_new, l_i, zacc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_one


@triton.jit
def _store_plane(rows, offs_c, keep, acc, off, wgt, z, inv_l, P: tl.constexpr, VP: tl.constexpr,
                 VBITS: tl.constexpr):
    """Plane ``P`` of the warps' accumulators merged, ``L (sum_w wgt (acc - off)) + z``, normalized,
    into elements ``word * VP + P`` of the rows it belongs to (``keep [VW, ROWS]``)."""
    out = tl.sum((acc - off[:, None, :]) * wgt[:, None, :], 0) * _unit(P, VBITS)
    tl.store(rows[None, :] + (offs_c * VP + P)[:, None], (out + z[None, :]) * inv_l[None, :], mask=keep)


@triton.jit
def code_partial(q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, part_out_ptr, part_lse_ptr,
                 qk_scale, b, h, bh, split, Hq, TQ, NKG, nq, split_groups, num_splits, GQ,
                 D: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, BW: tl.constexpr,
                 W: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, ASM: tl.constexpr):
    """The ``warp`` variant's code split ``split`` of one KV head (``split_groups`` whole key groups of
    the ``nq`` quantized tokens, ``W`` warps of ``BW`` tokens per block): its partial output and
    log-sum-exp. :func:`kvlab.kernels.kivi_triton.kivi_decode_kernel` calls it (or :func:`ring_partial`)
    directly: a jit helper between them reorders the constants triton hoists, and the SASS changes."""
    start = tl.minimum(split * split_groups * G, nq)
    end = tl.minimum(start + split_groups * G, nq)
    KP: tl.constexpr = 16 // KBITS  # key codes per int16 word
    KW: tl.constexpr = D // KP  # key words per token
    VP: tl.constexpr = 16 // VBITS
    VW: tl.constexpr = D // VP
    ROWS: tl.constexpr = NG * GP
    offs_h = tl.arange(0, GP)
    mask_h = offs_h < GQ
    q_rows = q_ptr + (b * Hq + h * GQ + offs_h) * D
    dk = _plane_major(KP, KW)
    # the query [D, GP] in plane-major depth order; each position's L times the softmax scale
    qt = tl.trans(tl.load(q_rows[:, None] + dk[None, :], mask=mask_h[:, None], other=0.0).to(tl.float32))
    if KBITS == 2:
        unit = tl.where((tl.arange(0, D) // KW) % 2 == 1, 4.0, 16.0)
    else:
        unit = tl.full([D], 16.0, tl.float32)
    qz = qt * qk_scale
    qu = qz * unit[:, None]

    # finite: a warp whose tokens are all masked keeps alpha = 1 and p = 0 (no inf - inf)
    m_i = tl.full([W, GP], -1e30, tl.float32)
    l_i = tl.zeros([W, GP, BW], tl.float32)
    zacc = tl.zeros([W, ROWS, BW], tl.float32)
    acc0, acc1, acc2, acc3 = zero_planes(W, VW, ROWS)
    acc4, acc5, acc6, acc7 = zero_planes(W, VW, ROWS)  # planes 4..7: 2-bit values only
    acc_one = tl.zeros([W, 16, ROWS], tl.float32)
    ones = tl.full([W, 16, BW], 1.0, tl.float16)
    row_g = tl.arange(0, ROWS) // GP

    # this (b, h)'s rows of the buffers; offsets inside them are int32
    row0 = bh.to(tl.int64) * TQ
    kc = kc_ptr.to(tl.pointer_type(tl.int16)) + row0 * KW
    vc = vc_ptr.to(tl.pointer_type(tl.int16)) + row0 * VW
    ks = ks_ptr + bh.to(tl.int64) * NKG * D
    kz = kz_ptr + bh.to(tl.int64) * NKG * D
    vs = vs_ptr + row0 * NG
    vz = vz_ptr + row0 * NG
    BLOCK: tl.constexpr = W * BW
    first = tl.arange(0, W) * BW  # [W]: each warp's first token of a block
    offs_t = tl.arange(0, BW)

    full_end = start + (end - start) // BLOCK * BLOCK
    for n0 in range(start, full_end, BLOCK):
        base = n0 + first
        m_i, l_i, zacc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_one = _block(
            kc, ks, kz, vc, vs, vz, base[:, None] + offs_t[None, :], base // G * D, base < end, row_g, ones,
            qu, qz, dk, m_i, l_i, zacc,
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_one, NG, KP, KW, KBITS, VP, VW, VBITS, ASM, False)
    if full_end < end:  # whole warps past the end read the split's first tokens again, then drop them
        base = full_end + first
        valid = base < end
        base = tl.where(valid, base, start)
        m_i, l_i, zacc, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_one = _block(
            kc, ks, kz, vc, vs, vz, base[:, None] + offs_t[None, :], base // G * D, valid, row_g, ones,
            qu, qz, dk, m_i, l_i, zacc,
            acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7, acc_one, NG, KP, KW, KBITS, VP, VW, VBITS, ASM, True)

    # the warps' softmaxes merged (base 2); the products' offsets (the 1 of u) taken off per warp
    m = tl.max(m_i, 0)
    wgt = tl.exp2(m_i - m[None, :])
    l_sum = tl.sum(tl.sum(l_i, 2) * wgt, 0)
    has = l_sum > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_sum, 1.0), 0.0)
    lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
    part = (b * Hq + h * GQ + offs_h) * (num_splits + 1) + split
    tl.store(part_lse_ptr + part, lse, mask=mask_h)
    wgt_rows = _row_vec(wgt, NG)
    z = tl.sum(tl.sum(zacc, 2) * wgt_rows, 0)
    off = tl.max(acc_one, 1)
    inv_rows = tl.reshape(tl.broadcast_to(inv_l[None, :], [NG, GP]), [ROWS])
    heads = tl.arange(0, ROWS) % GP
    rows = part_out_ptr + ((b * Hq + h * GQ + heads) * (num_splits + 1) + split).to(tl.int64) * D
    offs_c = tl.arange(0, VW)
    # row (g, h) holds head h's output for the words of value group g
    keep = (heads < GQ)[None, :] & ((offs_c * VP // (D // NG))[:, None] == row_g[None, :])
    _store_plane(rows, offs_c, keep, acc0, off, wgt_rows, z, inv_rows, 0, VP, VBITS)
    _store_plane(rows, offs_c, keep, acc1, off, wgt_rows, z, inv_rows, 1, VP, VBITS)
    _store_plane(rows, offs_c, keep, acc2, off, wgt_rows, z, inv_rows, 2, VP, VBITS)
    _store_plane(rows, offs_c, keep, acc3, off, wgt_rows, z, inv_rows, 3, VP, VBITS)
    if VP == 8:
        _store_plane(rows, offs_c, keep, acc4, off, wgt_rows, z, inv_rows, 4, VP, VBITS)
        _store_plane(rows, offs_c, keep, acc5, off, wgt_rows, z, inv_rows, 5, VP, VBITS)
        _store_plane(rows, offs_c, keep, acc6, off, wgt_rows, z, inv_rows, 6, VP, VBITS)
        _store_plane(rows, offs_c, keep, acc7, off, wgt_rows, z, inv_rows, 7, VP, VBITS)


# -- the ring: bf16 ---------------------------------------------------------------------------------
@triton.jit
def ring_tile(ptr, rslots, offs_d, mask_r):
    """Whole bf16 rows of the ring (``[BLOCK_R, D]``, contiguous) as float16, masked slots 0."""
    return tl.load(ptr + rslots[:, None] * offs_d.shape[0] + offs_d[None, :], mask=mask_r[:, None],
                   other=0.0).to(tl.float16)


@triton.jit
def ring_partial(q_ptr, rk_ptr, rv_ptr, part_out_ptr, part_lse_ptr, qk_scale, b, h, bh, split, Hq, W, nq,
                 length, num_splits, GQ, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    """The ring's tokens ``nq .. length - 1`` (slots ``t % W``) of one KV head: its partial output and
    log-sum-exp. Whole rows per product (the split variant multiplied strided planes), and a slot's
    token found without a modulo (``W`` is not a constexpr)."""
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQ
    heads = h * GQ + offs_h
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (b * Hq + heads)[:, None] * D + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale).to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    first = nq % W  # ring slot of the oldest exact token
    count = length - nq
    for r0 in range(0, W, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        age = offs_r - first  # the slot's token is nq + age (mod W)
        age = tl.where(age < 0, age + W, age)
        mask_r = (offs_r < W) & (age < count)
        rslots = bh.to(tl.int64) * W + offs_r
        s = tl.dot(q, tl.trans(ring_tile(rk_ptr, rslots, offs_d, mask_r)))
        s = tl.where(mask_r[None, :], s, float("-inf"))
        m_i, l_i, alpha, p = online_step(m_i, l_i, s)
        acc = tl.dot(p, ring_tile(rv_ptr, rslots, offs_d, mask_r), acc * alpha[:, None])
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * Hq + heads) * (num_splits + 1) + split
    tl.store(part_lse_ptr + part, lse, mask=mask_h)
    tl.store(part_out_ptr + part.to(tl.int64)[:, None] * D + offs_d[None, :], acc * inv_l[:, None],
             mask=mask_h[:, None])
