"""Single-query decode attention over stored K/V, in float32: the ground truth for the kernels.

Dequantizes the stores (:mod:`kvlab.kernels.formats`), then a masked softmax per batch row, so rows
may hold different lengths. GQA as in transformers' ``repeat_kv``: query head ``h`` reads KV head
``h // (Hq // Hkv)``. A row of length 0 attends to nothing and returns zeros.
"""

from __future__ import annotations

import torch

from kvlab.kernels.formats import FormatError, KVStore


def check_decode_inputs(q: torch.Tensor, k_store: KVStore, v_store: KVStore, lengths: torch.Tensor) -> int:
    """Shape checks shared by the reference and the kernels; returns the GQA group size."""
    if q.dim() != 3:
        raise FormatError(f"q must be [B, Hq, D] (one query token per row), got {list(q.shape)}")
    batch, q_heads, head_dim = q.shape
    for what, store in (("k_store", k_store), ("v_store", v_store)):
        if (store.batch, store.head_dim) != (batch, head_dim):
            raise FormatError(f"{what} holds B={store.batch}, D={store.head_dim}; q is B={batch}, D={head_dim}")
    if (k_store.kv_heads, k_store.capacity) != (v_store.kv_heads, v_store.capacity):
        raise FormatError("k_store and v_store must have the same kv_heads and capacity")
    if q_heads % k_store.kv_heads:
        raise FormatError(f"Hq={q_heads} is not a multiple of Hkv={k_store.kv_heads}")
    devices = {t.device for t in (q, lengths, *k_store.tensors(), *v_store.tensors())}
    if len(devices) > 1:
        raise FormatError(f"q, lengths and the stores must share a device, got {sorted(map(str, devices))}")
    if lengths.shape != (batch,) or lengths.dtype not in (torch.int32, torch.int64):
        raise FormatError(f"lengths must be an int32 tensor [B={batch}], got {lengths.dtype} {list(lengths.shape)}")
    return q_heads // k_store.kv_heads


def decode_attention_reference(q: torch.Tensor, k_store: KVStore, v_store: KVStore, lengths: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over each row's first ``lengths[b]`` slots -> float32 ``[B, Hq, D]``."""
    group = check_decode_inputs(q, k_store, v_store, lengths)
    batch, q_heads, head_dim = q.shape
    k = k_store.dequantize()  # [B, Hkv, T, D]
    v = v_store.dequantize()
    qf = q.float().view(batch, k_store.kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bhtd->bhgt", qf, k) * scale
    slots = torch.arange(k_store.capacity, device=q.device)
    valid = slots < lengths.to(q.device).clamp(0, k_store.capacity).unsqueeze(-1)  # [B, T]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row is all -inf -> NaN -> 0
    return torch.einsum("bhgt,bhtd->bhgd", probs, v).reshape(batch, q_heads, head_dim)
