"""The one place a cache method meets the serving engine: which methods serve (the registry's
``SERVED``), their block layout (the storage protocol's paged layout,
:func:`kvlab.serve.layout.block_layout`) and the pool that stores their blocks (the storage's own,
:meth:`kvlab.storage.base.Storage.paged_pool`)."""

from __future__ import annotations

import torch

from kvlab.errors import PolicyError
from kvlab.models import ModelSpec
from kvlab.policies import SERVED, make_policy
from kvlab.serve.layout import BlockLayout, block_layout
from kvlab.serve.request import ServeError
from kvlab.storage.base import model_shape
from kvlab.storage.paged import PoolShape


def make_method(method: str, params: dict):
    """The registry's policy for ``method`` with ``params`` (validated there), if the engine serves it."""
    if method not in SERVED:
        raise ServeError(f"method {method!r} is not served yet: the serving engine supports "
                         f"{', '.join(SERVED)} (the others run in kvlab sweep's static batches)")
    policy = make_policy(method, **params)
    if getattr(policy, "quant", None) is not None:
        raise ServeError(f"{method} with quant= is not served yet: drop quant, or use kvq-int4 / kvq-fp8 alone")
    return policy


def layout_for(policy, spec: ModelSpec, dtype: torch.dtype, block_size: int, cuda: bool = False) -> BlockLayout:
    """``policy``'s blocks: its storage checked against the model and the block size, then its paged layout."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ServeError(f"block_size={block_size} must be a positive number of tokens (16 is vLLM's default)")
    storage = policy.storage()
    try:
        storage.check(model_shape(spec), cuda)
    except PolicyError as err:
        raise ServeError(f"{policy.name} cannot serve {spec.name}: {err}") from None
    problem = storage.block_size_problem(block_size)
    if problem:
        raise ServeError(problem)
    return block_layout(storage, policy.name, spec, dtype.itemsize, block_size)


def make_pool(policy, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device):
    """The pool of ``policy``'s blocks: its storage's."""
    storage = policy.storage()
    shape = PoolShape(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    try:
        return storage.paged_pool(shape, dtype, device)
    except PolicyError as err:
        raise ServeError(f"{policy.name} stores its cache as {type(storage).__name__}, which has no serving pool "
                         f"({err})") from None
