"""The merge pass of split-K decode kernels whose splits may see no token (KIVI's code splits past
the boundary, Quest's unused page slots): one program per query head merges its splits' normalized
outputs by their log-sum-exps (base 2). Imports triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["S"])
def merge_partials_kernel(part_out_ptr, part_lse_ptr, out_ptr, S, D: tl.constexpr, S_P2: tl.constexpr):
    """Merge one query head's ``S`` partials; a partial with ``lse = -inf`` saw no token and weighs 0."""
    bq = tl.program_id(0)
    offs_s = tl.arange(0, S_P2)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < S
    base = bq.to(tl.int64) * S
    lse = tl.load(part_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(mask_s, tl.exp2(lse - m), 0.0)
    parts = tl.load(part_out_ptr + (base + offs_s)[:, None] * D + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + bq.to(tl.int64) * D + offs_d, out.to(out_ptr.dtype.element_ty))


def merge_partials(part_out, part_lse, out):
    """``out [B, Hq, D]`` from ``part_out [B, Hq, S, D]`` and ``part_lse [B, Hq, S]`` (float32)."""
    batch, q_heads, splits, head_dim = part_out.shape
    merge_partials_kernel[(batch * q_heads,)](part_out, part_lse, out, splits, D=head_dim,
                                              S_P2=max(2, triton.next_power_of_2(splits)))
    return out
