"""Single-query decode attention that reads the stored codes: Triton on CUDA, the reference elsewhere.

    ws = make_workspace(q_heads, k_store)            # once, before capturing a graph (optional;
                                                     # also carries the LaunchConfig)
    out = decode_attention(q, k_store, v_store, lengths, scale, workspace=ws)

CUDA-graph capturable: ``lengths`` (int32 ``[B]``) stays on the device, the grid and the number of
splits depend only on B, Hkv and the stores' capacity (:func:`plan_splits`), and the partial
buffers have shapes fixed by them. Triton compiles on the first call of a configuration, so call
once before capturing. The cost of fixing the grid: while a row is much shorter than the capacity,
only ``cdiv(length, split_len)`` splits work; an engine that decodes long runs at short lengths can
capture one graph per capacity bucket.

Three kernels do the split step (the reduce, :mod:`~kvlab.kernels.decode_reduce`, is shared):
``split`` (:mod:`~kvlab.kernels.decode_split`), ``fold`` (:mod:`~kvlab.kernels.decode_fold`, which
never dequantizes: group scales and zeros fold into the operands; ``fold_asm`` is fold with int4
codes unpacked by inline PTX) and ``warp`` (:mod:`~kvlab.kernels.decode_warp`: fold with each warp
running its own split, for int4 and fp8; ``warp_asm`` unpacks with PTX; ``warp2``/``warp2_asm``: warp with
int4 quarters unpacked in place, fewer instructions per code; other formats run fold).
``LaunchConfig.variant`` picks one, :data:`DEFAULT_VARIANT` when it says nothing. Everything format-specific (kernel code, packing, groups, tuned geometry) is read from
the stores' format object (:mod:`kvlab.kernels.formats`).

triton is imported only when a kernel runs, so kvlab imports without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cache

import torch

from kvlab.energy import cuda_index
from kvlab.kernels.formats import BLOCK_N, PROGRAMS_PER_SM, FormatError, KVStore, LaunchConfig
from kvlab.kernels.reference import check_decode_inputs, decode_attention_reference

MAX_SPLITS = 128
BACKENDS = ("auto", "triton", "reference")

# The split kernel that runs when a LaunchConfig does not name one (read at launch time):
# "split" dequantizes code tiles to float16 before its products (decode_split), "fold" folds the
# scales and zeros into the operands instead (decode_fold), "fold_asm" is fold with int4 codes
# unpacked by inline PTX, four bytes at a time (formats with ``asm_unpack`` on CUDA only; fold
# elsewhere), "warp" and "warp_asm" are fold with a split per warp (int4 and fp8; fold elsewhere; the
# PTX on CUDA only), "warp2" and "warp2_asm" are warp with int4 quarters unpacked in place (fp8: warp's
# code). Flip after benchmarks/quant_attention.py --tune has measured them on the GPU.
DEFAULT_VARIANT = "split"


def plan_splits(batch: int, kv_heads: int, capacity: int, sm_count: int, block_n: int = BLOCK_N,
                max_splits: int = MAX_SPLITS, programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(num_splits, split_len)`` for a static capacity: enough programs to fill ``sm_count`` SMs.

    Pure: depends on shapes only, never on the current lengths. ``split_len`` is a multiple of
    ``block_n`` and ``num_splits * split_len >= capacity``; no split is empty at full capacity.
    """
    blocks = math.ceil(capacity / block_n)
    wanted = math.ceil(programs_per_sm * sm_count / (batch * kv_heads))
    splits = max(1, min(wanted, blocks, max_splits))
    split_len = math.ceil(blocks / splits) * block_n
    return math.ceil(capacity / split_len), split_len


@dataclass
class DecodeWorkspace:
    """Preallocated partial results of the split kernel, shaped by the static capacity."""

    num_splits: int
    split_len: int
    part_out: torch.Tensor  # [B, Hq, num_splits, D] float32
    part_lse: torch.Tensor  # [B, Hq, num_splits] float32
    config: LaunchConfig = LaunchConfig()

    def fits(self, batch: int, q_heads: int, head_dim: int) -> bool:
        return tuple(self.part_out.shape) == (batch, q_heads, self.num_splits, head_dim)


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def make_workspace(q_heads: int, k_store: KVStore, num_splits: int | None = None,
                   config: LaunchConfig | None = None) -> DecodeWorkspace:
    """Buffers for :func:`decode_attention` on ``k_store``'s device; ``num_splits`` overrides the plan."""
    device = k_store.device
    config = config or k_store.format.launch_config
    block = config.block_n
    if num_splits is None:
        sms = _sm_count(cuda_index(device)) if device.type == "cuda" else 8
        num_splits, split_len = plan_splits(k_store.batch, k_store.kv_heads, k_store.capacity, sms, block,
                                            programs_per_sm=config.programs_per_sm)
    else:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise FormatError(f"num_splits must be in 1..{MAX_SPLITS}, not {num_splits}")
        split_len = math.ceil(math.ceil(k_store.capacity / num_splits) / block) * block
        num_splits = math.ceil(k_store.capacity / split_len)
    shape = (k_store.batch, q_heads, num_splits)
    return DecodeWorkspace(num_splits, split_len,
                           torch.empty(*shape, k_store.head_dim, dtype=torch.float32, device=device),
                           torch.empty(shape, dtype=torch.float32, device=device), config)


def kernel_supports(k_store: KVStore) -> str | None:
    """Why the Triton kernels cannot read this store, or None when they can."""
    fmt, d = k_store.format, k_store.head_dim
    if fmt.kernel is None:
        return f"no kernel for format {fmt.name}"
    if d & (d - 1) or d // fmt.pack < 16:
        return f"head_dim {d} must be a power of two with head_dim / {fmt.pack} >= 16 for {fmt.label}"
    return None


def kernel_variant(config: LaunchConfig, k_store: KVStore) -> str:
    """The kernel that runs for ``config`` on ``k_store``: its variant, or ``split`` where fold cannot,
    ``fold`` for ``fold_asm`` where the format has no PTX unpacking or triton interprets, ``fold``
    (``fold_asm`` for int4 on CUDA) for ``warp``/``warp_asm`` where the warp kernel does not read the
    format (or a store's slots * head dim reach 2**31: its int32 offsets), and ``warp`` for
    ``warp_asm`` (``warp2`` for ``warp2_asm``) where triton interprets."""
    fmt = k_store.format
    variant = config.variant or DEFAULT_VARIANT
    if variant == "split" or not fmt.fold_reads(k_store.head_dim):
        return "split"
    asm = variant.endswith("_asm") and not _interpreted()
    if variant.startswith("warp") and fmt.warp_reads(k_store.head_dim) and k_store.capacity * k_store.head_dim < 2**31:
        warp = variant.removesuffix("_asm")
        return f"{warp}_asm" if asm else warp
    return "fold_asm" if asm and fmt.asm_unpack else "fold"


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def decode_attention(q: torch.Tensor, k_store: KVStore, v_store: KVStore, lengths: torch.Tensor, scale: float,
                     *, out: torch.Tensor | None = None, workspace: DecodeWorkspace | None = None,
                     backend: str = "auto") -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over each row's first ``lengths[b]`` slots -> ``[B, Hq, D]``.

    ``backend="auto"`` runs the Triton kernel on CUDA tensors and the float32 reference elsewhere;
    ``"triton"`` forces the kernel (on CPU tensors it needs ``TRITON_INTERPRET=1`` set before
    triton is first imported); ``"reference"`` forces the reference. The kernel writes ``q.dtype``
    (or into ``out``); the reference returns float32 (copied into ``out`` when given).
    """
    if backend not in BACKENDS:
        raise FormatError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    group = check_decode_inputs(q, k_store, v_store, lengths)
    use_kernel = backend == "triton" or (backend == "auto" and q.is_cuda)
    if not use_kernel:
        result = decode_attention_reference(q, k_store, v_store, lengths, scale)
        return result if out is None else out.copy_(result)
    if type(k_store.format) is not type(v_store.format) or k_store.format.label != v_store.format.label:
        raise FormatError(f"the kernel needs K and V in one format, got {k_store.format.label} "
                          f"and {v_store.format.label}")
    why = kernel_supports(k_store)
    if why:
        raise FormatError(why + "; use backend='reference'")
    return _launch(q, k_store, v_store, lengths, scale, group, out, workspace)


def _launch(q, k_store, v_store, lengths, scale, group, out, workspace):
    try:  # each imports triton
        from kvlab.kernels.decode_entry import decode_kernel, entry_constants
        from kvlab.kernels.decode_reduce import decode_reduce_kernel
    except ImportError as err:
        raise RuntimeError(f"the decode kernels need triton ({err}); install it (CUDA builds of torch ship it) "
                           "or pass backend='reference'") from err

    batch, q_heads, head_dim = q.shape
    fmt = k_store.format
    if workspace is None:
        workspace = make_workspace(q_heads, k_store)
    elif not workspace.fits(batch, q_heads, head_dim) or workspace.num_splits * workspace.split_len < k_store.capacity:
        raise FormatError(f"workspace is for {list(workspace.part_out.shape)} and {workspace.num_splits} x "
                          f"{workspace.split_len} slots, not B={batch}, Hq={q_heads}, D={head_dim}, capacity "
                          f"{k_store.capacity}: build it with make_workspace(q_heads, k_store)")
    if out is None:
        out = torch.empty_like(q)
    for t in (q, out, lengths, *k_store.tensors(), *v_store.tensors()):
        if not t.is_contiguous():
            raise FormatError("decode_attention needs contiguous q, out, lengths and stores; call .contiguous()")

    def extra(t: torch.Tensor | None) -> torch.Tensor:
        return t if t is not None else lengths  # an unused pointer for formats without scales/zeros

    splits, config = workspace.num_splits, workspace.config
    args = (q, fmt.read_codes(k_store), extra(k_store.scale), extra(k_store.zero),
            fmt.read_codes(v_store), extra(v_store.scale), extra(v_store.zero), lengths,
            workspace.part_out, workspace.part_lse,
            float(scale) * math.log2(math.e), q_heads, k_store.kv_heads, k_store.capacity, workspace.split_len,
            splits, group)
    grid = (batch * k_store.kv_heads, splits)
    variant = kernel_variant(config, k_store)
    warps = warp_count(config) if variant.startswith("warp") else config.num_warps
    decode_kernel[grid](*args, **entry_constants(variant, fmt, head_dim, group, config, warps), num_warps=warps,
                        num_stages=config.num_stages)
    decode_reduce_kernel[(batch * q_heads,)](
        workspace.part_out, workspace.part_lse, lengths, out, q_heads, k_store.capacity, workspace.split_len,
        splits, D=head_dim, SPLITS_P2=max(2, triton_next_pow2(splits)),
        num_warps=4 if splits * head_dim <= 4096 else 8,
    )
    return out


def warp_count(config: LaunchConfig) -> int:
    """Warps of a ``warp`` program: ``config.num_warps``, fewer where a warp would get under 16 slots of
    a block (its products need 16)."""
    return max(1, min(config.num_warps, config.block_n // 16))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
