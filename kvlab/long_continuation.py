"""Fidelity of decode-time compression over a long continuation, against the full cache.

Why: the quality pass teacher-forces a continuation in one forward, which a decode-time compressed
cache (``decoding``) sees as one appended block: it never compresses inside it, so the fidelity
would be the full cache's by construction. Here the continuation goes through ``step`` tokens at a
time (1 = exactly as decoding sees it), so the cache evicts every ``interval`` tokens on the way,
and each position's prediction is compared with the full cache's on the same tokens: KL(full ||
compressed), top-1 agreement and the gold NLL, overall and per stretch of the continuation (to
see whether the error grows with the number of compressions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvlab.engine.generation import compressions, forward_at, prefill_ids
from kvlab.metrics import kl_per_position, mean_token_nll
from kvlab.policies import cache_stats, make_policy


@torch.inference_mode()
def stepwise_logits(loaded, policy, context_ids: Sequence[int], continuation_ids: Sequence[int],
                    step: int = 1) -> tuple[torch.Tensor, dict[str, Any]]:
    """Logits ``[C-1, V]`` (float32, CPU) for continuation tokens 1..C-1, fed ``step`` at a time after
    the context's prefill (chunked as the policy says); and the cache's stats at the end."""
    if step < 1:
        raise ValueError(f"step must be >= 1 token, got {step}")
    model = loaded.model
    cont = list(continuation_ids)
    with policy.attach(loaded, warm=False):
        cache = policy.make_cache(model)
        prefill_ids(model, context_ids, cache, policy.prefill_chunk)
        pieces, position = [], len(context_ids)
        for start in range(0, len(cont) - 1, step):
            piece = cont[start:min(start + step, len(cont) - 1)]
            pieces.append(forward_at(model, piece, cache, position))
            position += len(piece)
        stats = cache_stats(cache)
    stats["compressions"] = compressions(cache)
    return torch.cat(pieces, dim=0), stats


def fidelity(logits: torch.Tensor, ref: torch.Tensor, targets: Sequence[int], stretches: int = 4) -> dict[str, Any]:
    """KL(ref || logits) in nats per token, top-1 agreement and gold NLL: overall and per stretch."""
    logq, logp = torch.log_softmax(logits.float(), -1), torch.log_softmax(ref.float(), -1)
    kl = kl_per_position(logp, logq)
    agree = (logq.argmax(-1) == logp.argmax(-1)).float()
    bounds = [round(i * len(kl) / stretches) for i in range(stretches + 1)]
    return {
        "kl": float(kl.mean()), "top1_agree": float(agree.mean()), "gold_nll": mean_token_nll(logits, targets),
        "ref_gold_nll": mean_token_nll(ref, targets),
        "kl_by_stretch": [float(kl[a:b].mean()) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a],
        "top1_by_stretch": [float(agree[a:b].mean()) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a],
    }


def continuation_fidelity(loaded, policies: Sequence, context_ids: Sequence[int], continuation_ids: Sequence[int],
                          step: int = 1, reference=None) -> list[dict[str, Any]]:
    """One row per policy: its fidelity to ``reference`` (default: the full cache) on the continuation."""
    reference = reference or make_policy("full")
    ref, _ = stepwise_logits(loaded, reference, context_ids, continuation_ids, step)
    targets = list(continuation_ids)[1:]
    rows = []
    for policy in policies:
        logits, stats = stepwise_logits(loaded, policy, context_ids, continuation_ids, step)
        rows.append({"method": policy.name, "label": policy.label, "policy_params": policy.params(),
                     "context": len(context_ids), "continuation": len(continuation_ids), "step": step,
                     "final_physical_tokens": stats["physical_tokens"], "final_bytes": stats["bytes"],
                     "compressions": stats["compressions"], **fidelity(logits, ref, targets)})
    return rows
