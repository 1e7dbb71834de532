"""The engine interface, how to get one, and the one generation every caller runs through it.

    engine = make_engine("fast", loaded)                  # or "hf"; EngineSet(loaded).get(name) in a sweep
    decoder = engine.decoder(policy, batch, ctx, n)       # before a measured window opens
    first = decoder.prefill(ids, chunk, rows)             # [B, 1]
    tokens = decoder.decode(first, n, start_position=ctx, on_step=...)
    logits = decoder.feed(ids, start)                     # teacher forcing through the decoder's storage
    decoder.stats(n), decoder.columns(rows)               # the cache it left, its record columns

No caller asks which engine it has: what differs (the cache the prefill fills, where decode runs,
what is held between runs) is behind these methods.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvlab.anatomy import Anatomy
from kvlab.engine import check_engine
from kvlab.engine.fast import FastEngine
from kvlab.engine.generation import as_batch, model_device, prefill
from kvlab.engine.hf import HFEngine
from kvlab.policies import cache_stats
from kvlab.policies.base import hf_model


class Decoder(Protocol):
    """One measured shape's (or one prefilled cache's) decode state."""

    cache: Any  # the transformers cache the decode runs in (None: the engine's own buffers)

    def prefill(self, input_ids: torch.Tensor, chunk: int | None = None, rows: int | None = None) -> torch.Tensor:
        """Prefill ``input_ids [B, n]`` (``chunk`` tokens, ``rows`` sequences at a time); first tokens ``[B, 1]``."""

    def decode(self, first_token: torch.Tensor, n_new: int, start_position: int | torch.Tensor,
               on_step: Callable[[int], Any] | None = None) -> torch.Tensor:
        """Greedy tokens ``[B, n_new]`` (EOS ignored); ``on_step(i)`` after decode step ``i``."""

    def feed(self, input_ids: torch.Tensor, start_position: int | torch.Tensor) -> torch.Tensor:
        """Teacher forcing through the decoder's own storage: ``input_ids [B, n]`` appended at
        ``start_position, ...``; logits ``[B, n, V]`` float32. A question after a context, or a gold
        answer, sees the context as decode does (on ``fast``: the store's format, not the exact
        prefill cache)."""

    def checkpoint(self) -> Any:
        """A mark of the state now, for :meth:`restore` (None: cannot be kept; rebuild instead)."""

    def restore(self, mark: Any) -> None:
        """Go back to a :meth:`checkpoint` (e.g. teacher-force the gold after the greedy reply)."""

    def stats(self, new_tokens: int = 0) -> dict[str, Any]:
        """``logical_tokens``, ``physical_tokens``, ``bytes``, ...: after the prefill, or after ``new_tokens``."""

    def columns(self, prefill_rows: int | None = None) -> dict[str, Any]:
        """The engine's record columns (``engine``, ``prefill_rows``, and what the engine adds)."""


class Engine(Protocol):
    """Makes decoders for one loaded model: :class:`~kvlab.engine.hf.HFEngine` or
    :class:`~kvlab.engine.fast.FastEngine`."""

    name: str

    def storage_policy(self, policy):
        """The policy whose transformers cache the prefill fills and whose warm-up runs."""

    def decoder(self, policy, batch: int, ctx: int, new_tokens: int) -> Decoder:
        """A measured run's decoder, sized from the policy before any prefill."""

    def decoder_for_cache(self, policy, cache, new_tokens: int,
                          prefill_stats: dict[str, Any] | None = None) -> Decoder:
        """A decoder that goes on from a cache of :meth:`storage_policy` already prefilled."""

    def release(self) -> bool:
        """Drop held decoders and buffers; True if memory was freed."""

    def anatomy(self, policy, ctx: int, batch: int = 1, steps: int = 8, warmup: int = 2, seed: int = 0) -> Anatomy:
        """Where one decode step's time goes, by category (:mod:`kvlab.engine.anatomy`)."""


ENGINE_CLASSES = {"hf": HFEngine, "fast": FastEngine}


def make_engine(name: str, loaded, **options) -> Engine:
    """The engine ``name`` (``hf`` or ``fast``) for a loaded model; ``options`` go to its class
    (:class:`~kvlab.engine.fast.FastEngine`'s ``attention``, ``max_decoders``, ``compile``, ...)."""
    return ENGINE_CLASSES[check_engine(name)](loaded, **options)


def release_memory(device) -> None:
    """Return freed blocks to the device (CUDA's caching allocator keeps them otherwise)."""
    gc.collect()
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()


class EngineSet:
    """A loaded model's engines, each made once. A run's peak memory must be its own, so
    :meth:`get` first releases every other engine's held memory: when the fast engine kept the other methods' stores for reuse, they entered every later run's peak (hf full at
    batch 16 on the H200: 120.5 GB) and ran the full cache out of memory. ``options``: per engine
    name, the keywords of :func:`make_engine`; by default the fast engine keeps one decoder at a time
    (rebuilding one, buffers and graph, happens before a run's window opens)."""

    def __init__(self, loaded, **options: dict[str, Any]):
        self.loaded = loaded
        self.options = {"fast": {"max_decoders": 1}, **options}
        self.engines: dict[str, Engine] = {}

    def get(self, name: str) -> Engine:
        for other, engine in self.engines.items():
            if other != name and engine.release():
                release_memory(self.loaded.device)
        if name not in self.engines:
            self.engines[name] = make_engine(name, self.loaded, **self.options.get(name, {}))
        return self.engines[name]


@dataclass
class Generation:
    """What :func:`generate_text` produced, plus the cache's state after the prefill and at the end."""

    tokens: torch.Tensor  # [B, n_new]
    texts: list[str] | None
    prompt_tokens: int
    cache_after_prefill: dict[str, Any]
    cache_final: dict[str, Any]
    columns: dict[str, Any]  # the engine's record columns (``Decoder.columns``)
    cache: Any = field(repr=False)  # the transformers cache the decode ran in (None on fast)

    @property
    def text(self) -> str | None:
        return self.texts[0] if self.texts else None


def generate_text(loaded, prompt_ids, policy, max_new_tokens: int, question_ids=None,
                  engine: Engine | None = None) -> Generation:
    """Check, prepare and build the policy's cache, prefill ``prompt_ids`` (compressed once),
    then ``question_ids`` if given (appended uncompressed), then greedy-decode ``max_new_tokens``.

    ``loaded`` is a kvlab ``LoadedModel`` (texts are decoded with its tokenizer, if any) or a
    transformers model. ``engine``: default the ``hf`` engine (the prefill runs through transformers
    on either engine).
    """
    model = hf_model(loaded)
    engine = engine or HFEngine(model)
    tokenizer = getattr(loaded, "tokenizer", None)
    with policy.attach(loaded, warm=False):
        ids = as_batch(prompt_ids, model_device(model))
        cache = engine.storage_policy(policy).make_cache(model)
        logits = prefill(model, ids, cache, getattr(policy, "prefill_chunk", None))
        after_prefill = cache_stats(cache)
        start = cache.get_seq_length()
        question = None if question_ids is None else as_batch(question_ids, ids.device).expand(ids.shape[0], -1)
        room = max_new_tokens + (0 if question is None else question.shape[1])
        decoder = engine.decoder_for_cache(policy, cache, room, after_prefill)
        del cache  # the fast engine's store holds the decode; hf's decoder keeps the cache
        if question is not None:  # through the decoder's storage (fast: the store's format), as decode
            with torch.no_grad():
                logits = decoder.feed(question, start)
            start += question.shape[1]
        first = logits[:, -1].argmax(dim=-1)
        tokens = decoder.decode(first, max_new_tokens, start)
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True) if tokenizer is not None else None
    return Generation(tokens.cpu(), texts, ids.shape[1], decoder.stats(), decoder.stats(max_new_tokens),
                      decoder.columns(), decoder.cache)
