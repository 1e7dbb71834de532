"""Does a compressed cache still answer? The KL of its next-token distributions to the full cache's
over a reply it generated (teacher-forced), the check ``kvlab generate`` prints beside the answer.

Both caches prefill the same prompt, then read the reply's tokens one forward each way; the KL is
averaged over the reply's positions after the first (nats per token, as the continuation task's).
Above :data:`COLLAPSE_KL` (the report's collapse line too) the cache answers from a different
distribution: its reply is not the model's.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlab.metrics import kl_per_position
from kvlab.policies import make_policy
from kvlab.quality.continuation import ContinuationItem, continuation_logits

COLLAPSE_KL = 1.0


def reply_kl(loaded, policy, prompt_ids: Sequence[int], reply_ids: Sequence[int]) -> float | None:
    """Mean KL(full || policy) over ``reply_ids[1:]`` after ``prompt_ids``; None for a reply under 2 tokens."""
    if len(reply_ids) < 2:
        return None
    item = ContinuationItem("reply", len(prompt_ids), 0, 0, tuple(prompt_ids), tuple(reply_ids))
    full = continuation_logits(loaded, make_policy("full"), item)
    with policy.attach(loaded, warm=False):
        mine = continuation_logits(loaded, policy, item)
    return float(kl_per_position(full.float().log_softmax(-1), mine.float().log_softmax(-1)).mean())


def reply_verdict(kl: float | None) -> str:
    if kl is None:
        return "not checked (a reply under 2 tokens)"
    if kl > COLLAPSE_KL:
        return (f"FIDELITY COLLAPSES: KL {kl:.2f} nats/token to the full cache over this reply (> {COLLAPSE_KL:g}); "
                "this method does not answer like the model on this model")
    return f"KL {kl:.3f} nats/token to the full cache over this reply (teacher-forced)"
