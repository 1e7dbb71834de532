"""Decode attention over block tables: one query token per request, its K/V read in place from a serving
pool (:mod:`kvlab.storage.paged`) through the request's block table, ``lengths[b]`` tokens each.

    out = paged_decode(q, k_pool, v_pool, tables, lengths, block_size, scale)          # model-dtype pool
    out = paged_kvq_decode(q, k_store, v_store, tables, lengths, block_size, scale)    # kvq pool
    ref = paged_kvq_reference(q, k_store, v_store, tables, lengths, block_size, scale)
    out = paged_kivi_decode(q, codes, tables, quantized, exact, scale)                  # KIVI-style pool

Token ``t`` of row ``b`` lives in slot ``tables[b, t // block_size] * block_size + t % block_size``.
The launchers run Triton (:mod:`~kvlab.kernels.paged_triton`, :mod:`~kvlab.kernels.paged_kvq_triton`,
:mod:`~kvlab.kernels.paged_kivi_triton`; on CPU tensors only under ``TRITON_INTERPRET=1``); triton is
imported only when one runs. The kvq reference dequantizes each row's slots and attends in float32:
what the kvq kernel is checked against, and the same numbers as the pool's own read (``KVQPool.attend``)
up to the model dtype's rounding; the KIVI-style kernel is checked against its pool's own read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.kernels.decode import kernel_supports
from kvlab.kernels.formats import FormatError, KVStore
from kvlab.kernels.kivi import KiviSpec
from kvlab.kernels.kivi_decode import kernel_problem

BLOCK_N = 64  # tokens per inner iteration of the kvq kernel (a tile may span several blocks)


def table_slots(row: list[int], length: int, block_size: int, device) -> torch.Tensor:
    """The flat slots of a request's first ``length`` tokens, its block table being ``row``."""
    t = torch.arange(length, device=device)
    return torch.tensor(row, dtype=torch.long, device=device)[t // block_size] * block_size + t % block_size


def picked(store: KVStore, slots: torch.Tensor) -> KVStore:
    """The slots ``slots`` of a batch-1 pool store, in that order, as a store of their own."""
    parts = (t[:, :, slots] if t is not None else None for t in (store.codes, store.scale, store.zero))
    return KVStore(store.format, *parts, store.head_dim)


def paged_kvq_reference(q: torch.Tensor, k_store: KVStore, v_store: KVStore, tables: torch.Tensor,
                        lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """``q [B, Hq, D]`` over each row's slots of the pool stores ``[1, Hkv, slots, ...]``, dequantized,
    in float32 -> float32 ``[B, Hq, D]`` (GQA: query head ``h`` reads KV head ``h // (Hq / Hkv)``)."""
    batch, q_heads, dim = q.shape
    out = []
    for b, (row, n) in enumerate(zip(tables.tolist(), lengths.tolist(), strict=True)):
        slots = table_slots(row, n, block_size, q.device)
        keys = picked(k_store, slots).dequantize()[0]  # [Hkv, n, D]
        values = picked(v_store, slots).dequantize()[0]
        qf = q[b].float().view(keys.shape[0], q_heads // keys.shape[0], dim)
        probs = torch.softmax(torch.einsum("hgd,hnd->hgn", qf, keys) * scale, dim=-1)
        out.append(torch.einsum("hgn,hnd->hgd", probs, values).reshape(q_heads, dim))
    return torch.stack(out)


def check_paged_inputs(q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor) -> None:
    if q.dim() != 3 or tables.dim() != 2 or tables.shape[0] != q.shape[0] or lengths.shape != (q.shape[0],):
        raise FormatError(f"q [B, Hq, D], tables [B, blocks], lengths [B]; got {list(q.shape)}, "
                          f"{list(tables.shape)}, {list(lengths.shape)}")
    if tables.dtype != torch.int32 or lengths.dtype != torch.int32:
        raise FormatError(f"tables and lengths must be int32, got {tables.dtype} and {lengths.dtype}")


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                 lengths: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """A model-dtype pool's ``[slots, Hkv, D]`` K/V -> ``[B, Hq, D]`` (lengths >= 1)."""
    from kvlab.kernels import paged_triton

    check_paged_inputs(q, tables, lengths)
    return paged_triton.paged_decode(q, k_pool, v_pool, tables, lengths, block_size, scale)


def paged_kvq_problem(k_store: KVStore) -> str | None:
    """Why the kvq kernel cannot read this pool store (None: it can): the contiguous kernels' rule."""
    return kernel_supports(k_store)


def paged_kvq_decode(q: torch.Tensor, k_store: KVStore, v_store: KVStore, tables: torch.Tensor,
                     lengths: torch.Tensor, block_size: int, scale: float, block_n: int = BLOCK_N) -> torch.Tensor:
    """A kvq pool's stores (batch 1, ``[1, Hkv, slots, ...]``) -> ``[B, Hq, D]`` in ``q.dtype`` (lengths >= 1)."""
    from kvlab.kernels import paged_kvq_triton

    check_paged_inputs(q, tables, lengths)
    why = paged_kvq_problem(k_store)
    if why:
        raise FormatError(why + "; read the pool through its torch reference")
    fmt = k_store.format
    if k_store.batch != 1 or v_store.format.label != fmt.label or k_store.capacity != v_store.capacity:
        raise FormatError("the kvq paged kernel reads a pool's K and V stores: batch 1, one format, one capacity")
    batch, q_heads, dim = q.shape
    kv_heads = k_store.kv_heads
    if q_heads % kv_heads or dim != k_store.head_dim:
        raise FormatError(f"q [B, Hq={q_heads}, D={dim}] does not fit stores of Hkv={kv_heads}, D={k_store.head_dim}")
    q = q.contiguous()
    out = torch.empty_like(q)

    def extra(t: torch.Tensor | None) -> torch.Tensor:
        return t if t is not None else lengths  # an unused pointer for formats without scales/zeros

    group = q_heads // kv_heads
    block_h = max(16, 1 << (group - 1).bit_length())
    paged_kvq_triton.paged_kvq_kernel[(batch, kv_heads)](
        q, fmt.read_codes(k_store), extra(k_store.scale), extra(k_store.zero),
        fmt.read_codes(v_store), extra(v_store.scale), extra(v_store.zero), tables, lengths, out,
        float(scale) * math.log2(math.e), tables.stride(0), k_store.capacity, q_heads, group,
        D=dim, BS=block_size, BLOCK_N=block_n, BLOCK_H=block_h, FMT=fmt.kernel, BITS=fmt.bits, PACK=fmt.pack,
        QGROUP=fmt.group_size(dim), num_warps=4)
    return out


@dataclass(frozen=True)
class PagedKiviCodes:
    """One layer of a KIVI-style pool: ``k_codes``/``v_codes [slots, Hkv, D * bits / 8]``, the keys'
    ``k_scale``/``k_zero [blocks, Hkv, D]`` (one group per block, ``block_size`` = ``spec.group``), the
    values' ``v_scale``/``v_zero [slots, Hkv, D / value_group]``."""

    spec: KiviSpec
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor


def paged_kivi_decode(q: torch.Tensor, codes: PagedKiviCodes, tables: torch.Tensor, quantized: torch.Tensor,
                      exact: tuple[torch.Tensor, torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """Row ``b`` reads its first ``quantized[b]`` tokens (whole groups) as codes through its table and
    then ``exact``'s: ``(k, v, count)``, bf16 ``[B, Hkv, TW, D]`` K/V of its remaining tokens and their
    count ``[B]`` int32 -> ``[B, Hq, D]`` in ``q.dtype``."""
    from kvlab.kernels import paged_kivi_triton

    spec = codes.spec
    tail_k, tail_v, count = exact
    check_paged_inputs(q, tables, count)
    batch, q_heads, dim = q.shape
    kv_heads = codes.k_scale.shape[1]
    why = kernel_problem(spec, dim)
    if why:
        raise FormatError(why + "; read the pool through its torch reference")
    if q_heads % kv_heads or tail_k.shape != (batch, kv_heads, tail_k.shape[2], dim):
        raise FormatError(f"q {list(q.shape)} and exact K {list(tail_k.shape)} do not fit a pool of Hkv={kv_heads}")
    q = q.contiguous()
    out = torch.empty_like(q)
    group = q_heads // kv_heads
    paged_kivi_triton.paged_kivi_kernel[(batch, kv_heads)](
        q, codes.k_codes, codes.k_scale, codes.k_zero, codes.v_codes, codes.v_scale, codes.v_zero,
        tail_k.contiguous(), tail_v.contiguous(), tables, quantized, count, out,
        float(scale) * math.log2(math.e), tables.stride(0), q_heads, group, tail_k.shape[2],
        HKV=kv_heads, D=dim, G=spec.group, VG=spec.value_group, BLOCK_H=max(16, 1 << (group - 1).bit_length()),
        BLOCK_R=16, KBITS=spec.k_bits, VBITS=spec.v_bits, num_warps=4)
    return out
