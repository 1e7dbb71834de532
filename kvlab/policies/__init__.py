"""Cache policies: one small module per method, one registry.

    policy = make_policy("snapkv", keep=0.25, quant={"backend": "quanto", "nbits": 4})
    policy.check(model); policy.prepare(model); policy.warmup(model)
    cache = policy.make_cache(model)          # fresh for every generation
    model.generate(ids, past_key_values=cache, ...)   # or kvlab.engine.generation; the keyword is
                                              # `cache` from transformers 5.24: generation.cache_kwarg
    cache_stats(cache)                        # logical/physical tokens, bytes
    kept_positions(cache)                     # per layer, the prompt positions each KV head kept

Adding a method: one module holding its ``Policy`` subclass, and one line in :data:`POLICIES`; a
method that is a way of storing the cache alone: its :mod:`kvlab.storage` module and its class in the
``storage_policies`` line.
Nothing below this module imports it (a policy that needs another one imports that class).

transformers' cache internals are touched in this package (:mod:`~kvlab.policies.cache`,
:mod:`~kvlab.policies.quantized`, :mod:`~kvlab.policies.decoding`, :mod:`~kvlab.policies.chunking`, the
method layers), in :mod:`kvlab.storage` (each family's cache layer, the stats) and in
:mod:`kvlab.engine.generation` (forking a cache, reading its compressions), nowhere else; kvlab
supports transformers >= 5.17, < 5.25.
"""

from __future__ import annotations

from typing import Any

from kvlab.policies.adakv import AdaKVPolicy
from kvlab.policies.base import Policy, PolicyError
from kvlab.policies.cache import EvictionError, cache_stats, kept_positions
from kvlab.policies.decoding import DecodingPolicy
from kvlab.policies.eviction import EvictionPolicy
from kvlab.policies.expected_attention import ExpectedAttentionPolicy
from kvlab.policies.full import FullPolicy
from kvlab.policies.knorm import KnormPolicy
from kvlab.policies.kvzap import KVzapPolicy
from kvlab.policies.kvzip import KVzipPolicy
from kvlab.policies.pyramidkv import PyramidKVPolicy
from kvlab.policies.quantized import QuantizedPolicy, QuantSpec
from kvlab.policies.quantized.policies import (
    FP8Policy,
    HQQPolicy,
    KVQFp8Policy,
    KVQInt2Policy,
    KVQInt4Policy,
    QuantoPolicy,
)
from kvlab.policies.random import RandomPolicy
from kvlab.policies.snapkv import SnapKVPolicy
from kvlab.policies.stored import storage_policies
from kvlab.policies.streamingllm import StreamingLLMPolicy
from kvlab.policies.tova import TOVAPolicy
from kvlab.storage.kivi import KiviStorage
from kvlab.storage.nvfp4 import Nvfp4Storage
from kvlab.storage.quest import QuestStorage
from kvlab.storage.rotated_kivi import RotatedKiviStorage
from kvlab.storage.rotated_kvq import RotatedKVQStorage
from kvlab.storage.turboquant import TurboQuantStorage

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (FullPolicy, StreamingLLMPolicy, SnapKVPolicy, PyramidKVPolicy, TOVAPolicy, KnormPolicy,
                RandomPolicy, QuantoPolicy, HQQPolicy, FP8Policy, KVQFp8Policy, KVQInt4Policy, KVQInt2Policy,
                DecodingPolicy, ExpectedAttentionPolicy, KVzipPolicy, KVzapPolicy, AdaKVPolicy)
}
POLICIES.update(storage_policies(KiviStorage, QuestStorage, Nvfp4Storage, TurboQuantStorage, RotatedKVQStorage,
                                 RotatedKiviStorage))  # methods that are a storage alone
SERVED = ("full", "snapkv", "kvq-fp8", "kvq-int4", "kvq-int2", "quest", "kivi")  # the methods kvlab.serve runs


def make_policy(method: str, **params: Any) -> Policy:
    """A validated policy; raises :class:`PolicyError` (naming the fix) before any heavy work."""
    if method not in POLICIES:
        raise PolicyError(f"unknown method {method!r}; methods: {', '.join(POLICIES)}")
    return POLICIES[method].from_params(**params)


__all__ = [
    "POLICIES", "SERVED", "make_policy", "Policy", "PolicyError", "EvictionError", "EvictionPolicy", "QuantizedPolicy",
    "QuantSpec", "cache_stats", "kept_positions",
]
