"""The jit steps both decode split kernels share, and the reduce kernel that merges their parts.

Imports triton: the launcher (:mod:`kvlab.kernels.decode`) imports this lazily.

- :func:`split_bounds`: which KV head, batch row and slots ``[start, end)`` a split program reads
  (grid ``(B * Hkv, num_splits)``; a split that starts past the row's length runs zero iterations);
- :func:`query_planes`, :func:`store_plane`: a GQA group's query as ``PACK`` strided planes, and one
  output plane stored back strided (also the KIVI split kernel's, :mod:`kvlab.kernels.kivi_triton`);
- :func:`group_rows`, :func:`query_slots`: the rows of the fold and warp kernels (a query head per
  quantization group) and the query slices their key products take;
- :func:`split_state`, :func:`slot_block`: a split's empty online softmax, and the slots of one block;
- :func:`dense_key_scores`: the scaled scores of a bf16 or fp8 key tile (no group scales; both kernels read those alike);
- :func:`split_result`: a split's ``1 / l`` and base-2 log-sum-exp (zero and ``-inf`` when it saw no token);
- :func:`online_step`: the online softmax step of the KIVI kernels' loops (:mod:`kvlab.kernels.kivi_triton`
  and :mod:`kvlab.kernels.kivi_warp`);
- :func:`decode_reduce_kernel`, grid ``(B * Hq,)``: merges the splits that saw tokens
  (``cdiv(length, split_len)`` of them) with their log-sum-exps.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.jit_constants import FMT_FP8


@triton.jit
def split_bounds(len_ptr, Hkv, T, split_len):
    """``(bh, split, b, h, start, end)`` of this program: KV head ``h`` of row ``b`` reads ``[start, end)``."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), T)
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    return bh, split, b, h, start, end


@triton.jit
def group_rows(q_ptr, b, h, Hq, G,
               D: tl.constexpr, BLOCK_M: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr):
    """``(row_g, mask_r, heads, q_rows)`` of the fold and warp kernels' rows ``r = g * GP + i``: query head
    ``i`` of KV head ``h``'s ``G`` for quantization group ``g``, masked past ``G`` and ``NG``; ``heads``:
    each row's query head, ``q_rows``: its query."""
    offs_r = tl.arange(0, BLOCK_M)
    row_g = offs_r // GP
    row_h = offs_r % GP
    mask_r = (row_h < G) & (row_g < NG)
    heads = h * G + row_h
    return row_g, mask_r, heads, q_ptr + (b * Hq + heads) * D


@triton.jit
def _query_slot(q_rows, mask_r, SLOT: tl.constexpr, PACK: tl.constexpr, GW: tl.constexpr):
    offs = tl.arange(0, GW)
    d = ((SLOT // PACK) * GW + offs) * PACK + SLOT % PACK
    return tl.load(q_rows[:, None] + d[None, :], mask=mask_r[:, None], other=0.0).to(tl.float16)


@triton.jit
def query_slots(q_rows, mask_r, SLOTS: tl.constexpr, PACK: tl.constexpr, GW: tl.constexpr):
    """``(q0, ..., q7)``: slot ``i < SLOTS`` (1, 2, 4 or 8) is plane ``p = i % PACK`` of group
    ``g = i // PACK`` of each row's query, elements ``(g * GW + j) * PACK + p`` as float16 ``[rows, GW]``
    (masked rows 0); slots past ``SLOTS`` repeat ``q0`` (unused)."""
    q0 = _query_slot(q_rows, mask_r, 0, PACK, GW)
    q1 = q0
    q2 = q0
    q3 = q0
    q4 = q0
    q5 = q0
    q6 = q0
    q7 = q0
    if SLOTS >= 2:
        q1 = _query_slot(q_rows, mask_r, 1, PACK, GW)
    if SLOTS >= 4:
        q2 = _query_slot(q_rows, mask_r, 2, PACK, GW)
        q3 = _query_slot(q_rows, mask_r, 3, PACK, GW)
    if SLOTS == 8:
        q4 = _query_slot(q_rows, mask_r, 4, PACK, GW)
        q5 = _query_slot(q_rows, mask_r, 5, PACK, GW)
        q6 = _query_slot(q_rows, mask_r, 6, PACK, GW)
        q7 = _query_slot(q_rows, mask_r, 7, PACK, GW)
    return q0, q1, q2, q3, q4, q5, q6, q7


@triton.jit
def _query_plane(q_rows, offs_j, mask_h, P: tl.constexpr, PACK: tl.constexpr, DTYPE: tl.constexpr):
    return tl.load(q_rows[:, None] + offs_j[None, :] * PACK + P, mask=mask_h[:, None], other=0.0).to(DTYPE)


@triton.jit
def query_planes(q_rows, offs_j, mask_h, PACK: tl.constexpr, DTYPE: tl.constexpr):
    """``(q0, q1, q2, q3)``: plane ``p < PACK`` is ``q[:, p::PACK]`` (``q_rows``: each row's first element,
    ``offs_j``: ``arange(D / PACK)``, masked rows 0) as ``DTYPE``; planes past ``PACK`` repeat ``q0`` (unused)."""
    q0 = _query_plane(q_rows, offs_j, mask_h, 0, PACK, DTYPE)
    q1 = q0
    q2 = q0
    q3 = q0
    if PACK >= 2:
        q1 = _query_plane(q_rows, offs_j, mask_h, 1, PACK, DTYPE)
    if PACK == 4:
        q2 = _query_plane(q_rows, offs_j, mask_h, 2, PACK, DTYPE)
        q3 = _query_plane(q_rows, offs_j, mask_h, 3, PACK, DTYPE)
    return q0, q1, q2, q3


@triton.jit
def store_plane(rows, offs_j, mask_h, acc, inv_l, P: tl.constexpr, PACK: tl.constexpr):
    """Output plane ``P`` (``acc * inv_l``) into elements ``j * PACK + P`` of each row from ``rows``."""
    tl.store(rows[:, None] + offs_j[None, :] * PACK + P, acc * inv_l[:, None], mask=mask_h[:, None])


@triton.jit
def split_state(ROWS: tl.constexpr, DP: tl.constexpr):
    """A split's empty online softmax: ``m_i``, ``l_i`` per row and four ``[ROWS, DP]`` accumulators
    (one per packed plane; bf16/fp8 use the first)."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc0 = tl.zeros([ROWS, DP], tl.float32)
    acc1 = tl.zeros([ROWS, DP], tl.float32)
    acc2 = tl.zeros([ROWS, DP], tl.float32)
    acc3 = tl.zeros([ROWS, DP], tl.float32)
    return m_i, l_i, acc0, acc1, acc2, acc3


@triton.jit
def slot_block(row0, n0, end, BLOCK_N: tl.constexpr):
    """``(mask_n, slots)`` of the ``BLOCK_N`` slots from ``n0``: which are before ``end``, and their
    index in the ``[B, Hkv, T, ...]`` buffers (``row0``: this KV head's first)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < end
    slots = row0 + offs_n
    return mask_n, slots


@triton.jit
def dense_key_scores(k_ptrs, ks_ptr, slots, mask_n, q0, qk_scale, FMT: tl.constexpr):
    """Scores of a bf16 or fp8 key tile (``k_ptrs``: its codes) times ``qk_scale``; fp8 codes (bytes,
    bitcast) are multiplied by their per-token scale (``ks_ptr`` at ``slots``) after the product."""
    if FMT == FMT_FP8:
        k_raw = tl.load(k_ptrs, mask=mask_n[:, None], other=0)
        k = k_raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        k_sc = tl.load(ks_ptr + slots, mask=mask_n, other=0.0)
        s = tl.dot(q0, tl.trans(k)) * (k_sc * qk_scale)[None, :]
    else:
        k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0).to(tl.float16)
        s = tl.dot(q0, tl.trans(k)) * qk_scale
    return s


@triton.jit
def split_result(m_i, l_i):
    """``(inv_l, lse)`` of a split's online softmax: ``1 / l`` and base-2 log-sum-exp per row."""
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    return inv_l, lse


@triton.jit
def online_step(m_i, l_i, s):
    """One online-softmax step (base 2): ``(m_new, l_new, alpha, p)``, ``p`` float16 for the value
    product; safe when a row of ``s`` is all ``-inf``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p.to(tl.float16)


@triton.jit(do_not_specialize=["Hq", "T", "split_len", "num_splits"])
def decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, len_ptr, out_ptr, Hq, T, split_len, num_splits,
    D: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    bq = tl.program_id(0)
    b = bq // Hq
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b).to(tl.int32), 0), T)
    n_valid = tl.cdiv(length, split_len)  # splits that saw at least one token
    merge_splits(part_out_ptr, part_lse_ptr, out_ptr, bq, n_valid, bq.to(tl.int64) * num_splits, D, SPLITS_P2)


@triton.jit
def merge_splits(part_out_ptr, part_lse_ptr, out_ptr, bq, n, base, D: tl.constexpr, S_P2: tl.constexpr):
    """Query head ``bq``'s output from its first ``n`` splits' normalized partials (rows ``base ...``),
    weighted by their log-sum-exps (base 2); a split with ``lse = -inf`` saw no token and weighs 0."""
    offs_s = tl.arange(0, S_P2)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < n
    lse = tl.load(part_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no split saw a token (length 0): keep exp2 finite
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)
    parts = tl.load(part_out_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + bq.to(tl.int64) * D + offs_d, out.to(out_ptr.dtype.element_ty))
