"""Quantized KV caches, side by side: the storage (:mod:`~kvlab.policies.quantized.storage`:
:class:`QuantSpec` and its backends quanto, hqq, fp8, kvq), kvlab's own formats as transformers
cache layers (:mod:`kvlab.storage.kvq`) and the whole-cache methods
(:mod:`~kvlab.policies.quantized.policies`). Eviction policies store their kept K/V through a
:class:`QuantSpec` too (``quant=``).
"""

from kvlab.policies.quantized.policies import QuantizedPolicy
from kvlab.policies.quantized.storage import BACKENDS, DEFAULT_BACKEND, FP8_MIN_TRANSFORMERS, QuantSpec

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "FP8_MIN_TRANSFORMERS", "QuantSpec", "QuantizedPolicy"]
