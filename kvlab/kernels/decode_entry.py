"""The decode-attention split kernel every variant runs through (imports triton; import lazily): one
entry, :func:`decode_kernel`, whose ``VARIANT`` constexpr picks ``split``
(:mod:`kvlab.kernels.decode_split`), ``fold`` (:mod:`kvlab.kernels.decode_fold`) or ``warp``
(:mod:`kvlab.kernels.decode_warp`). One launcher (:mod:`kvlab.kernels.decode`) launches any variant
with the same arguments, so one signature holds them; each variant's constexprs are set by
:func:`entry_constants`, the others stay 0. Grid ``(B * Hkv, num_splits)``; the partials are merged
by :mod:`kvlab.kernels.decode_reduce`. The entry does the steps the bodies share (the program's split,
:func:`~kvlab.kernels.decode_reduce.split_bounds`; fold's and warp's rows,
:func:`~kvlab.kernels.decode_reduce.group_rows`), so each body takes only what it reads. The bodies are called
from the entry itself, as in KIVI's entry, where a wrapper between them changed the SASS.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvlab.kernels.decode_fold import fold_partial
from kvlab.kernels.decode_reduce import group_rows, split_bounds
from kvlab.kernels.decode_split import split_partial
from kvlab.kernels.decode_warp import warp_partial
from kvlab.kernels.formats import KVFormat, LaunchConfig

ENTRY_CONSTANTS = ("VARIANT", "D", "BLOCK_N", "FMT", "BLOCK_H", "BITS", "PACK", "QGROUP", "BLOCK_M", "GP", "NG",
                   "ASM", "W", "IN_PLACE")


@triton.jit(do_not_specialize=["Hq", "Hkv", "T", "split_len", "num_splits", "G"])
def decode_kernel(
    q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, len_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, Hq, Hkv, T, split_len, num_splits, G,
    VARIANT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, FMT: tl.constexpr,
    BLOCK_H: tl.constexpr, BITS: tl.constexpr, PACK: tl.constexpr, QGROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, GP: tl.constexpr, NG: tl.constexpr, ASM: tl.constexpr, W: tl.constexpr,
    IN_PLACE: tl.constexpr,
):
    bh, split, b, h, start, end = split_bounds(len_ptr, Hkv, T, split_len)
    if VARIANT == "split":
        split_partial(bh, split, b, h, start, end, q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                      part_out_ptr, part_lse_ptr, qk_scale, Hq, T, num_splits, G,
                      D, BLOCK_H, BLOCK_N, FMT, BITS, PACK, QGROUP)
    else:
        # fold and warp lay their rows out alike (a row per quantization group and query head): set up here
        row_g, mask_r, heads, q_rows = group_rows(q_ptr, b, h, Hq, G, D, BLOCK_M, GP, NG)
        if VARIANT == "warp":
            warp_partial(bh, split, b, start, end, row_g, mask_r, heads, q_rows, kc_ptr, ks_ptr, kz_ptr, vc_ptr,
                         vs_ptr, vz_ptr, part_out_ptr, part_lse_ptr, qk_scale, Hq, T, num_splits,
                         D, BLOCK_M, NG, BLOCK_N, FMT, ASM, W, IN_PLACE)
        else:
            fold_partial(bh, split, b, start, end, row_g, mask_r, heads, q_rows, kc_ptr, ks_ptr, kz_ptr, vc_ptr,
                         vs_ptr, vz_ptr, part_out_ptr, part_lse_ptr, qk_scale, Hq, T, num_splits,
                         D, BLOCK_M, NG, BLOCK_N, FMT, BITS, PACK, ASM)


def entry_constants(variant: str, fmt: KVFormat, head_dim: int, group: int, config: LaunchConfig,
                    warps: int) -> dict:
    """The constexprs of :func:`decode_kernel` for a resolved ``variant`` (``split``, ``fold``,
    ``fold_asm``, ``warp``, ``warp_asm``, ``warp2``, ``warp2_asm``) of ``fmt`` at GQA ``group``;
    ``warps``: the launch's warps (the warp kernel's ``W``)."""
    gp = triton.next_power_of_2(group)
    row_groups = head_dim // fmt.group_size(head_dim)
    consts = dict.fromkeys(ENTRY_CONSTANTS, 0)
    consts.update(D=head_dim, BLOCK_N=config.block_n, FMT=fmt.kernel)
    if variant.startswith("warp"):
        consts.update(VARIANT="warp", BLOCK_M=triton.next_power_of_2(row_groups * gp), GP=gp, NG=row_groups,
                      ASM=variant.endswith("_asm"), W=warps, IN_PLACE=variant.startswith("warp2"))
    elif variant != "split":
        consts.update(VARIANT="fold", BLOCK_M=max(16, triton.next_power_of_2(row_groups * gp)), GP=gp,
                      NG=row_groups, BITS=fmt.bits, PACK=fmt.pack, ASM=variant == "fold_asm" and fmt.asm_unpack)
    else:
        consts.update(VARIANT="split", BLOCK_H=max(16, triton.next_power_of_2(group)), BITS=fmt.bits, PACK=fmt.pack,
                      QGROUP=fmt.group_size(head_dim))
    return consts
