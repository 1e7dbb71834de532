"""Single-query decode attention over a :class:`kvlab.kernels.kivi.KiviStore`: Triton on CUDA, the
torch reference (:func:`kvlab.kernels.kivi.attend`) elsewhere.

    ws = make_kivi_workspace(q_heads, store)        # once, before capturing a graph
    out = kivi_decode_attention(q, store, lengths, scale, workspace=ws)

CUDA-graph capturable as :mod:`kvlab.kernels.triton_decode`: ``lengths`` (int32 ``[B]``) stays on the
device, the grid depends only on B, Hkv and the store's number of groups; the boundary between
codes and ring is computed on the device from the length. Kernels: :mod:`kvlab.kernels._kivi_kernels`.
triton is imported only when a kernel runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.energy import cuda_index
from kvlab.kernels import kivi
from kvlab.kernels.formats import FormatError

PROGRAMS_PER_SM = 4
MAX_SPLITS = 128
BLOCK_R = 32  # ring slots per iteration
BACKENDS = ("auto", "triton", "reference")


@dataclass
class KiviWorkspace:
    """Partials of ``num_splits`` code splits (``split_groups`` groups each) plus the ring's."""

    num_splits: int
    split_groups: int
    part_out: torch.Tensor  # [B, Hq, num_splits + 1, D] float32
    part_lse: torch.Tensor  # [B, Hq, num_splits + 1] float32
    num_warps: int = 4


def plan_kivi_splits(batch: int, kv_heads: int, groups: int, sm_count: int,
                     programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(num_splits, split_groups)`` covering ``groups`` code groups with about ``programs_per_sm``
    programs per SM; depends on shapes only."""
    wanted = math.ceil(programs_per_sm * sm_count / (batch * kv_heads))
    splits = max(1, min(wanted, groups, MAX_SPLITS))
    per = max(1, math.ceil(groups / splits))
    return max(1, math.ceil(groups / per)), per


def make_kivi_workspace(q_heads: int, store: kivi.KiviStore, num_splits: int | None = None) -> KiviWorkspace:
    device = store.device
    if num_splits is None:
        sms = torch.cuda.get_device_properties(cuda_index(device)).multi_processor_count if device.type == "cuda" else 8
        num_splits, per = plan_kivi_splits(store.batch, store.kv_heads, store.groups, sms)
    else:
        per = max(1, math.ceil(store.groups / num_splits))
        num_splits = max(1, math.ceil(store.groups / per))
    shape = (store.batch, q_heads, num_splits + 1)
    return KiviWorkspace(num_splits, per, torch.empty(*shape, store.head_dim, dtype=torch.float32, device=device),
                         torch.empty(shape, dtype=torch.float32, device=device))


def kernel_supports(store: kivi.KiviStore) -> str | None:
    """Why the kernel cannot read this store, or None."""
    d, pack = store.head_dim, 8 // store.spec.bits
    if d & (d - 1) or d // pack < 16:
        return f"head_dim {d} must be a power of two with head_dim / {pack} >= 16"
    if store.spec.value_group % pack:
        return f"value group {store.spec.value_group} is not a multiple of {pack}"
    return None


def kivi_decode_attention(q: torch.Tensor, store: kivi.KiviStore, lengths: torch.Tensor, scale: float, *,
                          out: torch.Tensor | None = None, workspace: KiviWorkspace | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over each row's first ``lengths[b]`` tokens -> ``[B, Hq, D]``
    (``q.dtype`` from the kernel, float32 from the reference). ``backend`` as
    :func:`kvlab.kernels.triton_decode.decode_attention`."""
    if backend not in BACKENDS:
        raise FormatError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    batch, q_heads, head_dim = q.shape
    if batch != store.batch or head_dim != store.head_dim or q_heads % store.kv_heads:
        raise FormatError(f"q {list(q.shape)} does not fit a store of B={store.batch}, H={store.kv_heads}, "
                          f"D={store.head_dim}")
    if lengths.shape != (batch,) or lengths.dtype not in (torch.int32, torch.int64):
        raise FormatError(f"lengths must be an int32 tensor [B={batch}], got {lengths.dtype} {list(lengths.shape)}")
    if not (backend == "triton" or (backend == "auto" and q.is_cuda)):
        result = kivi.attend(q, store, lengths, scale)
        return result if out is None else out.copy_(result)
    why = kernel_supports(store)
    if why:
        raise FormatError(why + "; use backend='reference'")
    from kvlab.kernels import _kivi_kernels as kern  # imports triton

    if workspace is None:
        workspace = make_kivi_workspace(q_heads, store)
    if out is None:
        out = torch.empty_like(q)
    for t in (q, out, lengths, *store.tensors()):
        if not t.is_contiguous():
            raise FormatError("kivi_decode_attention needs contiguous q, out, lengths and store buffers")
    spec = store.spec
    group = q_heads // store.kv_heads
    splits = workspace.num_splits
    kern._kivi_split_kernel[(batch * store.kv_heads, splits + 1)](
        q, store.k_codes, store.k_scale, store.k_zero, store.v_codes, store.v_scale, store.v_zero,
        store.ring_k, store.ring_v, lengths, workspace.part_out, workspace.part_lse,
        float(scale) * math.log2(math.e), q_heads, store.kv_heads, store.k_codes.shape[2], store.k_scale.shape[2],
        spec.window, spec.residual, workspace.split_groups, splits, group,
        D=head_dim, BLOCK_H=max(16, 1 << max(0, group - 1).bit_length()), G=spec.group, VG=spec.value_group,
        BLOCK_R=BLOCK_R, BITS=spec.bits, PACK=8 // spec.bits, num_warps=workspace.num_warps,
    )
    kern._kivi_combine_kernel[(batch * q_heads,)](
        workspace.part_out, workspace.part_lse, out, splits + 1, D=head_dim,
        S_P2=max(2, 1 << splits.bit_length()),
    )
    return out
