"""One task item under one cache policy: the compressed prefill, the question appended, the greedy
reply from the engine, and the gold answer teacher-forced through the policy's cache."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from kvlab.engine.generation import as_batch, model_device, prefill_ids
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
    """Prefill the compressed part, feed the rest, decode greedily and teacher-force the gold.

    The prefill fills the cache of ``engine.storage_policy(policy)`` (exact attention); then
    everything after it goes through ``engine``'s decoder (:mod:`kvlab.engine.engines`) and so
    through the same storage on either engine: the question (``Decoder.feed``, whose last logits
    pick the first reply token and score the first gold token), the greedy reply, and the gold
    answer teacher-forced from the state after the question (``checkpoint``/``restore``; a decoder
    whose state cannot be kept is rebuilt by a second prefill: same result, more time). On ``fast``
    the question and the gold so attend the context in the store's format, as the reply does, not
    the exact prefill cache (attending the exact cache made kvq-int4's gold NLL differ between
    engines).
    """
    model = loaded.model
    first, second = segments(item, query_aware)
    if not second:
        raise TaskError(f"item {item.task}: nothing after the compressed part; the answer prefix is empty")
    storage = engine.storage_policy(policy)
    device = model_device(model)
    answer = list(item.answer_ids)
    n_new = max(1, max_new_tokens or item.max_new_tokens)
    room = len(second) + max(n_new, len(answer))

    def prefilled_decoder(stats: bool):
        cache = storage.make_cache(model)
        prefill_ids(model, first, cache, policy.prefill_chunk)
        prefilled = _informative(partial(cache_stats, cache)) if stats else None  # before the question
        decoder = engine.decoder_for_cache(policy, cache, room, prefilled)
        with torch.inference_mode():
            last = decoder.feed(as_batch(list(second), device), len(first))[0, -1]
        return decoder, last

    decoder, last = prefilled_decoder(stats=True)
    stats = {f"cache_{k}": v for k, v in (_informative(decoder.stats) or {}).items()}
    start = len(first) + len(second)
    mark = decoder.checkpoint() if len(answer) > 1 else None
    first_token = last.argmax().reshape(1).to(device)
    with torch.inference_mode():
        tokens = decoder.decode(first_token, n_new, start)
    generated = [int(t) for t in tokens[0].tolist()]
    if len(answer) > 1:
        if mark is None:  # rebuild the same state
            decoder, _ = prefilled_decoder(stats=False)
        else:
            decoder.restore(mark)
        with torch.inference_mode():
            rest = decoder.feed(as_batch(answer[:-1], device), start)[0]
        tf_logits = torch.cat([last[None], rest], dim=0).float().cpu()
    else:
        tf_logits = last[None].float().cpu()
    return ItemRun(generated=generated, prediction=reply_text(enc, generated), tf_logits=tf_logits, cache=stats)


def reply_text(enc: Encoder, generated: Sequence[int]) -> str:
    """The reply up to the first end-of-turn token (decoding ignores EOS; scoring must not)."""
    eos = enc.eos_ids
    cut = next((i for i, t in enumerate(generated) if t in eos), len(generated))
    return enc.decode(generated[:cut])
