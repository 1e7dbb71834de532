"""Decode engines: how a measured generation turns a prefilled cache into N new tokens.

- ``hf``: transformers' own forward for every decode step (:mod:`kvlab.decode`), through the
  policy's transformers cache. What users run today; at batch 1 on a fast GPU it measures Python
  and launch overhead as much as the cache.
- ``fast``: the prefill still runs through transformers and the policy's cache; then the kept K/V
  move into static buffers sized at prefill (kept tokens + new tokens) and every decode step is one
  replay of a CUDA graph (eagerly on CPU): the model's own weights and modules, kvlab's attention
  over the static buffers, greedy argmax on the GPU, no host sync inside the token loop
  (:mod:`kvlab.engine.fast`). What a method costs when the implementation is not the bottleneck.
"""

from __future__ import annotations

from kvlab.errors import UserError

ENGINES: dict[str, str] = {
    "hf": "transformers forward per decode step, the policy's transformers cache (today's stack)",
    "fast": "static KV buffers + one CUDA-graph replay per decode step, greedy argmax on the GPU",
}


class EngineError(UserError):
    """An engine cannot run this model or policy; the message names the fix."""


def check_engine(name: str) -> str:
    if name not in ENGINES:
        raise EngineError(f"unknown engine {name!r}: use one of {', '.join(ENGINES)}")
    return name


__all__ = ["ENGINES", "EngineError", "check_engine"]
