"""One task item under one cache policy: the compressed prefill, the question appended, the greedy
reply from the engine, and the gold answer teacher-forced through the policy's cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kvlab.engine.generation import fork_cache, forward_at, model_device, prefill_ids
from kvlab.policies import cache_stats
from kvlab.tasks import Encoder, TaskItem
from kvlab.tasks.prompt import TaskError


@dataclass
class ItemRun:
    """What one policy did on one item: the greedy reply and the teacher-forced answer logits."""

    generated: list[int]
    prediction: str
    tf_logits: Any  # [len(answer_ids), V] float32
    cache: dict[str, Any] = field(default_factory=dict)


def segments(item: TaskItem, query_aware: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the compressed prefill, what is appended uncompressed after it)."""
    if query_aware:
        return item.context_ids + item.question_ids, item.answer_prefix_ids
    return item.context_ids, item.question_ids + item.answer_prefix_ids


def _informative(stats) -> dict[str, Any] | None:
    """A stats call's result, or None when it fails (stats are informative only)."""
    try:
        return stats()
    except Exception:  # noqa: BLE001
        return None


def run_item(loaded, policy, item: TaskItem, enc: Encoder, engine, query_aware: bool = False,
             max_new_tokens: int | None = None) -> ItemRun:
    """Prefill the compressed part, forward the rest, decode greedily and teacher-force the gold.

    The prefill fills the cache of ``engine.storage_policy(policy)``; the greedy reply comes from
    ``engine``'s decoder (:mod:`kvlab.engine.engines`). The teacher-forced pass runs transformers'
    forward through the policy's own cache: a fork of the prefilled one when that is the policy's own
    (so both passes see the same compressed state), else one rebuilt by a second prefill (same
    result, more time), as for a cache that cannot be copied.
    """
    model = loaded.model
    first, second = segments(item, query_aware)
    if not second:
        raise TaskError(f"item {item.task}: nothing after the compressed part; the answer prefix is empty")
    storage = engine.storage_policy(policy)
    cache = storage.make_cache(model)
    prefill_ids(model, first, cache, policy.prefill_chunk)
    prefilled = _informative(partial(cache_stats, cache))  # hf reports the cache before the question
    logits = forward_at(model, second, cache, len(first))
    start = len(first) + len(second)
    answer = list(item.answer_ids)
    tf_cache = fork_cache(cache, model) if len(answer) > 1 and storage is policy else None
    last = logits[-1]
    n_new = max(1, max_new_tokens or item.max_new_tokens)
    decoder = engine.decoder_for_cache(policy, cache, n_new, prefilled)
    stats = {f"cache_{k}": v for k, v in (_informative(decoder.stats) or {}).items()}
    first_token = torch.tensor([int(last.argmax())], dtype=torch.long, device=model_device(model))
    with torch.inference_mode():
        tokens = decoder.decode(first_token, n_new, start)
    generated = [int(t) for t in tokens[0].tolist()]
    if len(answer) > 1:
        if tf_cache is None:  # rebuild the same compressed state
            tf_cache = policy.make_cache(model)
            prefill_ids(model, first, tf_cache, policy.prefill_chunk)
            forward_at(model, second, tf_cache, len(first))
        rest = forward_at(model, answer[:-1], tf_cache, start)
        tf_logits = torch.cat([last[None], rest], dim=0)
    else:
        tf_logits = last[None]
    return ItemRun(generated=generated, prediction=reply_text(enc, generated), tf_logits=tf_logits, cache=stats)


def reply_text(enc: Encoder, generated: Sequence[int]) -> str:
    """The reply up to the first end-of-turn token (decoding ignores EOS; scoring must not)."""
    eos = enc.eos_ids
    cut = next((i for i, t in enumerate(generated) if t in eos), len(generated))
    return enc.decode(generated[:cut])
