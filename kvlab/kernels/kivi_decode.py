"""Single-query decode attention over a :class:`kvlab.kernels.kivi.KiviStore`: Triton on CUDA, the
torch reference (:func:`kvlab.kernels.kivi.attend`) elsewhere.

    ws = make_kivi_workspace(q_heads, store)        # once, before capturing a graph
    out = kivi_decode_attention(q, store, lengths, scale, workspace=ws)

Two variants of one kernel (``kivi_triton.kivi_decode_kernel``) read the codes (:data:`VARIANTS`):
``split`` (:mod:`kvlab.kernels.kivi_triton`) and ``warp``/``warp_asm`` (:mod:`kvlab.kernels.kivi_warp`:
a split per warp, the query folded per key group; ``warp_asm`` the default, 3.1-3.4x split's speed at
batch 16 on the H200 with the same error), picked by
``make_kivi_workspace(variant=...)``, ``kivi_decode_attention(variant=...)``
or :data:`DEFAULT_VARIANT`.

CUDA-graph capturable as :mod:`kvlab.kernels.decode`: ``lengths`` (int32 ``[B]``) stays on the
device, the grid depends only on B, Hkv and the store's number of groups; the boundary between
codes and ring is computed on the device from the length. Kernels: :mod:`kvlab.kernels.kivi_triton`.
triton is imported only when a kernel runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from kvlab.energy import cuda_index
from kvlab.kernels import kivi
from kvlab.kernels.formats import FormatError

PROGRAMS_PER_SM = 4
MAX_SPLITS = 128
BACKENDS = ("auto", "triton", "reference")
# "split": kivi_triton's split variant (the layouts warp cannot read fall back to it); "warp": the variant
# of kvlab.kernels.kivi_warp (a split per warp, the query folded per key group; split where it cannot
# read the store); "warp_asm": warp with codes unpacked by inline PTX (CUDA only; warp when interpreted)
VARIANTS = ("split", "warp", "warp_asm")
DEFAULT_VARIANT = "warp_asm"  # what make_kivi_workspace asks for when not told (read when it runs)


@dataclass
class KiviWorkspace:
    """Partials of ``num_splits`` code splits (``split_groups`` groups each) plus the ring's."""

    num_splits: int
    split_groups: int
    part_out: torch.Tensor  # [B, Hq, num_splits + 1, D] float32
    part_lse: torch.Tensor  # [B, Hq, num_splits + 1] float32
    num_warps: int = 4
    block_r: int = 32  # ring slots per iteration
    variant: str = "split"  # the kernel asked for (VARIANTS); kivi_variant says which runs


def plan_kivi_splits(batch: int, kv_heads: int, groups: int, sm_count: int,
                     programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(num_splits, split_groups)`` covering ``groups`` code groups with about ``programs_per_sm``
    programs per SM; depends on shapes only."""
    wanted = math.ceil(programs_per_sm * sm_count / (batch * kv_heads))
    splits = max(1, min(wanted, groups, MAX_SPLITS))
    per = max(1, math.ceil(groups / splits))
    return max(1, math.ceil(groups / per)), per


def make_kivi_workspace(q_heads: int, store: kivi.KiviStore, num_splits: int | None = None,
                        variant: str | None = None) -> KiviWorkspace:
    """Partials for one decode step of ``store``; ``variant`` (:data:`VARIANTS`, else
    :data:`DEFAULT_VARIANT`) is the kernel it asks for."""
    variant = variant or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise FormatError(f"KIVI kernel variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    device = store.device
    if num_splits is None:
        sms = torch.cuda.get_device_properties(cuda_index(device)).multi_processor_count if device.type == "cuda" else 8
        num_splits, per = plan_kivi_splits(store.batch, store.kv_heads, store.groups, sms)
    else:
        per = max(1, math.ceil(store.groups / num_splits))
        num_splits = max(1, math.ceil(store.groups / per))
    shape = (store.batch, q_heads, num_splits + 1)
    return KiviWorkspace(num_splits, per, torch.empty(*shape, store.head_dim, dtype=torch.float32, device=device),
                         torch.empty(shape, dtype=torch.float32, device=device), variant=variant)


def kernel_problem(spec: kivi.KiviSpec, head_dim: int) -> str | None:
    """Why the kernel cannot read a store of ``spec`` at ``head_dim``, or None (no store needed)."""
    d, pack = head_dim, 8 // min(spec.k_bits, spec.v_bits)
    if d & (d - 1) or d // pack < 16:
        return f"head_dim {d} must be a power of two with head_dim / {pack} >= 16"
    return None


def kernel_supports(store: kivi.KiviStore) -> str | None:
    """Why the kernel cannot read this store, or None."""
    return kernel_problem(store.spec, store.head_dim)


def warp_problem(spec: kivi.KiviSpec, head_dim: int, gqa: int, tokens: int = 0) -> str | None:
    """Why the ``warp`` kernel cannot read a store of ``spec`` at ``head_dim`` and GQA group ``gqa``
    (``tokens``: its code slots), or None: its products need 16 words per code plane (a word holds
    ``16 / bits`` codes), its rows (the GQA group, rounded up to a power of two, times the value groups
    of a head) must stay within 16, and its offsets inside one KV head are int32."""
    why = kernel_problem(spec, head_dim)
    if why:
        return why
    if head_dim * min(spec.k_bits, spec.v_bits) < 16 * 16:
        return f"head_dim {head_dim} holds fewer than 16 int16 words of {min(spec.k_bits, spec.v_bits)}-bit codes"
    rows = (1 << max(0, gqa - 1).bit_length()) * (head_dim // spec.value_group)
    if head_dim // spec.value_group > 4 or rows > 16:
        return f"{head_dim // spec.value_group} value groups per head times GQA {gqa} exceed the 16 rows of the warp kernel"
    if tokens * head_dim >= 2**31:
        return "a KV head's code slots times head_dim reach 2**31 (int32 offsets)"
    return None


def kivi_variant(variant: str, store: kivi.KiviStore, gqa: int) -> str:
    """The kernel that runs when ``variant`` is asked for: ``warp``/``warp_asm`` where
    :func:`warp_problem` finds nothing (``warp`` when triton interprets: no PTX), else ``split``."""
    if variant == "split" or warp_problem(store.spec, store.head_dim, gqa, store.k_codes.shape[2]):
        return "split"
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return "warp" if interpreted else variant


def kivi_decode_attention(q: torch.Tensor, store: kivi.KiviStore, lengths: torch.Tensor, scale: float, *,
                          out: torch.Tensor | None = None, workspace: KiviWorkspace | None = None,
                          backend: str = "auto", variant: str | None = None) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over each row's first ``lengths[b]`` tokens -> ``[B, Hq, D]``
    (``q.dtype`` from the kernel, float32 from the reference). ``backend`` as
    :func:`kvlab.kernels.decode.decode_attention`; ``variant`` (:data:`VARIANTS`) overrides the
    workspace's."""
    if variant is not None and variant not in VARIANTS:
        raise FormatError(f"KIVI kernel variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
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
    chosen = kivi_variant(variant or workspace.variant, store, q_heads // store.kv_heads)
    return _kernels().launch_kivi(q, store, lengths, scale, workspace, out, chosen)


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
