"""The one greedy prefill/decode loop, used by ``kvlab generate``, measurements and quality runs.

Why not ``model.generate``: measurements need a callback after every decode step (CUDA events,
timestamps), exactly ``n`` new tokens whatever the EOS, and explicit ``position_ids``: after
eviction a cache's physical length is not the position of the next token. Positions come from the
cache's logical length (``get_seq_length()``), which every kvlab cache reports.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch


@cache
def _cache_kwarg_for(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model) -> str:
    """The keyword a model's forward (and ``generate``) takes the cache by: ``cache`` from
    transformers 5.24 (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    return _cache_kwarg_for(type(model))


def _forward(model, input_ids, cache, position_ids, attention_mask=None, logits_to_keep=1):
    kwargs = {cache_kwarg(model): cache}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                 logits_to_keep=logits_to_keep, **kwargs)


def _positions(start, length: int, batch: int, device) -> torch.Tensor:
    start = torch.as_tensor(start, device=device).reshape(-1, 1)
    return (start + torch.arange(length, device=device)).expand(batch, length)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
            logits_to_keep: int = 1) -> torch.Tensor:
    """Run ``input_ids`` ``[B, q]`` through ``model`` into ``cache``; return logits ``[B, k, V]``
    for the last ``k = logits_to_keep`` positions (0: all).

    The first call on a fresh cache is the prefill an eviction policy compresses; a second call
    (a question after a compressed context) appends uncompressed. Positions continue from the
    cache's logical length; with a 2-D ``attention_mask`` (past + new, left padding) they come
    from its cumulative sum instead.
    """
    bsz, q_len = input_ids.shape
    if attention_mask is not None:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q_len:]
    else:
        positions = _positions(cache.get_seq_length(), q_len, bsz, input_ids.device)
    return _forward(model, input_ids, cache, positions, attention_mask, logits_to_keep).logits


@torch.no_grad()
def greedy_decode(
    model,
    cache,
    first_token: torch.Tensor,
    n_new: int,
    start_position: int | torch.Tensor,
    on_step: Callable[[int], Any] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Greedy tokens ``[B, n_new]``: ``first_token`` (picked from the prefill logits) then
    ``n_new - 1`` decode steps. EOS is ignored, so exactly ``n_new`` tokens come back.

    ``start_position`` is the position of ``first_token`` (the logical prompt length; a ``[B]``
    tensor for left-padded batches). ``on_step(i)`` runs after decode step ``i`` (0-based, which
    produced token ``i + 1``), outside the forward, so a caller can record events/timestamps.
    ``attention_mask``: optional 2-D padding mask of the tokens already in the cache; it is
    extended by one column per step.
    """
    if n_new < 1:
        raise ValueError(f"n_new must be >= 1, got {n_new}")
    token = first_token.reshape(-1, 1)
    bsz, device = token.shape[0], token.device
    tokens = [token]
    start = torch.as_tensor(start_position, device=device).reshape(-1, 1).expand(bsz, 1)
    for step in range(n_new - 1):
        if attention_mask is not None:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(bsz, 1)], dim=-1)
        logits = _forward(model, token, cache, start + step, attention_mask).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(token)
        if on_step is not None:
            on_step(step)
    return torch.cat(tokens, dim=1)


@dataclass
class Generation:
    """What :func:`generate_text` produced, plus the cache's state after the prefill and at the end."""

    tokens: torch.Tensor  # [B, n_new]
    texts: list[str] | None
    prompt_tokens: int
    cache_after_prefill: dict[str, Any]
    cache_final: dict[str, Any]
    cache: Any = field(repr=False)

    @property
    def text(self) -> str | None:
        return self.texts[0] if self.texts else None


def _as_batch(ids, device) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    return ids.unsqueeze(0) if ids.dim() == 1 else ids


def generate_text(loaded, prompt_ids, policy, max_new_tokens: int, question_ids=None,
                  engine=None) -> Generation:
    """Check, prepare and build the policy's cache, prefill ``prompt_ids`` (compressed once),
    then ``question_ids`` if given (appended uncompressed), then greedy-decode ``max_new_tokens``.

    ``loaded`` is a kvlab ``LoadedModel`` (texts are decoded with its tokenizer, if any) or a
    transformers model. ``engine``: None for transformers' loop, or a
    :class:`kvlab.engine.fast.FastEngine` (the prefill still runs through transformers).
    """
    from kvlab.policies.base import hf_model

    model = hf_model(loaded)
    tokenizer = getattr(loaded, "tokenizer", None)
    with policy.attach(loaded, warm=False):
        return _generate(loaded, model, tokenizer, prompt_ids, policy, max_new_tokens, question_ids, engine)


def _generate(loaded, model, tokenizer, prompt_ids, policy, max_new_tokens, question_ids, engine) -> Generation:
    from kvlab.policies import cache_stats

    device = next(model.parameters()).device
    ids = _as_batch(prompt_ids, device)
    from kvlab.chunked import prefill as chunked_prefill

    cache = (policy.fast_storage()[0] if engine is not None else policy).make_cache(model)
    logits = chunked_prefill(model, ids, cache, getattr(policy, "prefill_chunk", None))
    after_prefill = cache_stats(cache)
    if question_ids is not None:
        question = _as_batch(question_ids, device).expand(ids.shape[0], -1)
        logits = prefill(model, question, cache)
    first = logits[:, -1].argmax(dim=-1)
    if engine is None:
        tokens = greedy_decode(model, cache, first, max_new_tokens, cache.get_seq_length())
        final = cache_stats(cache)
    else:
        decoder = engine.decoder_for_cache(policy, cache, max_new_tokens)
        decoder.load(cache)
        after_prefill = decoder.stats()  # in the store's format (the question, if any, included)
        tokens = decoder.decode(first, max_new_tokens, cache.get_seq_length())
        final, cache = decoder.stats(max_new_tokens), None  # the static buffers held the decode
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    return Generation(tokens.cpu(), texts, ids.shape[1], after_prefill, final, cache)
