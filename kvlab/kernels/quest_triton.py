"""Triton kernel of :mod:`kvlab.kernels.quest_decode` and its launch (imports triton; import lazily).

Split-K over the selected list: grid ``(B * Hkv, num_splits)``; program ``(b, h, s)`` reads entries
``[s * per, min((s + 1) * per, k))`` of row ``pages[b, h]`` (``-1``: no page, skipped by masking),
``NPAGES`` pages of ``P`` tokens per iteration (one tile of ``NPAGES * P`` gathered tokens;
:data:`kvlab.kernels.quest_decode.TOKENS_PER_ITER` says which is faster), for all ``GQ`` query heads of the KV head (``BLOCK_H >= 16`` rows,
``tl.dot`` on float16 operands, float32 online softmax), tokens past the row's length masked.
K/V are read in place through their strides, so both ``[B, C, Hkv, D]`` buffers and ``[B, Hkv, C, D]``
stores (the fast engine's dense store) work. The partials are merged by
:func:`kvlab.kernels.merge_triton.merge_partials` (a split whose entries are all ``-1`` saw nothing).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from kvlab.kernels.merge_triton import merge_partials


@triton.jit(do_not_specialize=["Hq", "Hkv", "K", "per", "num_splits", "GQ", "skb", "skh", "skt", "svb", "svh",
                               "svt"])
def _quest_split_kernel(
    q_ptr, k_ptr, v_ptr, pages_ptr, len_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, Hq, Hkv, K, per, num_splits, GQ, skb, skh, skt, svb, svh, svt,
    D: tl.constexpr, P: tl.constexpr, NPAGES: tl.constexpr, BLOCK_H: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // Hkv
    h = bh % Hkv
    length = tl.load(len_ptr + b).to(tl.int32)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GQ
    heads = h * GQ + offs_h
    offs_d = tl.arange(0, D)
    offs_p = tl.arange(0, NPAGES * P)
    q = tl.load(q_ptr + (b * Hq + heads)[:, None] * D + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    q = q.to(tl.float16)
    k_base = k_ptr + b.to(tl.int64) * skb + h.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + h.to(tl.int64) * svh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    start = split * per
    end = tl.minimum(start + per, K)
    row = pages_ptr + bh.to(tl.int64) * K
    for i in range(start, end, NPAGES):
        entry = i + offs_p // P  # NPAGES pages of P tokens per iteration: one index per token
        page = tl.load(row + entry, mask=entry < end, other=-1).to(tl.int64)
        toks = page * P + offs_p % P
        mask_t = (page >= 0) & (toks < length)  # page -1: no page
        k = tl.load(k_base + toks[:, None] * skt + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(tl.float16))) * qk_scale
        s = tl.where(mask_t[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        v = tl.load(v_base + toks[:, None] * svt + offs_d[None, :], mask=mask_t[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))

    has = l_i > 0
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    part = (b * Hq + heads) * num_splits + split
    tl.store(part_lse_ptr + part, lse, mask=mask_h)
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    tl.store(part_out_ptr + part.to(tl.int64)[:, None] * D + offs_d[None, :], acc * inv_l[:, None],
             mask=mask_h[:, None])


def launch_quest(q, keys, values, pages, lengths, scale, page, workspace, out, token_dim):
    """Both launches of one sparse step (:func:`kvlab.kernels.quest_decode.quest_decode_attention`
    checks the arguments); ``token_dim`` is 1 (``[B, C, H, D]``) or 2 (``[B, H, C, D]``)."""
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[3 - token_dim]
    splits = workspace.num_splits
    group = q_heads // kv_heads
    sk, sv = keys.stride(), values.stride()
    _quest_split_kernel[(batch * kv_heads, splits)](
        q, keys, values, pages, lengths, workspace.part_out, workspace.part_lse,
        float(scale) * math.log2(math.e), q_heads, kv_heads, pages.shape[2], workspace.per_split, splits, group,
        sk[0], sk[3 - token_dim], sk[token_dim], sv[0], sv[3 - token_dim], sv[token_dim],
        D=head_dim, P=page, NPAGES=workspace.pages_per_iter, BLOCK_H=max(16, triton.next_power_of_2(group)),
        num_warps=workspace.num_warps,
    )
    return merge_partials(workspace.part_out, workspace.part_lse, out)
