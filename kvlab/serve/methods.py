"""The one place a cache method meets the serving engine: which methods serve, their block layout
and the pool that stores their blocks."""

from __future__ import annotations

import torch

from kvlab.kernels.formats import parse_format
from kvlab.models import ModelSpec
from kvlab.serve import SERVED
from kvlab.serve.layout import BlockLayout, dense_token_bytes, format_token_bytes
from kvlab.serve.pool import DensePool, FormatPool
from kvlab.serve.request import ServeError


def check_method(method: str) -> None:
    if method not in SERVED:
        raise ServeError(f"method {method!r} is not served yet: the serving engine supports {', '.join(SERVED)} "
                         f"(the others run in kvlab sweep's static batches)")


def make_method(method: str, params: dict):
    """The registry's policy for ``method`` with ``params`` (validated there)."""
    from kvlab.policies import make_policy

    check_method(method)
    policy = make_policy(method, **params)
    if getattr(policy, "quant", None) is not None:
        raise ServeError(f"{method} with quant= is not served yet: drop quant, or use kvq-int4 / kvq-fp8 alone")
    return policy


def layout_for(policy, spec: ModelSpec, dtype: torch.dtype, block_size: int) -> tuple[BlockLayout, object]:
    """``(layout, format or None)``: a kvq method stores its format, the others the model dtype."""
    if block_size < 1:
        raise ServeError(f"block_size={block_size} must be a positive number of tokens (16 is vLLM's default)")
    storage = policy.storage()
    dtype_name = str(dtype).removeprefix("torch.")
    if storage.kv_format != "model dtype":
        fmt = parse_format(storage.format)
        fmt.check_head_dim(spec.head_dim)
        return BlockLayout(policy.name, block_size, format_token_bytes(spec, fmt) * block_size, fmt.label), fmt
    keep = getattr(policy, "keep", 1.0)
    window = getattr(policy, "window_size", 0)
    return BlockLayout(policy.name, block_size, dense_token_bytes(spec, dtype_name) * block_size, "dense",
                       keep=keep, window=window), None


def make_pool(policy, fmt, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device):
    """The pool of ``policy``'s blocks: the model dtype, or its kvq format with its key offset."""
    shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    if fmt is None:
        return DensePool(*shape, dtype=dtype, device=device)
    return FormatPool(fmt, *shape, dtype=dtype, device=device, key_offset=policy.storage().key_offset)
