"""``kvq-int4``: asymmetric int4 K/V, a scale and zero per group along head_dim (kvlab's ``int4``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvlab.policies.kvq import KVQPolicy, _group_field


@dataclass(frozen=True)
class KVQInt4Policy(KVQPolicy):
    """Two codes per byte; float16 scale and zero per ``q_group_size`` elements of each token's head
    dim, round to nearest. No residual window: every token is stored in int4 from its first step.

    Per-token groups cannot isolate a key channel that is an outlier in every token (KIVI quantizes
    keys per channel for that reason), so models with outlier key channels lose more here than the
    bit count suggests. On ``fast``: the fused Triton kernel; on ``hf``: dequantize, then attend.
    """

    name = "kvq-int4"
    summary = ("kvlab int4, scale+zero per q_group_size of head_dim, no residual (fast: fused kernel; "
               "hf: dequantize, then attend)")
    nbits = 4
    q_group_size: int = _group_field()

