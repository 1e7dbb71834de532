"""The merge pass of split-K decode kernels whose splits may see no token (KIVI's code splits past
the boundary, Quest's unused page slots): one program per query head merges its splits' normalized
outputs by their log-sum-exps (base 2). Imports triton."""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_reduce import merge_splits


@triton.jit(do_not_specialize=["S"])
def merge_partials_kernel(part_out_ptr, part_lse_ptr, out_ptr, S, D: tl.constexpr, S_P2: tl.constexpr):
    """Merge one query head's ``S`` partials; a partial with ``lse = -inf`` saw no token and weighs 0."""
    bq = tl.program_id(0)
    merge_splits(part_out_ptr, part_lse_ptr, out_ptr, bq, S, bq.to(tl.int64) * S, D, S_P2)


def merge_partials(part_out, part_lse, out):
    """``out [B, Hq, D]`` from ``part_out [B, Hq, S, D]`` and ``part_lse [B, Hq, S]`` (float32)."""
    batch, q_heads, splits, head_dim = part_out.shape
    merge_partials_kernel[(batch * q_heads,)](part_out, part_lse, out, splits, D=head_dim,
                                              S_P2=max(2, triton.next_power_of_2(splits)))
    return out
