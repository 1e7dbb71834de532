"""The ``warp`` variant of :mod:`kvlab.kernels.decode`'s kernel (imports triton; import lazily): ``fold``
(:mod:`kvlab.kernels.decode_fold`) with each warp running its own split, for int4 and fp8. Its body is
:func:`warp_partial`, which :func:`kvlab.kernels.decode_entry.decode_kernel` runs.

Same contract as the other split kernels (grid ``(B * Hkv, num_splits)``, normalized partial outputs
and base-2 log-sum-exps merged by :mod:`~kvlab.kernels.decode_reduce`), same folding of scales and
zeros into the small operands, same row scheme (row ``g * GP + h``: query head ``h`` for
quantization group ``g`` of the head dim; ``BLOCK_M = NG * GP`` rows, not padded to 16: triton pads
the products and keeps one copy of each row in registers). What differs, and why (SASS per KV slot,
``benchmarks/kernel_sass.py``):

- Warps own slots. Every tile is ``[W, ...]`` (``W = num_warps``) and every product is batched over
  ``W``, which triton maps one batch entry per warp: a warp runs its own online softmax over its
  ``BLOCK_N / W`` slots of each block, so maxima and sums never cross warps (``fold`` reduced the
  score tile through shared memory with a barrier per reduction) and the score tile stays in
  registers. The ``W`` partial softmaxes are merged once, after the loop.
- Both products put the query rows in the 8-wide N of the tensor-core instruction and the slots
  (keys) or head-dim words (values) in its 16-row M: keys as ``u q^T``, values as ``out^T = v^T p^T``.
  No operand holds padded rows (half of ``fold``'s tensor-core instructions in the value product,
  no register copies of q), and a thread's score fragment holds 4 slots, not 8 (half the per-slot
  work). ``p^T`` reaches the value product's operand layout by an exchange inside the warp
  (shuffles, no shared memory). Group 32's byte planes keep ``q u^T`` (see :func:`_transposed`),
  whose accumulator fragment is ``p^T``'s operand fragment as it stands.
- Codes are read as int16 words. A word holds four int4 codes (two fp8 codes) of one slot; the
  value product needs pairs of slots in one register, which ``ldmatrix.trans`` delivers for 16-bit
  words (``fold`` gathered single bytes from shared memory: one load per byte). Word quarter ``q``
  (elements ``4 c + q``) is one operand plane. Keys use words too where a group has >= 16 words
  per quarter (group >= 64), else ``fold``'s byte planes.
- Per-slot scales are loaded as one 32/64-bit word per slot (all the slot's group scales), straight
  in the layout the score tile uses; the group's largest value scale is per warp, not per row.
- The ``1`` of ``u = 1 + c / 16`` (``fold``'s offset, a float32 row sum of the float16 ``pv``) is
  one more small product, ``ones . p^T``, accumulated like the outputs; the zero term stays a float32
  row sum. The rescale of the accumulators by ``alpha`` and by the block's value scale is one factor
  applied to the product's accumulator input (``fold`` scaled the product's output, then added).
- Full blocks run without masks; only the last block of a split is masked (``MASKED``).

``warp2`` (``IN_PLACE``, int4; fp8 runs as ``warp``): the int4 quarters unpacked in place, 5 instructions
per register of two words instead of 8 (:data:`kvlab.kernels.decode_words.INT4_PLACE_PTX`): quarters 0
and 1 masked where they lie, 2 and 3 after one shift, and no exponent OR'd on: quarter ``q`` is the float16 subnormal
``c * 2**(PLACE_BITS[q] - 24)`` (the code in the mantissa at bit ``0, 4, 2, 6``), exactly ``c`` times a power of
two and 0 for code 0. The key product takes each query slice times ``2**(4 - PLACE_BITS[q])`` (16, 1, 4, 1/4)
so every quarter's codes weigh ``c * 2**-20``, and each value plane's merge multiplies by
``2**(20 - PLACE_BITS[q])``; both exact powers of two, outside the loop (the key scales take ``2**14``, one
multiply per slot and group). The zero term ``sum_g z_g sum(q_g)`` is one more small product
(:func:`_zero_operand`: the slot's zero word as it was loaded, against float16 hi/lo halves of each row's
``sum(q_g) / 64``, :func:`zero_weights`), started from the last group's ``s_g part_g``, so a score is one
multiply and one fused multiply-add per group pair; the factor ``64 qk_scale`` goes into the softmax's exponent
(one fused multiply-add before ``exp2``) instead of every slot's key scales. The softmax sum and the value zero
term keep each lane's partial sums (:func:`_lane_sums`; the shuffles run once, after the loop), and a group's
value top is rounded down to a power of two (its exponent bits: no division, exact rescales of the accumulators).

Precision of ``warp2``, step by step: the operands are exact (a subnormal ``c * 2**-k`` holds its 4 bits;
``q'`` is ``q`` times a power of two, exact below 4096; ``pv`` is ``warp``'s float16 rounding), the tensor core's
products of two float16 numbers are exact, and its float32 sums hold only the codes' own terms, so the
truncation of those sums (to the largest term's 24 bits or so) costs ``2**-23`` of the result and nothing more.
The earlier ``1 + c / 2**j`` operands (``1 + c / 1024`` for quarter 0) put a ``1`` per code into every sum and
took it off after (``-sum(q')``, a ``ones . p^T`` product): the sums were dominated by the offsets, the codes'
information sat ``j`` bits below their top and the truncation ate it (H100: relative error 1.3e-2 against
``warp_asm``'s 1.7e-3, whose ``1 + c / 16`` loses 4 bits). Subnormal operands need the tensor core to take
float16 subnormals as they are (the V100/T4/A100 tensor cores do, Fasi et al. 2021), which the CPU interpreter
cannot show; ``tests/test_kernels_triton.py`` checks the operands carry no offset and runs ``warp`` and
``warp2`` under a truncating model of the tensor core's sums.

Offsets inside one ``(b, h)`` are int32 (``capacity * head_dim < 2**31``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_fold import codes_unit, int4_planes
from kvlab.kernels.decode_reduce import query_slots
from kvlab.kernels.decode_words import code_planes
from kvlab.kernels.jit_constants import FMT_FP8, FMT_INT


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """``ptrs`` loaded, under ``mask`` (other 0) only in a block that has slots past the end."""
    if MASKED:
        return tl.load(ptrs, mask=mask, other=0)
    return tl.load(ptrs)


@triton.jit
def _row_sum(qa, qb, qc, qd, KP: tl.constexpr, qk_scale):
    """A group's sum of q over its ``KP`` slices, times ``qk_scale``, as ``[1, M, 1]``."""
    t = tl.sum(qa.to(tl.float32) + qb.to(tl.float32), 1)
    if KP == 4:
        t += tl.sum(qc.to(tl.float32) + qd.to(tl.float32), 1)
    return (t * qk_scale)[None, :, None]


@triton.jit
def _half(w, SHIFT: tl.constexpr):
    return (w >> SHIFT).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _slot_scales(ptr, offs_n, mask_n, NG: tl.constexpr, MASKED: tl.constexpr):
    """The ``NG`` float16 group scales (or zeros) of each slot as float32 ``[W, BW]`` vectors: one
    2/4/8-byte load per slot, already in the score tile's column layout (no reduction to select one)."""
    if NG == 1:
        x = _load(ptr + offs_n, mask_n, MASKED).to(tl.float32)
        return x, x, x, x
    elif NG == 2:
        w = _load(ptr.to(tl.pointer_type(tl.int32)) + offs_n, mask_n, MASKED)
        return _half(w, 0), _half(w, 16), _half(w, 0), _half(w, 16)
    else:
        w = _load(ptr.to(tl.pointer_type(tl.int64)) + offs_n, mask_n, MASKED)
        return _half(w, 0), _half(w, 16), _half(w, 32), _half(w, 48)


@triton.jit
def _placed_slices(qa, qb, qc, qd):
    """A group's four query slices times ``2**(4 - PLACE_BITS[q])`` (16, 1, 4, 1/4: exact in float16 below
    4096 and above the subnormals), so that in-place quarter ``q``'s codes weigh ``c * 2**-20`` in its product."""
    return ((qa.to(tl.float32) * 16).to(tl.float16), qb, (qc.to(tl.float32) * 4).to(tl.float16),
            (qd.to(tl.float32) * 0.25).to(tl.float16))


@triton.jit
def _batched(q, W: tl.constexpr):
    """``q [M, K]`` repeated for each warp: the first operand of a warp-batched product."""
    return tl.broadcast_to(q[None, :, :], [W, q.shape[0], q.shape[1]])


@triton.jit
def _batched_t(q, W: tl.constexpr):
    """``q [M, K]`` transposed and repeated for each warp: the second operand of a warp-batched product."""
    return tl.broadcast_to(tl.trans(q)[None, :, :], [W, q.shape[1], q.shape[0]])


@triton.jit
def _transposed(part):
    """``[W, BW, M] -> [W, M, BW]`` (a view). Word quarters and fp8 keys are multiplied as ``u q^T``:
    the slots fill the product's 16-row M, the query rows its 8-wide N, so no operand holds padded
    rows (``q u^T`` repeated the 8 rows of q into 16, register copies in the loop) and a thread's
    fragment holds 4 slots, not 8: half the per-slot work (scale conversions, products) on the score
    tile. (Byte planes, group 32, stay ``q u^T``: transposed, triton moved them through shared memory.)"""
    return tl.permute(part, (0, 2, 1))


@triton.jit
def _key_group(kc, offs_n, mask_n, qa, qb, qc, qd, GI: tl.constexpr, DP: tl.constexpr, KP: tl.constexpr,
               KW: tl.constexpr, ASM: tl.constexpr, IN_PLACE: tl.constexpr, MASKED: tl.constexpr):
    """``q . u`` of int4 group ``GI`` over its ``KP`` slices (word quarters or byte planes): ``[W, M, BW]``;
    word quarters multiplied transposed (``u q^T``, see :func:`_transposed`). In-place quarters carry no
    offset (``u = c * 2**(PLACE_BITS[q] - 24)``): with :func:`_placed_slices` the product is ``q.c * 2**-20``."""
    W: tl.constexpr = offs_n.shape[0]
    if KP == 4:
        cols = GI * KW + tl.arange(0, KW)
        w = _load(kc.to(tl.pointer_type(tl.int16)) + offs_n[:, :, None] * (DP // 2) + cols[None, None, :],
                  mask_n[:, :, None], MASKED)
        u0, u1, u2, u3 = code_planes(w, FMT_INT, ASM, IN_PLACE)
        part = tl.dot(u0, _batched_t(qa, W))
        part = tl.dot(u1, _batched_t(qb, W), part)
        part = tl.dot(u2, _batched_t(qc, W), part)
        return _transposed(tl.dot(u3, _batched_t(qd, W), part))
    cols = GI * KW + tl.arange(0, KW)
    raw = _load(kc + offs_n[:, :, None] * DP + cols[None, None, :], mask_n[:, :, None], MASKED)
    if ASM:
        u0, u1 = int4_planes(raw)
    else:
        raw = raw.to(tl.int16)
        u0 = codes_unit(raw, 0, 4)
        u1 = codes_unit(raw, 1, 4)
    # byte planes stay q u^T: transposed, triton would take the unpacked planes through shared memory
    part = tl.dot(_batched(qa, W), tl.permute(u0, (0, 2, 1)))
    return tl.dot(_batched(qb, W), tl.permute(u1, (0, 2, 1)), part)


@triton.jit
def _group_score(part, sc, zr, qsum, qk_scale):
    """A group's share of the scores: with ``c = 16 (u - 1)``, ``s q.c + z sum(q) = 16 s (q.u) + (z - 16 s) sum(q)``."""
    return part * (sc * (16 * qk_scale))[:, None, :] + qsum * (zr - 16 * sc)[:, None, :]


@triton.jit
def _zero_operand(w, NG: tl.constexpr):
    """The zero term's first operand ``[W, BW, 16]`` (float16, exact): column ``k`` of slot ``n`` is its group
    ``k % NG``'s zero (``w``: the slot's ``NG`` float16 zeros as one 16/32-bit word)."""
    if NG == 1:
        out = tl.broadcast_to(w[:, :, None], [w.shape[0], w.shape[1], 16])
    else:  # the word's halves side by side along k, repeated: the word itself in each register of the operand
        z0 = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True)
        z1 = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        pair = tl.join(z0, z1)
        out = tl.broadcast_to(pair[:, :, None, :], [w.shape[0], w.shape[1], 8, 2]).reshape(w.shape[0], w.shape[1], 16)
    return out


@triton.jit
def zero_weights(qsum0, qsum1, NG: tl.constexpr):
    """The zero term's second operand ``[16, M]`` (float16), loop-invariant: row ``g`` holds group ``g``'s
    ``sum(q) / 64`` rounded to float16 (``hi``), row ``NG + g`` the rest (``lo = float16(x - hi)``), the
    other rows 0. Against :func:`_zero_operand` it makes ``sum_g z_g sum(q_g) / 64``: float16 products of
    two float16 numbers are exact in the tensor core's float32, and ``hi + lo`` keeps 22 bits of each sum
    (``lo`` is at most half an ulp of ``hi``: no cancellation)."""
    k = tl.arange(0, 16)[:, None]
    x0 = qsum0[None, :] * (1 / 64)
    x1 = qsum1[None, :] * (1 / 64)
    hi0 = x0.to(tl.float16)
    hi1 = x1.to(tl.float16)
    lo0 = (x0 - hi0.to(tl.float32)).to(tl.float16)
    lo1 = (x1 - hi1.to(tl.float32)).to(tl.float16)
    zero = tl.zeros_like(hi0)
    if NG == 1:
        out = tl.where(k == 0, hi0, tl.where(k == 1, lo0, zero))
    else:
        out = tl.where(k == 0, hi0, tl.where(k == 1, hi1, tl.where(k == 2, lo0, tl.where(k == 3, lo1, zero))))
    return out


@triton.jit
def _placed_group_scores(part0, part1, sc0, sc1, za, zb, NG: tl.constexpr):
    """The scores over ``64 qk_scale`` of in-place quarters (``part_g = q.c * 2**-20``, see :func:`_key_group`;
    ``sc_g``: the key scales times ``2**14``, so ``s_g part_g = s_g q.c / 64``): ``sum_g s_g part_g`` (float32
    fused multiply-adds) on top of the zero term ``sum_g z_g sum(q_g) / 64``, a product of :func:`_zero_operand`
    and ``zb`` (:func:`zero_weights`) that starts from the last group's ``s_g part_g``."""
    W: tl.constexpr = za.shape[0]
    last = part1 * sc1[:, None, :] if NG == 2 else part0 * sc0[:, None, :]
    s = _transposed(tl.dot(za, tl.broadcast_to(zb[None, :, :], [W, zb.shape[0], zb.shape[1]]), _transposed(last)))
    if NG == 2:
        s = part0 * sc0[:, None, :] + s
    return s


@triton.jit
def _scores(kc, ks, kz, offs_n, mask_n, q0, q1, q2, q3, q4, q5, q6, q7, qs0, qs1, qs2, qs3, qk_scale, zb,
            NG: tl.constexpr, DP: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr, FMT: tl.constexpr,
            ASM: tl.constexpr, IN_PLACE: tl.constexpr, MASKED: tl.constexpr):
    """Scaled scores ``[W, M, BW]`` of the warps' slots (base 2: ``qk_scale`` carries log2(e)); in-place
    quarters (``KP == 4 and IN_PLACE``): the scores over ``64 qk_scale`` (that factor goes into the softmax's
    exponent), the zero term a product of :func:`_zero_operand` and ``zb`` (:func:`zero_weights`)."""
    W: tl.constexpr = offs_n.shape[0]
    if FMT != FMT_FP8 and KP == 4 and IN_PLACE:
        sc0, sc1, sc2, sc3 = _slot_scales(ks, offs_n, mask_n, NG, MASKED)
        if NG == 1:
            zw = _load(kz + offs_n, mask_n, MASKED)
        else:
            zw = _load(kz.to(tl.pointer_type(tl.int32)) + offs_n, mask_n, MASKED)
        part0 = _key_group(kc, offs_n, mask_n, q0, q1, q2, q3, 0, DP, KP, KW, ASM, IN_PLACE, MASKED)
        part1 = part0
        if NG == 2:
            part1 = _key_group(kc, offs_n, mask_n, q4, q5, q6, q7, 1, DP, KP, KW, ASM, IN_PLACE, MASKED)
        # 2**14: the products are q.c * 2**-20 (float16 subnormal codes), the scores' convention q.c / 64
        s = _placed_group_scores(part0, part1, sc0 * 16384.0, sc1 * 16384.0, _zero_operand(zw, NG), zb, NG)
    elif FMT == FMT_FP8:
        cols = tl.arange(0, DP)
        raw = _load(kc + offs_n[:, :, None] * DP + cols[None, None, :], mask_n[:, :, None], MASKED)
        k = raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        k_sc = _load(ks + offs_n, mask_n, MASKED)
        s = _transposed(tl.dot(k, _batched_t(q0, W))) * (k_sc * qk_scale)[:, None, :]
    else:
        sc0, sc1, sc2, sc3 = _slot_scales(ks, offs_n, mask_n, NG, MASKED)
        zr0, zr1, zr2, zr3 = _slot_scales(kz, offs_n, mask_n, NG, MASKED)
        if KP == 4:  # word quarters: a group is four slices
            s = _group_score(_key_group(kc, offs_n, mask_n, q0, q1, q2, q3, 0, DP, KP, KW, ASM, IN_PLACE, MASKED),
                             sc0, zr0, qs0, qk_scale)
            if NG == 2:
                s += _group_score(_key_group(kc, offs_n, mask_n, q4, q5, q6, q7, 1, DP, KP, KW, ASM, IN_PLACE,
                                             MASKED), sc1, zr1, qs1, qk_scale)
        else:  # byte planes: a group is two slices
            s = _group_score(_key_group(kc, offs_n, mask_n, q0, q1, q0, q0, 0, DP, KP, KW, ASM, IN_PLACE, MASKED),
                             sc0, zr0, qs0, qk_scale)
            s += _group_score(_key_group(kc, offs_n, mask_n, q2, q3, q0, q0, 1, DP, KP, KW, ASM, IN_PLACE, MASKED),
                              sc1, zr1, qs1, qk_scale)
            if NG == 4:
                s += _group_score(_key_group(kc, offs_n, mask_n, q4, q5, q0, q0, 2, DP, KP, KW, ASM, IN_PLACE, MASKED),
                                  sc2, zr2, qs2, qk_scale)
                s += _group_score(_key_group(kc, offs_n, mask_n, q6, q7, q0, q0, 3, DP, KP, KW, ASM, IN_PLACE, MASKED),
                                  sc3, zr3, qs3, qk_scale)
    return s


@triton.jit
def _lane_sums(x):
    """``x [W, M, BW]`` summed over each lane's own slots: ``[W, M, 8]``. A warp's slot ``n`` of the score
    tile is row ``n % 16`` of the product's ``n // 16``-th 16-row tile: lane ``4 g + t`` holds slots
    ``g + 8 j``, so the sum over ``j`` stays in the thread and the one over the 8 ``g`` (three rounds of
    shuffles) can wait until after the loop."""
    return tl.sum(tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 8, 8]), 2)


@triton.jit
def _top(x):
    """Largest of each warp's ``[BW]`` scales, 1 where none is positive (masked slots)."""
    t = tl.max(x, 1)
    return tl.where(t > 0, t, 1.0)


@triton.jit
def _top_exponent(x):
    """The exponent of the largest of each warp's ``[BW]`` scales (at least -24): ``[W]`` int32."""
    t = tl.maximum(tl.max(x, 1), 2.0 ** -24)
    return ((t.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _pow2(e):
    """``2**e`` (float32, exactly) of int32 exponents in ``[-126, 127]``."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _by_row(row_g, x0, x1, x2, x3, NG: tl.constexpr):
    """``[W, M, ...]``: row ``r`` takes ``x_g`` (``[W, 1, ...]``) of its group ``g = row_g[r]``."""
    out = x0
    if NG > 1:
        g = row_g[None, :, None]
        out = tl.where(g == 0, x0, x1)
        if NG == 4:
            out = tl.where(g == 2, x2, out)
            out = tl.where(g == 3, x3, out)
    return out


@triton.jit
def _group_scales(vs, vz, offs_n, mask_n, NG: tl.constexpr, MASKED: tl.constexpr, EXPONENT: tl.constexpr):
    """A block's value scales and zeros, one tile per group (up to four), and each group's warp top:
    its largest scale, or (``EXPONENT``) the exponent of the power of two at or below it."""
    sc0, sc1, sc2, sc3 = _slot_scales(vs, offs_n, mask_n, NG, MASKED)
    zr0, zr1, zr2, zr3 = _slot_scales(vz, offs_n, mask_n, NG, MASKED)
    if EXPONENT:  # one return: a jit function's returns must agree in type
        t0, t1, t2, t3 = _top_exponent(sc0), _top_exponent(sc1), _top_exponent(sc2), _top_exponent(sc3)
    else:
        t0, t1, t2, t3 = _top(sc0), _top(sc1), _top(sc2), _top(sc3)
    return sc0, sc1, sc2, sc3, zr0, zr1, zr2, zr3, t0, t1, t2, t3


@triton.jit
def _value_weights(vs, vz, offs_n, mask_n, p, row_g, NG: tl.constexpr, FMT: tl.constexpr, MASKED: tl.constexpr,
                   LANES: tl.constexpr = False):
    """``(pv, unit, inv_unit, z)`` of a block: the float16 product operand ``p * scale / top`` (``top``:
    the warp's largest scale of the row's group, so ``pv`` stays normal), what the product's result
    must be multiplied by (``[W, M]``; int: ``16 top``) and its reciprocal, and the zero term
    ``sum_n p * zero``. One division per warp and group; the rest multiplies."""
    if FMT == FMT_FP8:
        sc = _load(vs + offs_n, mask_n, MASKED)
        t = _top(sc)
        r = 1.0 / t
        pv = (p * (sc * r[:, None])[:, None, :]).to(tl.float16)
        unit = tl.broadcast_to(t[:, None], [p.shape[0], p.shape[1]])
        inv_unit = tl.broadcast_to(r[:, None], [p.shape[0], p.shape[1]])
        z = tl.zeros([p.shape[0], p.shape[1]], tl.float32)
    elif LANES:
        # in-place quarters: each group's warp top rounded down to a power of two 2**e (its exponent; at least
        # 2**-24, float16's least): no division, exact rescales, and pv = p scale / 2**e in [0, 2) is the same
        # float16 rounding of the same product as p scale / top
        sc0, sc1, sc2, sc3, zr0, zr1, zr2, zr3, e0, e1, e2, e3 = _group_scales(vs, vz, offs_n, mask_n, NG, MASKED,
                                                                              True)
        scale = _by_row(row_g, (sc0 * _pow2(-e0)[:, None])[:, None, :], (sc1 * _pow2(-e1)[:, None])[:, None, :],
                        (sc2 * _pow2(-e2)[:, None])[:, None, :], (sc3 * _pow2(-e3)[:, None])[:, None, :], NG)
        zero = _by_row(row_g, zr0[:, None, :], zr1[:, None, :], zr2[:, None, :], zr3[:, None, :], NG)
        e = _row_values(row_g, e0, e1, e2, e3, NG, p.shape[1])
        unit = _pow2(e + 4)
        inv_unit = _pow2(-e - 4)
        pv = (p * scale).to(tl.float16)
        pz = p * zero
        z = tl.sum(tl.reshape(pz, [p.shape[0], p.shape[1], p.shape[2] // 8, 8]), 2)  # each lane's (_lane_sums)
    else:
        sc0, sc1, sc2, sc3, zr0, zr1, zr2, zr3, t0, t1, t2, t3 = _group_scales(vs, vz, offs_n, mask_n, NG, MASKED,
                                                                              False)
        r0 = 1.0 / t0
        r1 = 1.0 / t1
        r2 = 1.0 / t2
        r3 = 1.0 / t3
        scale = _by_row(row_g, (sc0 * r0[:, None])[:, None, :], (sc1 * r1[:, None])[:, None, :],
                        (sc2 * r2[:, None])[:, None, :], (sc3 * r3[:, None])[:, None, :], NG)
        zero = _by_row(row_g, zr0[:, None, :], zr1[:, None, :], zr2[:, None, :], zr3[:, None, :], NG)
        unit = _row_values(row_g, t0, t1, t2, t3, NG, p.shape[1]) * 16
        inv_unit = _row_values(row_g, r0, r1, r2, r3, NG, p.shape[1]) * (1 / 16)
        pv = (p * scale).to(tl.float16)
        z = tl.sum(p * zero, 2)
    return pv, unit, inv_unit, z


@triton.jit
def _row_values(row_g, x0, x1, x2, x3, NG: tl.constexpr, M: tl.constexpr):
    """``[W, M]``: row ``r`` takes the per-warp value ``x_g`` (``[W]``) of its group ``g = row_g[r]``."""
    x = _by_row(row_g, x0[:, None, None], x1[:, None, None], x2[:, None, None], x3[:, None, None], NG)
    return tl.max(tl.broadcast_to(x, [x.shape[0], M, 1]), 2)


@triton.jit
def _block(kc, ks, kz, vc, vs, vz, n0, end, offs_w, row_g, ones,
           q0, q1, q2, q3, q4, q5, q6, q7, qs0, qs1, qs2, qs3, qk_scale, zb,
           m_i, l_i, zacc, unit_i, acc0, acc1, acc2, acc3, acc_one,
           NG: tl.constexpr, DP: tl.constexpr, KP: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr,
           FMT: tl.constexpr, ASM: tl.constexpr, IN_PLACE: tl.constexpr, MASKED: tl.constexpr):
    """One block of ``BLOCK_N`` slots from ``n0``, ``BLOCK_N / W`` per warp: the online softmax state,
    updated. The accumulators hold ``acc / unit_i`` (``unit_i``: the last block's ``unit``)."""
    offs_n = n0 + offs_w
    mask_n = offs_n < end
    s = _scores(kc, ks, kz, offs_n, mask_n, q0, q1, q2, q3, q4, q5, q6, q7, qs0, qs1, qs2, qs3, qk_scale, zb,
                NG, DP, KP, KW, FMT, ASM, IN_PLACE, MASKED)
    if MASKED:
        s = tl.where(mask_n[:, None, :], s, float("-inf"))
    if FMT != FMT_FP8 and KP == 4 and IN_PLACE:  # s: the scores over qk_scale (here 64 qk_scale, > 0)
        m_new = tl.maximum(m_i, tl.max(s, 2) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, :, None])  # one fused multiply-add, one rounding
    else:
        m_new = tl.maximum(m_i, tl.max(s, 2))
        p = tl.exp2(s - m_new[:, :, None])
    alpha = tl.exp2(m_i - m_new)
    # in-place quarters: l_i and zacc keep each lane's partial sums ([W, M, 8]), reduced after the loop
    LANES: tl.constexpr = FMT != FMT_FP8 and KP == 4 and IN_PLACE
    pv, unit, inv_unit, z = _value_weights(vs, vz, offs_n, mask_n, p, row_g, NG, FMT, MASKED, LANES)
    if LANES:
        l_i = l_i * alpha[:, :, None] + _lane_sums(p)
        zacc = zacc * alpha[:, :, None] + z
    else:
        l_i = l_i * alpha + tl.sum(p, 2)
        zacc = zacc * alpha + z
    # the words transposed ([W, VW, BW]): the value product's first operand, slots along k
    cols = tl.arange(0, VW)
    w = _load(vc.to(tl.pointer_type(tl.int16)) + offs_n[:, None, :] * VW + cols[None, :, None], mask_n[:, None, :],
              MASKED)
    v0, v1, v2, v3 = code_planes(w, FMT, ASM, IN_PLACE)
    pvt = tl.permute(pv, (0, 2, 1))
    f = (alpha * unit_i * inv_unit)[:, None, :]
    acc0 = tl.dot(v0, pvt, acc0 * f)
    acc1 = tl.dot(v1, pvt, acc1 * f)
    if FMT != FMT_FP8:
        acc2 = tl.dot(v2, pvt, acc2 * f)
        acc3 = tl.dot(v3, pvt, acc3 * f)
        if not IN_PLACE:  # in-place planes carry no offset
            acc_one = tl.dot(ones, pvt, acc_one * f)  # sum_n pv per row (every row of the 16)
    return m_new, l_i, zacc, unit, acc0, acc1, acc2, acc3, acc_one


@triton.jit
def zero_planes(W: tl.constexpr, VW: tl.constexpr, ROWS: tl.constexpr):
    """Four empty value-plane accumulators of a warp kernel (also :mod:`kvlab.kernels.kivi_warp`'s):
    ``out^T`` per warp, ``[W, VW, ROWS]`` float32. One zero tensor serves all: the products make new ones."""
    zero = tl.zeros([W, VW, ROWS], tl.float32)
    return zero, zero, zero, zero


@triton.jit
def _merge_plane(acc, off, wu, z, inv_l):
    """One value plane of the warps' accumulators merged: ``sum_w wu (acc - off) + z``, normalized (``[VW, M]``)."""
    return (tl.sum((acc - off[:, None, :]) * wu[:, None, :], 0) + z[None, :]) * inv_l[None, :]


@triton.jit
def _store_plane(rows, offs_c, keep, out, P: tl.constexpr, VP: tl.constexpr):
    tl.store(rows[None, :] + (offs_c * VP + P)[:, None], out, mask=keep)


@triton.jit
def warp_partial(
    bh, split, b, start, end, row_g, mask_r, heads, q_rows,
    kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, part_out_ptr, part_lse_ptr, qk_scale, Hq, T, num_splits,
    D: tl.constexpr, BLOCK_M: tl.constexpr, NG: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr, IN_PLACE: tl.constexpr,
):
    """The ``warp`` variant's split ``split`` of KV head ``bh`` (slots ``[start, end)``, rows from
    :func:`~kvlab.kernels.decode_reduce.group_rows`): its normalized partial output and base-2 log-sum-exp.
    :func:`kvlab.kernels.decode_entry.decode_kernel` calls it."""
    FP8: tl.constexpr = FMT == FMT_FP8
    DP: tl.constexpr = D if FP8 else D // 2  # bytes of one row
    # key slices per group: fp8 one (the whole row); int4 four word quarters where a group has >= 16
    # words per quarter, else two byte planes; KW: depth of a slice's product
    KP: tl.constexpr = 1 if FP8 else (4 if D // NG >= 64 else 2)
    KW: tl.constexpr = D // NG // KP
    VP: tl.constexpr = 2 if FP8 else 4  # value planes: codes per int16 word
    VW: tl.constexpr = D // VP  # words of one row
    BW: tl.constexpr = BLOCK_N // W  # slots of one warp in a block

    q0, q1, q2, q3, q4, q5, q6, q7 = query_slots(q_rows, mask_r, NG * KP, KP, KW)  # slot i: group i // KP
    # each group's sum of q (the zero term), times the softmax scale
    zb = tl.zeros([16, BLOCK_M], tl.float16)
    score_scale = qk_scale
    if KP == 4 and IN_PLACE and not FP8:
        # in-place quarters: the zero term is a product against zb, the scores come over 64 qk_scale (that
        # factor goes into the softmax's exponent); no row sums in the loop (qs*: unused)
        zb = zero_weights(_row_sum(q0, q1, q2, q3, KP, 1.0).reshape(BLOCK_M),
                          _row_sum(q4, q5, q6, q7, KP, 1.0).reshape(BLOCK_M), NG)
        score_scale = qk_scale * 64
        q0, q1, q2, q3 = _placed_slices(q0, q1, q2, q3)
        q4, q5, q6, q7 = _placed_slices(q4, q5, q6, q7)
        qs0 = qk_scale
        qs1 = qk_scale
        qs2 = qk_scale
        qs3 = qk_scale
    elif KP == 4:
        qs0 = _row_sum(q0, q1, q2, q3, KP, qk_scale)
        qs1 = _row_sum(q4, q5, q6, q7, KP, qk_scale)
        qs2 = qs0
        qs3 = qs0
    else:
        qs0 = _row_sum(q0, q1, q0, q0, KP, qk_scale)
        qs1 = _row_sum(q2, q3, q0, q0, KP, qk_scale)
        qs2 = _row_sum(q4, q5, q0, q0, KP, qk_scale)
        qs3 = _row_sum(q6, q7, q0, q0, KP, qk_scale)

    # finite: a warp whose slots are all masked keeps alpha = 1 and p = 0 (no inf - inf)
    m_i = tl.full([W, BLOCK_M], -1e30, tl.float32)
    if KP == 4 and IN_PLACE and not FP8:  # each lane's partial sums (_lane_sums)
        l_i = tl.zeros([W, BLOCK_M, 8], tl.float32)
        zacc = tl.zeros([W, BLOCK_M, 8], tl.float32)
    else:
        l_i = tl.zeros([W, BLOCK_M], tl.float32)
        zacc = tl.zeros([W, BLOCK_M], tl.float32)
    unit_i = tl.full([W, BLOCK_M], 1.0, tl.float32)
    acc0, acc1, acc2, acc3 = zero_planes(W, VW, BLOCK_M)
    acc_one = tl.zeros([W, 16, BLOCK_M], tl.float32)
    ones = tl.full([W, 16, BW], 1.0, tl.float16)

    # this (b, h)'s rows of the [B, Hkv, T, ...] buffers; offsets inside them are int32
    row0 = bh.to(tl.int64) * T
    kc = kc_ptr + row0 * DP
    vc = vc_ptr + row0 * DP
    ks = ks_ptr + row0 * (1 if FP8 else NG)
    kz = kz_ptr + row0 * (1 if FP8 else NG)
    vs = vs_ptr + row0 * (1 if FP8 else NG)
    vz = vz_ptr + row0 * (1 if FP8 else NG)
    offs_w = tl.arange(0, W)[:, None] * BW + tl.arange(0, BW)[None, :]  # [W, BW]: warp w's slots of a block

    full_end = start + (end - start) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        m_i, l_i, zacc, unit_i, acc0, acc1, acc2, acc3, acc_one = _block(
            kc, ks, kz, vc, vs, vz, n0, end, offs_w, row_g, ones, q0, q1, q2, q3, q4, q5, q6, q7,
            qs0, qs1, qs2, qs3, score_scale, zb, m_i, l_i, zacc, unit_i, acc0, acc1, acc2, acc3, acc_one,
            NG, DP, KP, KW, VW, FMT, ASM, IN_PLACE, False)
    if full_end < end:
        m_i, l_i, zacc, unit_i, acc0, acc1, acc2, acc3, acc_one = _block(
            kc, ks, kz, vc, vs, vz, full_end, end, offs_w, row_g, ones, q0, q1, q2, q3, q4, q5, q6, q7,
            qs0, qs1, qs2, qs3, score_scale, zb, m_i, l_i, zacc, unit_i, acc0, acc1, acc2, acc3, acc_one,
            NG, DP, KP, KW, VW, FMT, ASM, IN_PLACE, True)

    # the warps' softmaxes merged (base 2); the products' offsets (int) taken off per warp
    if KP == 4 and IN_PLACE and not FP8:
        l_i = tl.sum(l_i, 2)
        zacc = tl.sum(zacc, 2)
    m = tl.max(m_i, 0)
    wgt = tl.exp2(m_i - m[None, :])
    l_sum = tl.sum(l_i * wgt, 0)
    z = tl.sum(zacc * wgt, 0)
    has = l_sum > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_sum, 1.0), 0.0)
    lse = tl.where(has, m + tl.log2(tl.where(has, l_sum, 1.0)), float("-inf"))
    part = (b * Hq + heads) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=mask_r & (row_g == 0))
    out_rows = part_out_ptr + part.to(tl.int64) * D
    wu = wgt * unit_i
    off = tl.zeros([W, BLOCK_M], tl.float32) if FP8 or IN_PLACE else tl.max(acc_one, 1)
    # row (g, h) holds head h's output for the columns of group g (words c with c // (VW / NG) == g)
    offs_c = tl.arange(0, VW)
    keep = mask_r[None, :] & ((offs_c // (VW // NG))[:, None] == row_g[None, :])
    if IN_PLACE and not FP8:  # plane q's codes weigh c * 2**(PLACE_BITS[q] - 24), not c / 16 (and carry no 1)
        _store_plane(out_rows, offs_c, keep, _merge_plane(acc0, off, wu * 2.0 ** 20, z, inv_l), 0, VP)
        _store_plane(out_rows, offs_c, keep, _merge_plane(acc1, off, wu * 2.0 ** 16, z, inv_l), 1, VP)
        _store_plane(out_rows, offs_c, keep, _merge_plane(acc2, off, wu * 2.0 ** 18, z, inv_l), 2, VP)
        _store_plane(out_rows, offs_c, keep, _merge_plane(acc3, off, wu * 2.0 ** 14, z, inv_l), 3, VP)
    else:
        _store_plane(out_rows, offs_c, keep, _merge_plane(acc0, off, wu, z, inv_l), 0, VP)
        _store_plane(out_rows, offs_c, keep, _merge_plane(acc1, off, wu, z, inv_l), 1, VP)
        if not FP8:
            _store_plane(out_rows, offs_c, keep, _merge_plane(acc2, off, wu, z, inv_l), 2, VP)
            _store_plane(out_rows, offs_c, keep, _merge_plane(acc3, off, wu, z, inv_l), 3, VP)
