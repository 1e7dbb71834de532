"""``kvq-fp8``: float8_e4m3 K/V with a float32 scale per token and KV head (kvlab's ``fp8`` format)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.kvq import KVQPolicy


@dataclass(frozen=True)
class KVQFp8Policy(KVQPolicy):
    """float8_e4m3fn codes, ``scale = amax / 448`` per token and KV head, saturating.

    Unlike transformers' ``fp8`` (one scale per tensor, frozen at prefill) a loud later token gets
    its own scale. On ``fast``: the fused Triton kernel reads the codes; on ``hf``: dequantize the
    whole cache to the model dtype, then attend (:mod:`kvlab.policies.kvq`).
    """

    name = "kvq-fp8"
    summary = ("kvlab fp8 e4m3, scale per token and KV head (fast: fused kernel; "
               "hf: dequantize, then attend)")
    nbits = 8
