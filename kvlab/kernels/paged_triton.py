"""Decode attention over block tables in Triton (imports triton; import lazily, through
:mod:`kvlab.kernels.paged`): one query token per request, K/V read in place from a model-dtype pool's ``[slots, Hkv, D]`` buffers through each request's
block table. Grid ``(B, Hkv)``: a program holds the ``G`` query heads of one KV head (padded to
``BLOCK_H >= 16`` rows for ``tl.dot``) and walks the request's blocks with a float32 online softmax.
Checked against :func:`kvlab.serve.forward.paged_decode_reference` (the Triton interpreter on CPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, scale, table_stride,
                         HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(len_ptr + b)
    offs_g = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    offs_s = tl.arange(0, BS)
    mask_g = offs_g < G
    rows = (b * HKV + h) * G + offs_g
    q = tl.load(q_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_g[:, None], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    den = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for i in range(0, tl.cdiv(length, BS)):
        block = tl.load(table_ptr + b * table_stride + i).to(tl.int64)
        slots = block * BS + offs_s
        valid = i * BS + offs_s < length
        where = (slots[:, None] * HKV + h) * D + offs_d[None, :]
        k = tl.load(k_ptr + where, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + where, mask=valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        den = den * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
        m = m_new
    out = acc / den[:, None]
    tl.store(out_ptr + rows[:, None] * D + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """``q [B, Hq, D]``, pools ``[slots, Hkv, D]``, ``tables [B, max_blocks]`` int32, ``lengths [B]``
    int32 (slots held, each >= 1) -> ``[B, Hq, D]``."""
    bsz, hq, dim = q.shape
    hkv = k_pool.shape[1]
    out = torch.empty_like(q)
    block_h = max(16, triton.next_power_of_2(hq // hkv))
    _paged_decode_kernel[(bsz, hkv)](q.contiguous(), k_pool, v_pool, tables, lengths, out, scale, tables.stride(0),
                                     HKV=hkv, G=hq // hkv, D=dim, BS=block_size, BLOCK_H=block_h)
    return out
