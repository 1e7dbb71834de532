"""One block of an online softmax over slots (imports triton; import lazily), shared by the decode
kernels that run one program per (row, query head) and keep its state in registers: the running max
``m``, the denominator and the weighted sum of values."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_block(m, denom, acc, s, v):
    """The state after scores ``s [BLOCK_N]`` (masked slots at -inf) of values ``v [BLOCK_N, D]``."""
    m_new = tl.maximum(m, tl.max(s, axis=0))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    denom = denom * alpha + tl.sum(p, axis=0)
    return m_new, denom, acc
