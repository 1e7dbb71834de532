"""Chunked prefill: the prompt goes through the model ``chunk`` tokens at a time.

Why: a one-shot prefill of n tokens holds n tokens' activations in every op (on Llama-3.1-8B the
MLP's intermediate alone is n x 14336 x 2 bytes) and, before an evicting cache compresses, every
layer's full K/V. In chunks, transients scale with the chunk and an evicting cache compresses as
the prompt streams in (:mod:`kvlab.policies.chunking` gives the semantics per method), so a
sequence's peak approaches its kept cache plus one chunk's transients. Unpadded chunks attend
through :func:`kvlab.policies.attention.lower_right_chunks` (no 4-D mask, no K/V repeated per
query head).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from kvlab import decode


def chunk_bounds(n: int, chunk: int | None) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` covering ``range(n)`` in chunks of ``chunk`` (the last may be shorter)."""
    if chunk is None or chunk >= n:
        return [(0, n)]
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    return [(start, min(n, start + chunk)) for start in range(0, n, chunk)]


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, chunk: int | None = None,
            attention_mask: torch.Tensor | None = None, logits_to_keep: int = 1) -> torch.Tensor:
    """:func:`kvlab.decode.prefill` in chunks of ``chunk`` tokens (None or >= the prompt: one shot).

    On a fresh cache the chunks are one prompt (an evicting cache compresses as they stream in, to
    the budget of the whole prompt); on a cache that already holds tokens they are appended, as a
    one-shot second forward would be. Returns logits ``[B, k, V]`` for the last ``k =
    logits_to_keep`` positions (0: all), as one shot does.
    """
    n = input_ids.shape[1]
    bounds = chunk_bounds(n, chunk)
    if len(bounds) == 1:
        return decode.prefill(model, input_ids, cache, attention_mask, logits_to_keep)
    from kvlab.policies.attention import lower_right_chunks
    from kvlab.policies.chunking import streaming

    fresh = cache.get_seq_length() == 0
    past = attention_mask.shape[1] - n if attention_mask is not None else 0
    pieces = []
    unpadded = lower_right_chunks(model) if attention_mask is None else nullcontext()
    with streaming(cache, n) if fresh else nullcontext(), unpadded:
        for start, end in bounds:
            wanted = end - start if logits_to_keep == 0 else logits_to_keep - (n - end)
            keep = max(0, min(end - start, wanted))  # this chunk's share of the logits asked for
            mask = attention_mask[:, : past + end] if attention_mask is not None else None
            logits = decode.prefill(model, input_ids[:, start:end], cache, mask, keep or 1)
            if keep:
                pieces.append(logits[:, -keep:])
    return torch.cat(pieces, dim=1)

