"""The one place a cache method meets the serving engine: which methods serve, their block layout
(the storage protocol's paged layout, :func:`kvlab.serve.layout.block_layout`) and the pool that
stores their blocks (one per storage family: model dtype, a kvq format, Quest's bounds beside, KIVI's
key groups with bf16 tails)."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvlab.errors import PolicyError
from kvlab.kernels.formats import parse_format
from kvlab.models import ModelSpec
from kvlab.serve import SERVED, block_size_problem
from kvlab.serve.kivi_pool import KiviPool, tail_bytes
from kvlab.serve.layout import BlockLayout, block_layout
from kvlab.serve.pool import DensePool, FormatPool
from kvlab.serve.quest_pool import QuestPool
from kvlab.serve.request import ServeError
from kvlab.storage.base import model_shape
from kvlab.storage.dense import DenseStorage
from kvlab.storage.kivi import KiviStorage
from kvlab.storage.kvq import KVQStorage
from kvlab.storage.quest import QuestStorage


def check_method(method: str) -> None:
    if method not in SERVED:
        raise ServeError(f"method {method!r} is not served yet: the serving engine supports "
                         f"{', '.join(SERVED)} (the others run in kvlab sweep's static batches)")


def make_method(method: str, params: dict):
    """The registry's policy for ``method`` with ``params`` (validated there)."""
    from kvlab.policies import make_policy

    check_method(method)
    policy = make_policy(method, **params)
    if getattr(policy, "quant", None) is not None:
        raise ServeError(f"{method} with quant= is not served yet: drop quant, or use kvq-int4 / kvq-fp8 alone")
    return policy


def layout_for(policy, spec: ModelSpec, dtype: torch.dtype, block_size: int, cuda: bool = False) -> BlockLayout:
    """``policy``'s blocks: its storage checked against the model, then its paged layout."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ServeError(f"block_size={block_size} must be a positive number of tokens (16 is vLLM's default)")
    storage = policy.storage()
    try:
        storage.check(model_shape(spec), cuda)
    except PolicyError as err:
        raise ServeError(f"{policy.name} cannot serve {spec.name}: {err}") from None
    problem = block_size_problem(storage, block_size)
    if problem:
        raise ServeError(problem)
    layout = block_layout(storage, policy.name, spec, dtype.itemsize, block_size)
    outside = SEQUENCE_BYTES.get(type(storage))
    return replace(layout, sequence_bytes=outside(storage, spec)) if outside else layout


def dense_pool(storage, shape, dtype, device):
    return DensePool(*shape, dtype=dtype, device=device)


def format_pool(storage: KVQStorage, shape, dtype, device):
    return FormatPool(parse_format(storage.format), *shape, dtype=dtype, device=device, key_offset=storage.key_offset)


def quest_pool(storage: QuestStorage, shape, dtype, device):
    return QuestPool(storage.read, *shape, dtype=dtype, device=device)


def kivi_pool(storage: KiviStorage, shape, dtype, device):
    return KiviPool(storage.spec, *shape, dtype=dtype, device=device)


def kivi_tails(storage: KiviStorage, spec: ModelSpec) -> int:
    return tail_bytes(storage.spec, spec.num_layers, spec.num_kv_heads, spec.head_dim)


SEQUENCE_BYTES = {KiviStorage: kivi_tails}  # storage family -> bytes a running request holds outside its blocks
POOLS = {DenseStorage: dense_pool, KVQStorage: format_pool, QuestStorage: quest_pool, KiviStorage: kivi_pool}  # storage family -> its pool


def make_pool(policy, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device):
    """The pool of ``policy``'s blocks, by its storage family."""
    storage = policy.storage()
    make = POOLS.get(type(storage))
    if make is None:
        raise ServeError(f"{policy.name} stores its cache as {type(storage).__name__}, which has no serving pool: "
                         f"the serving engine supports {', '.join(SERVED)}")
    shape = (spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return make(storage, shape, dtype, device)
