"""Triton kernel of Quest's bounds append (:func:`kvlab.kernels.quest.append_bounds`) and its launch
(imports triton; import lazily).

One decode token's key folded into its page's min/max, one launch per layer: grid ``(B * Hkv,)``,
program ``(b, h)`` reads the key row and the page's two bound rows and writes them back (the first
token of a page replaces them). The torch path is about eight kernels per layer (the dtype cast, two
``index_select``, ``minimum``/``maximum``, two ``where``, two ``index_copy_``), each too small to
keep the GPU busy between graph nodes. The position stays on the device: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["Hkv", "page", "skb", "skh", "snb", "snh", "snp", "sxb", "sxh", "sxp"])
def quest_bounds_append_kernel(
    key_ptr, pos_ptr, kmin_ptr, kmax_ptr, Hkv, page, skb, skh, snb, snh, snp, sxb, sxh, sxp,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // Hkv).to(tl.int64)
    h = (bh % Hkv).to(tl.int64)
    pos = tl.load(pos_ptr).to(tl.int64)
    p = pos // page
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    # compared as float32 (exact: the result is one of the two values, in the bounds' dtype; Triton's
    # CPU interpreter would compare bfloat16 as raw bits)
    key = tl.load(key_ptr + b * skb + h * skh + offs, mask=mask).to(kmin_ptr.dtype.element_ty).to(tl.float32)
    lo_ptr = kmin_ptr + b * snb + h * snh + p * snp + offs
    hi_ptr = kmax_ptr + b * sxb + h * sxh + p * sxp + offs
    fresh = pos % page == 0
    lo = tl.where(fresh, key, tl.minimum(tl.load(lo_ptr, mask=mask).to(tl.float32), key))
    hi = tl.where(fresh, key, tl.maximum(tl.load(hi_ptr, mask=mask).to(tl.float32), key))
    tl.store(lo_ptr, lo.to(kmin_ptr.dtype.element_ty), mask=mask)
    tl.store(hi_ptr, hi.to(kmax_ptr.dtype.element_ty), mask=mask)


def launch_bounds_append(kmin: torch.Tensor, kmax: torch.Tensor, key: torch.Tensor, position: torch.Tensor,
                         page: int) -> None:
    """Fold ``key [B, Hkv, 1, D]`` (unit-stride head dim) at ``position`` (``[1]`` on the device) into
    ``kmin``/``kmax [B, Hkv, pages, D]`` (unit-stride head dim); :func:`kvlab.kernels.quest.append_bounds`
    checks the arguments."""
    batch, kv_heads, _, head_dim = key.shape
    sk, sn, sx = key.stride(), kmin.stride(), kmax.stride()
    quest_bounds_append_kernel[(batch * kv_heads,)](
        key, position, kmin, kmax, kv_heads, page, sk[0], sk[1], sn[0], sn[1], sn[2], sx[0], sx[1], sx[2],
        D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=1,
    )
