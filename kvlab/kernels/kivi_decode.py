"""Single-query decode attention over a :class:`kvlab.kernels.kivi.KiviStore`: Triton on CUDA, the
torch reference (:func:`kvlab.kernels.kivi.attend`) elsewhere.

    ws = make_kivi_workspace(q_heads, store)        # once, before capturing a graph
    out = kivi_decode_attention(q, store, lengths, scale, workspace=ws)

CUDA-graph capturable as :mod:`kvlab.kernels.decode`: ``lengths`` (int32 ``[B]``) stays on the
device, the grid depends only on B, Hkv and the store's number of groups; the boundary between
codes and ring is computed on the device from the length. Kernels: :mod:`kvlab.kernels.kivi_triton`.
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
BACKENDS = ("auto", "triton", "reference")


@dataclass
class KiviWorkspace:
    """Partials of ``num_splits`` code splits (``split_groups`` groups each) plus the ring's."""

    num_splits: int
    split_groups: int
    part_out: torch.Tensor  # [B, Hq, num_splits + 1, D] float32
    part_lse: torch.Tensor  # [B, Hq, num_splits + 1] float32
    num_warps: int = 4
    block_r: int = 32  # ring slots per iteration


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


def kernel_problem(spec: kivi.KiviSpec, head_dim: int) -> str | None:
    """Why the kernel cannot read a store of ``spec`` at ``head_dim``, or None (no store needed)."""
    d, pack = head_dim, 8 // min(spec.k_bits, spec.v_bits)
    if d & (d - 1) or d // pack < 16:
        return f"head_dim {d} must be a power of two with head_dim / {pack} >= 16"
    return None


def kernel_supports(store: kivi.KiviStore) -> str | None:
    """Why the kernel cannot read this store, or None."""
    return kernel_problem(store.spec, store.head_dim)


def kivi_decode_attention(q: torch.Tensor, store: kivi.KiviStore, lengths: torch.Tensor, scale: float, *,
                          out: torch.Tensor | None = None, workspace: KiviWorkspace | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over each row's first ``lengths[b]`` tokens -> ``[B, Hq, D]``
    (``q.dtype`` from the kernel, float32 from the reference). ``backend`` as
    :func:`kvlab.kernels.decode.decode_attention`."""
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
    if workspace is None:
        workspace = make_kivi_workspace(q_heads, store)
    if out is None:
        out = torch.empty_like(q)
    for t in (q, out, lengths, *store.tensors()):
        if not t.is_contiguous():
            raise FormatError("kivi_decode_attention needs contiguous q, out, lengths and store buffers")
    return _kernels().launch_kivi(q, store, lengths, scale, workspace, out)


def kivi_append(store: kivi.KiviStore, k: torch.Tensor, v: torch.Tensor, position: torch.Tensor, *,
                backend: str = "auto") -> None:
    """:func:`kvlab.kernels.kivi.append` in one Triton launch on CUDA (the torch ops elsewhere): the
    token into its ring slot, and when the ring reaches R + G its oldest group quantized in place; a
    step that fills no group writes nothing else (the kernel branches on the device)."""
    if backend not in BACKENDS:
        raise FormatError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if k.shape != (store.batch, store.kv_heads, 1, store.head_dim) or v.shape != k.shape:
        raise FormatError(f"append takes one token per row, [B={store.batch}, H={store.kv_heads}, 1, "
                          f"D={store.head_dim}], got {list(k.shape)} and {list(v.shape)}")
    if not (backend == "triton" or (backend == "auto" and k.is_cuda)):
        kivi.append(store, k, v, position)
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise FormatError("kivi_append needs a unit-stride head dim")
    _kernels().launch_kivi_append(store, k, v, position)


def _kernels():
    """:mod:`kvlab.kernels.kivi_triton`, imported when a kernel first runs (it imports triton)."""
    from kvlab.kernels import kivi_triton

    return kivi_triton
