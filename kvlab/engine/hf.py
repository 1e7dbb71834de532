"""The ``hf`` engine: transformers' own forward for every decode step, through the policy's
transformers cache (:mod:`kvlab.engine.generation`). What users run today; at batch 1 on a fast GPU
it measures Python and launch overhead as much as the cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvlab.anatomy import Anatomy
from kvlab.columns import engine_columns
from kvlab.engine.anatomy import hf_anatomy
from kvlab.engine.generation import fork_cache, forward, greedy_decode, positions, prefill
from kvlab.policies import cache_stats
from kvlab.policies.base import hf_model

FEEDS = ("batched", "stepwise")


class HFDecoder:
    """One generation in a policy's transformers cache: prefill into it, then greedy decode in it.

    ``feed``: how :meth:`feed` appends its tokens: ``batched`` (one forward, the default) or
    ``stepwise`` (one forward per token, as the fast engine feeds). Same storage and the same codes
    for everything before the fed tokens; only the float rounding of the fed tokens' own K/V differs.
    In a quantized store that rounding moves codes across rounding boundaries and the difference
    grows layer by layer, so ``stepwise`` against ``batched`` is the yardstick of the
    noise any two implementations of one format show (``benchmarks/quality_engines.py``'s ``hf1``).
    """

    def __init__(self, model, cache, prefill_stats: dict[str, Any] | None = None, feed: str = "batched"):
        if feed not in FEEDS:
            raise ValueError(f"feed={feed!r}: use one of {', '.join(FEEDS)}")
        self.model = model
        self.cache = cache
        self._prefill_stats = prefill_stats
        self.feed_mode = feed

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, chunk: int | None = None, rows: int | None = None) -> torch.Tensor:
        """Prefill ``input_ids [B, n]`` into the cache (in chunks of ``chunk``); the first tokens ``[B, 1]``.
        ``rows`` must be None: :func:`kvlab.engine.prefill_rows` refuses row groups on ``hf``."""
        first = prefill(self.model, input_ids, self.cache, chunk)[:, -1, :].argmax(dim=-1, keepdim=True)
        self._prefill_stats = None
        return first

    @torch.no_grad()
    def feed(self, input_ids: torch.Tensor, start_position: int | torch.Tensor) -> torch.Tensor:
        """Teacher forcing: ``input_ids [B, n]`` appended to the cache in one forward (``stepwise``:
        one per token) at positions ``start_position, ...``; the logits ``[B, n, V]`` (float32). Each
        token attends what the cache returns for the tokens before it and itself (a quantized
        layer: the stored codes)."""
        ids = torch.as_tensor(input_ids, device=next(self.model.parameters()).device)
        ids = ids.reshape(-1, ids.shape[-1])
        if self.feed_mode == "stepwise":
            return torch.cat([self._forward(ids[:, j:j + 1], start_position + j) for j in range(ids.shape[1])], dim=1)
        return self._forward(ids, start_position)

    def _forward(self, ids: torch.Tensor, start_position: int | torch.Tensor) -> torch.Tensor:
        """One forward of ``ids`` through the cache from ``start_position``: the logits (float32)."""
        seen = self.cache.get_seq_length()
        if isinstance(start_position, int) and seen != start_position:
            raise RuntimeError(f"the cache reports {seen} tokens seen, feeding at {start_position}: its "
                               f"get_seq_length() must count every token, evicted or not")
        pos = positions(start_position, ids.shape[1], ids.shape[0], ids.device)
        return forward(self.model, ids, self.cache, pos, logits_to_keep=0).logits.float()

    def checkpoint(self):
        """A copy of the cache as it is now (:meth:`restore` goes back to it); None when the cache
        cannot be copied (then the caller rebuilds it)."""
        return fork_cache(self.cache, self.model)

    def restore(self, mark) -> None:
        self.cache = mark

    def decode(self, first_token: torch.Tensor, n_new: int, start_position: int | torch.Tensor,
               on_step: Callable[[int], Any] | None = None) -> torch.Tensor:
        """Greedy tokens ``[B, n_new]``: ``first_token`` then ``n_new - 1`` transformers forwards."""
        return greedy_decode(self.model, self.cache, first_token, n_new, start_position, on_step=on_step)

    def stats(self, new_tokens: int = 0) -> dict[str, Any]:
        """The cache's tokens and bytes (:func:`kvlab.policies.cache_stats`): as the compressed prefill
        left them (``new_tokens=0``), or as they are now (after ``new_tokens`` generated)."""
        if new_tokens == 0 and self._prefill_stats is not None:
            return self._prefill_stats
        return cache_stats(self.cache)

    def columns(self, prefill_rows: int | None = None) -> dict[str, Any]:
        """The engine's record columns: ``engine: hf`` and ``prefill_rows``."""
        return engine_columns(HFEngine.name, prefill_rows)


class HFEngine:
    """Decoders that run transformers' forward in the policy's own cache; nothing is held between runs.
    ``feed``: how its decoders feed tokens (:class:`HFDecoder`; ``stepwise`` is the noise yardstick)."""

    name = "hf"

    def __init__(self, loaded, feed: str = "batched"):
        if feed not in FEEDS:
            raise ValueError(f"feed={feed!r}: use one of {', '.join(FEEDS)}")
        self.loaded = loaded
        self.model = hf_model(loaded)
        self.feed = feed

    def storage_policy(self, policy):
        """The policy whose cache the prefill fills (and whose warm-up runs): the policy itself."""
        return policy

    def decoder(self, policy, batch: int, ctx: int, new_tokens: int) -> HFDecoder:
        """A decoder with a fresh cache of ``policy`` (built before a measured window opens)."""
        return HFDecoder(self.model, policy.make_cache(self.model), feed=self.feed)

    def decoder_for_cache(self, policy, cache, new_tokens: int, prefill_stats: dict[str, Any] | None = None) -> HFDecoder:
        """A decoder that goes on in ``cache``, already prefilled (e.g. a context, then a question
        appended uncompressed). ``prefill_stats``: what :meth:`HFDecoder.stats` reports for the
        prefill (the cache before the question); None: the cache as it is now."""
        return HFDecoder(self.model, cache, prefill_stats, feed=self.feed)

    def release(self) -> bool:
        """Nothing is held between runs: False."""
        return False

    def anatomy(self, policy, ctx: int, batch: int = 1, steps: int = 8, warmup: int = 2, seed: int = 0) -> Anatomy:
        """Where a decode step's time goes (:func:`kvlab.engine.anatomy.hf_anatomy`)."""
        return hf_anatomy(self, policy, ctx, batch, steps, warmup, seed)
