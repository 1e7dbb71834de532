"""Generation through transformers' forward: prefill (one shot or chunked), question append, greedy
decode and teacher forcing. Both engines prefill with these; the ``hf`` engine also decodes with
them; quality, long-continuation fidelity, anatomy and the engine comparison use them too.

Why not ``model.generate``: measurements need a callback after every decode step (CUDA events,
timestamps), exactly ``n`` new tokens whatever the EOS, and explicit ``position_ids``: after
eviction a cache's physical length is not the position of the next token. Positions come from the
cache's logical length (``get_seq_length()``), which every kvlab cache reports.

Chunked prefill: the prompt goes through the model ``chunk`` tokens at a time. A one-shot prefill of
n tokens holds n tokens' activations in every op (on Llama-3.1-8B the MLP's intermediate alone is n
x 14336 x 2 bytes) and, before an evicting cache compresses, every layer's full K/V. In chunks,
transients scale with the chunk and an evicting cache compresses as the prompt streams in
(:mod:`kvlab.policies.chunking` gives the semantics per method), so a sequence's peak approaches its
kept cache plus one chunk's transients. Unpadded chunks attend through
:func:`kvlab.storage.attention.lower_right_chunks` (no 4-D mask, no K/V repeated per query head).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import cache
from typing import Any

import torch

from kvlab.policies.chunking import streaming
from kvlab.storage.attention import lower_right_chunks


@cache
def _cache_kwarg_for(forward_cls: type) -> str:
    params = inspect.signature(forward_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwarg(model) -> str:
    """The keyword a model's forward (and ``generate``) takes the cache by: ``cache`` from
    transformers 5.24 (``past_key_values`` is deprecated there), ``past_key_values`` before."""
    return _cache_kwarg_for(type(model))


def forward(model, input_ids, cache, position_ids, attention_mask=None, logits_to_keep=1):
    """One forward of ``input_ids`` at ``position_ids`` through ``cache`` (the model's output)."""
    kwargs = {cache_kwarg(model): cache}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=True,
                 logits_to_keep=logits_to_keep, **kwargs)


def positions(start, length: int, batch: int, device) -> torch.Tensor:
    """Positions ``[batch, length]`` from ``start`` (an int, or a ``[B]`` tensor per sequence)."""
    start = torch.as_tensor(start, device=device).reshape(-1, 1)
    return (start + torch.arange(length, device=device)).expand(batch, length)


def chunk_bounds(n: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(n)`` in chunks of ``chunk`` (the last may be shorter)."""
    if chunk is None or chunk >= n:
        return [(0, n)]
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    return [(start, min(n, start + chunk)) for start in range(0, n, chunk)]


@torch.no_grad()
def prefill_once(model, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
                 logits_to_keep: int = 1) -> torch.Tensor:
    """Run ``input_ids`` ``[B, q]`` through ``model`` into ``cache`` in one forward; return logits
    ``[B, k, V]`` for the last ``k = logits_to_keep`` positions (0: all).

    The first call on a fresh cache is the prefill an eviction policy compresses; a second call
    (a question after a compressed context) appends uncompressed. Positions continue from the
    cache's logical length; with a 2-D ``attention_mask`` (past + new, left padding) they come
    from its cumulative sum instead.
    """
    bsz, q_len = input_ids.shape
    if attention_mask is not None:
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -q_len:]
    else:
        pos = positions(cache.get_seq_length(), q_len, bsz, input_ids.device)
    return forward(model, input_ids, cache, pos, attention_mask, logits_to_keep).logits


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, chunk: int | None = None,
            attention_mask: torch.Tensor | None = None, logits_to_keep: int = 1) -> torch.Tensor:
    """:func:`prefill_once` in chunks of ``chunk`` tokens (None or >= the prompt: one shot).

    On a fresh cache the chunks are one prompt (an evicting cache compresses as they stream in, to
    the budget of the whole prompt); on a cache that already holds tokens they are appended, as a
    one-shot second forward would be. Returns logits ``[B, k, V]`` for the last ``k =
    logits_to_keep`` positions (0: all), as one shot does.
    """
    n = input_ids.shape[1]
    bounds = chunk_bounds(n, chunk)
    if len(bounds) == 1:
        return prefill_once(model, input_ids, cache, attention_mask, logits_to_keep)
    fresh = cache.get_seq_length() == 0
    past = attention_mask.shape[1] - n if attention_mask is not None else 0
    pieces = []
    unpadded = lower_right_chunks(model) if attention_mask is None else nullcontext()
    with streaming(cache, n) if fresh else nullcontext(), unpadded:
        for start, end in bounds:
            wanted = end - start if logits_to_keep == 0 else logits_to_keep - (n - end)
            keep = max(0, min(end - start, wanted))  # this chunk's share of the logits asked for
            mask = attention_mask[:, : past + end] if attention_mask is not None else None
            logits = prefill_once(model, input_ids[:, start:end], cache, mask, keep or 1)
            if keep:
                pieces.append(logits[:, -keep:])
    return torch.cat(pieces, dim=1)


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
        logits = forward(model, token, cache, start + step, attention_mask).logits
        token = logits[:, -1].argmax(dim=-1, keepdim=True)
        tokens.append(token)
        if on_step is not None:
            on_step(step)
    return torch.cat(tokens, dim=1)


def as_batch(ids, device) -> torch.Tensor:
    """Token ids (a list, ``[n]`` or ``[B, n]``) as a ``[B, n]`` LongTensor on ``device``."""
    ids = torch.as_tensor(ids, dtype=torch.long, device=device)
    return ids.unsqueeze(0) if ids.dim() == 1 else ids


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def prefill_ids(model, ids: Sequence[int], cache, chunk: int | None = None) -> None:
    """Prefill one sequence of token ids (a list) into ``cache``, in chunks of ``chunk``."""
    with torch.inference_mode():
        prefill(model, as_batch(list(ids), model_device(model)), cache, chunk)


def forward_at(model, ids: Sequence[int], cache, start: int) -> torch.Tensor:
    """Forward ``ids`` through ``cache`` at logical positions ``start, start+1, ...`` (teacher
    forcing, or a question appended uncompressed); returns logits [len(ids), V] (float32, CPU).
    :func:`prefill_once` takes the positions from the cache's logical length; checking it against
    ``start`` catches a cache that reports its physical length after eviction (which would shift
    every later position)."""
    seen = cache.get_seq_length()
    if seen != start:
        raise RuntimeError(f"the cache reports {seen} tokens seen, expected {start}: its get_seq_length() "
                           f"must count every token, evicted or not")
    with torch.inference_mode():
        logits = prefill_once(model, as_batch(list(ids), model_device(model)), cache, logits_to_keep=0)
    return logits[0].float().cpu()


def fork_cache(cache, model):
    """A deep copy of ``cache`` that shares the model's modules and weights (a policy's cache may
    hold references to them); ``None`` when the cache cannot be copied."""
    memo: dict[int, Any] = {id(model): model}
    for module in model.modules():
        memo[id(module)] = module
    for tensor in list(model.parameters()) + list(model.buffers()):
        memo[id(tensor)] = tensor
    try:
        return copy.deepcopy(cache, memo)
    except Exception:  # noqa: BLE001 - any failure means "re-prefill instead"
        return None


def compressions(cache) -> int:
    """How many times the cache's layers compressed during decode (the most of any layer; 0 for
    caches that never do)."""
    return max((getattr(layer, "compressions", 0) for layer in cache.layers), default=0)
