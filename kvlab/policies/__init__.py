"""Cache policies: one small module per method, one registry.

    policy = make_policy("snapkv", keep=0.25, quant={"backend": "quanto", "nbits": 4})
    policy.check(model); policy.prepare(model); policy.warmup(model)
    cache = policy.make_cache(model)          # fresh for every generation
    model.generate(ids, past_key_values=cache, ...)   # or kvlab.decode; the keyword is
                                              # `cache` from transformers 5.24: kvlab.decode.cache_kwarg
    cache_stats(cache)                        # logical/physical tokens, bytes
    kept_positions(cache)                     # per layer, the prompt positions each KV head kept

transformers' cache internals are touched only in :mod:`kvlab.policies.cache`,
:mod:`kvlab.policies.quantized`, :mod:`kvlab.policies.kvq` and :mod:`kvlab.policies.decoding`; kvlab supports transformers >= 5.17, < 5.25.
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
from kvlab.policies.kvq_fp8 import KVQFp8Policy
from kvlab.policies.kvq_int2 import KVQInt2Policy
from kvlab.policies.kvq_int4 import KVQInt4Policy
from kvlab.policies.kvzip import KVzipPolicy
from kvlab.policies.pyramidkv import PyramidKVPolicy
from kvlab.policies.quantized import FP8Policy, HQQPolicy, QuantizedPolicy, QuantoPolicy, QuantSpec
from kvlab.policies.random import RandomPolicy
from kvlab.policies.snapkv import SnapKVPolicy
from kvlab.policies.streamingllm import StreamingLLMPolicy
from kvlab.policies.tova import TOVAPolicy

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (FullPolicy, StreamingLLMPolicy, SnapKVPolicy, PyramidKVPolicy, TOVAPolicy, KnormPolicy,
                RandomPolicy, QuantoPolicy, HQQPolicy, FP8Policy, KVQFp8Policy, KVQInt4Policy, KVQInt2Policy,
                DecodingPolicy, ExpectedAttentionPolicy, KVzipPolicy, AdaKVPolicy)
}


def make_policy(method: str, **params: Any) -> Policy:
    """A validated policy; raises :class:`PolicyError` (naming the fix) before any heavy work."""
    if method not in POLICIES:
        raise PolicyError(f"unknown method {method!r}; methods: {', '.join(POLICIES)}")
    cls = POLICIES[method]
    allowed = [row["name"] for row in cls.describe()]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        own = [name for name in allowed if name != "prefill_chunk"]  # every policy takes prefill_chunk
        hint = (f"; {method} takes: {', '.join(own)}" if own else f"; {method} takes no parameters") \
            + " (and prefill_chunk, like every method)"
        raise PolicyError(f"unknown parameter(s) {', '.join(unknown)} for {method}{hint}")
    return cls(**params)


__all__ = [
    "POLICIES", "make_policy", "Policy", "PolicyError", "EvictionError", "EvictionPolicy", "QuantizedPolicy",
    "QuantSpec", "cache_stats", "kept_positions",
]
