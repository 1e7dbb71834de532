"""Decode engines: how a measured generation turns a prefilled cache into N new tokens.

One interface (:mod:`kvlab.engine.engines`: ``make_engine``, ``Engine``, ``Decoder``, ``EngineSet``),
two implementations; this module holds what needs no torch (names, argument checks).

- ``hf``: transformers' own forward for every decode step (:mod:`kvlab.engine.hf`), through the
  policy's transformers cache. What users run today; at batch 1 on a fast GPU it measures Python
  and launch overhead as much as the cache.
- ``fast``: the prefill still runs through transformers and the policy's cache; then the kept K/V
  move into static buffers sized at prefill (kept tokens + new tokens) and every decode step is one
  replay of a CUDA graph (eagerly on CPU): the model's own weights and modules, kvlab's attention
  over the static buffers, greedy argmax on the GPU, no host sync inside the token loop
  (:mod:`kvlab.engine.fast`). What a method costs when the implementation is not the bottleneck.
  ``prefill_rows`` prefills a large batch a group of sequences at a time into those buffers
  (:func:`prefill_rows`), so its peak holds one group's full-length prefill cache, not the batch's.

Generation helpers both use (prefill, question append, greedy decode, teacher forcing):
:mod:`kvlab.engine.generation`.
"""

from __future__ import annotations

from kvlab.errors import EngineError

ENGINES: dict[str, str] = {
    "hf": "transformers forward per decode step, the policy's transformers cache (today's stack)",
    "fast": "static KV buffers + one CUDA-graph replay per decode step, greedy argmax on the GPU",
}


def check_engine(name: str) -> str:
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}: use one of {', '.join(ENGINES)}")
    return name


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")  # architectures the fast engine's step runs


def check_model_type(kind: str) -> None:
    """Raise :class:`EngineError` (one line naming the supported architectures) for other models;
    cheap enough to run on a ``ModelSpec`` before any weight loads."""
    if kind not in SUPPORTED_MODEL_TYPES:
        raise EngineError(f"the fast engine supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not {kind!r}: "
                          f"use engine hf for this model")


def prefill_rows(rows: int | None, batch: int, engine: str = "fast") -> int | None:
    """The sequences per prefill group of a run at ``batch`` asked for ``rows``: None when unset or
    when one group would hold the whole batch (the plain prefill, with the plain run id). Only the
    fast engine fills its cache by row groups: transformers' decode cache cannot be put together from
    groups without holding the whole batch's cache, so ``hf`` with fewer rows than the batch fails."""
    if rows is None:
        return None
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise EngineError(f"prefill_rows={rows!r}: give a whole number of sequences >= 1 (None: all at once)")
    if rows >= batch:
        return None
    if engine != "fast":
        raise EngineError(f"prefill_rows={rows} below batch {batch} needs the fast engine, not {engine}: "
                          f"transformers' decode cache cannot be put together from row groups without holding "
                          f"the whole batch's")
    return rows


__all__ = ["ENGINES", "SUPPORTED_MODEL_TYPES", "EngineError", "check_engine", "check_model_type", "prefill_rows"]
