"""Quest decode step on the device: select pages from the bounds (torch, fixed shapes), then attend
over the selected pages only (Triton on CUDA, :func:`kvlab.kernels.quest.sparse_attend` elsewhere).

    ws = make_quest_workspace(q_heads, batch, kv_heads, spec.selected(capacity), head_dim, device)
    pages = select_pages(q, bounds, lengths)                 # kvlab.kernels.quest
    out = quest_decode_attention(q, keys, values, pages, lengths, scale, spec.page, workspace=ws)

CUDA-graph capturable: the grid depends on B, Hkv and ``k`` (a constant of the store), the pages and
lengths stay on the device. Kernel: :mod:`kvlab.kernels.quest_triton`; triton is imported only when it
runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.energy import cuda_index
from kvlab.kernels import quest
from kvlab.kernels.formats import FormatError

PROGRAMS_PER_SM = 4
# Tokens the sparse kernel gathers per iteration (a page at least). One page of 16 is best: on an H100
# at 16k, Quest 2048, 64 tokens took 1.16x 16's time at batch 16 and 0.97x at batch 1 (the call's
# 0.02 ms; benchmarks/kivi_quest.py --quest-tokens-per-iter).
TOKENS_PER_ITER = 16
BACKENDS = ("auto", "triton", "reference")


@dataclass
class QuestWorkspace:
    num_splits: int
    per_split: int  # selected pages per split
    part_out: torch.Tensor  # [B, Hq, num_splits, D] float32
    part_lse: torch.Tensor  # [B, Hq, num_splits] float32
    num_warps: int = 4
    pages_per_iter: int = 1  # pages the kernel gathers per iteration (a power of two)


def plan_quest_splits(batch: int, kv_heads: int, selected: int, sm_count: int,
                      programs_per_sm: int = PROGRAMS_PER_SM) -> tuple[int, int]:
    """``(num_splits, pages per split)`` over ``selected`` pages, about ``programs_per_sm`` per SM."""
    wanted = math.ceil(programs_per_sm * sm_count / (batch * kv_heads))
    splits = max(1, min(wanted, selected))
    per = math.ceil(selected / splits)
    return math.ceil(selected / per), per


def make_quest_workspace(q_heads: int, batch: int, kv_heads: int, selected: int, head_dim: int,
                         device: torch.device | str, num_splits: int | None = None, page: int = 16,
                         tokens_per_iter: int = TOKENS_PER_ITER) -> QuestWorkspace:
    """Buffers and geometry of the sparse kernel: splits of whole iterations (``tokens_per_iter // page``
    pages each, at least one)."""
    device = torch.device(device)
    per_iter = max(1, tokens_per_iter // page)
    if per_iter & (per_iter - 1):
        raise FormatError(f"tokens_per_iter // page must be a power of two, got {tokens_per_iter} // {page}")
    if num_splits is None:
        sms = torch.cuda.get_device_properties(cuda_index(device)).multi_processor_count if device.type == "cuda" else 8
        num_splits, per = plan_quest_splits(batch, kv_heads, selected, sms)
    else:
        per = math.ceil(selected / num_splits)
    per = math.ceil(per / per_iter) * per_iter
    num_splits = math.ceil(selected / per)
    shape = (batch, q_heads, num_splits)
    return QuestWorkspace(num_splits, per, torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
                          torch.empty(shape, dtype=torch.float32, device=device), pages_per_iter=per_iter)


def kernel_problem(head_dim: int, page: int) -> str | None:
    """Why the sparse kernel cannot read pages of ``page`` tokens at ``head_dim``, or None."""
    if head_dim & (head_dim - 1) or head_dim < 16 or page < 16:
        return f"the kernel needs a power-of-two head_dim >= 16 and pages of >= 16 tokens (got {head_dim}, {page})"
    return None


def quest_decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pages: torch.Tensor,
                           lengths: torch.Tensor, scale: float, page: int, *, token_dim: int = 2,
                           out: torch.Tensor | None = None, workspace: QuestWorkspace | None = None,
                           backend: str = "auto") -> torch.Tensor:
    """Attention of ``q [B, Hq, D]`` over the selected ``pages [B, Hkv, k]`` of ``keys``/``values``
    (``[B, H, C, D]`` with ``token_dim=2``, the fast engine's dense store; ``[B, C, H, D]`` with ``token_dim=1``);
    ``q.dtype`` from the kernel, float32 from the reference."""
    if backend not in BACKENDS:
        raise FormatError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if token_dim not in (1, 2):
        raise FormatError(f"token_dim must be 1 ([B, C, H, D]) or 2 ([B, H, C, D]), not {token_dim}")
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[3 - token_dim]
    if pages.dim() != 3 or pages.shape[:2] != (batch, kv_heads):
        raise FormatError(f"pages must be [B={batch}, Hkv={kv_heads}, k] (one set per KV head: the kernel "
                          f"does not read group_reduce='head'), got {list(pages.shape)}")
    if q_heads % kv_heads or keys.shape[-1] != head_dim or keys.shape != values.shape:
        raise FormatError(f"q {list(q.shape)}, keys {list(keys.shape)}, values {list(values.shape)} do not fit")
    if not (backend == "triton" or (backend == "auto" and q.is_cuda)):
        if token_dim == 1:
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        result = quest.sparse_attend(q, keys, values, pages, lengths, scale, page)
        return result if out is None else out.copy_(result)
    why = kernel_problem(head_dim, page)
    if why:
        raise FormatError(why + "; use backend='reference'")
    from kvlab.kernels.quest_triton import launch_quest  # imports triton

    if workspace is None:
        workspace = make_quest_workspace(q_heads, batch, kv_heads, pages.shape[2], head_dim, q.device, page=page)
    if out is None:
        out = torch.empty_like(q)
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or not (q.is_contiguous() and pages.is_contiguous()):
        raise FormatError("quest_decode_attention needs contiguous q and pages and a unit-stride head dim")
    return launch_quest(q, keys, values, pages, lengths, scale, page, workspace, out, token_dim)
