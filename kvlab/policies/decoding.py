"""Decode-time compression (kvpress's DecodingPress): a budgeted cache for long generations.

Why: prefill eviction bounds the prompt's share of the cache, but a long generation (reasoning
traces, 8k new tokens) grows it by one token per step for ever. This cache keeps the prompt whole,
counts the tokens appended after it, and every ``interval`` of them evicts back to ``target`` rows
per layer and KV head with a scoring method from the registry (``score``: snapkv, tova, knorm,
streamingllm, random, with ``score_params``). So a layer never holds more than
``max(prompt, target) + interval`` rows.

Semantics (kvpress DecodingPress, kvlab details):
- attention scorers read the queries of the last ``window`` appended tokens (SnapKV's
  ``window_size``, TOVA's last token), collected during the steps before the compression; those
  tokens are the newest rows, so SnapKV always keeps them;
- the eviction runs at the start of the step after the interval's last token, so every token of
  the interval attended to the uncompressed cache (kvpress compresses after that step's attention);
  its cost lands in that step's latency;
- positions are not re-indexed: kept rows keep their RoPE rotation and the next token its logical
  position; ``kept_positions`` gives the original position of every held row;
- the prompt (chunked or not) is never compressed here; ``target`` counts prompt and generated
  rows alike. The fast engine's static buffers cannot shrink: this policy runs on ``hf``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.policies.base import Policy, PolicyError, hf_model, int_param, model_shape
from kvlab.policies.cache import EvictionError, LogicalLengthMixin
from kvlab.policies.knorm import KnormPolicy
from kvlab.policies.random import RandomPolicy
from kvlab.policies.snapkv import SnapKVPolicy
from kvlab.policies.streamingllm import StreamingLLMPolicy
from kvlab.policies.tova import TOVAPolicy
from kvlab.storage import attention

SCORERS: dict[str, type[Policy]] = {
    cls.name: cls for cls in (SnapKVPolicy, TOVAPolicy, KnormPolicy, StreamingLLMPolicy, RandomPolicy)}


def make_scorer(score: str, score_params: dict[str, Any] | None):
    """The eviction policy whose ``select`` picks the kept rows (its ``keep`` is unused)."""
    if score not in SCORERS:
        raise PolicyError(f"score={score!r} cannot drive decode-time compression: use one of {', '.join(SCORERS)}")
    params = dict(score_params or {})
    for bad in ("keep", "quant", "prefill_chunk"):
        if bad in params:
            raise PolicyError(f"score_params.{bad} does not apply to decode-time compression (target sets the "
                              f"budget): drop it")
    return SCORERS[score].from_params(**params)


class DecodingLayer(LogicalLengthMixin, DynamicLayer):
    """A DynamicLayer that evicts back to ``target`` rows every ``interval`` tokens after the prompt.

    Counts tokens logically like :class:`kvlab.policies.cache.EvictingLayer` (``get_seq_length`` is
    every token seen, ``get_mask_sizes`` the physical rows)."""

    def __init__(self, policy: DecodingPolicy, scorer, layer_idx: int, num_layers: int):
        super().__init__()
        self.policy, self.scorer = policy, scorer
        self.layer_idx, self.num_layers = layer_idx, num_layers
        self.window = scorer.query_window(policy.target) if scorer.needs_attention else 0
        self._clear()

    def _clear(self) -> None:
        self.logical_length = self.physical_length = 0
        self.prompt_length: int | None = None
        self.compressions = 0
        self._since = 0  # tokens appended since the prompt or the last compression
        self._kept: torch.Tensor | None = None  # positions of the rows held at the last compression
        self._tail_start = 0  # rows after those hold positions _tail_start.. (contiguous)
        self._queries: list[torch.Tensor] = []
        self._awaiting_key: torch.Tensor | None = None
        self._scaling: float | None = None
        self._stream_length: int | None = None

    # -- a chunked prompt is still the prompt ------------------------------------------------
    def begin_stream(self, prompt_length: int) -> None:
        self._stream_length = prompt_length

    def end_stream(self) -> None:
        self._stream_length = None

    # -- inspection ----------------------------------------------------------------------------
    @property
    def kept_positions(self) -> torch.Tensor | None:
        """Original position of every held row, ``[B, Hkv, rows]`` ascending; None before the prompt."""
        if self.prompt_length is None:
            return None
        b, h = self.keys.shape[:2]
        tail = torch.arange(self._tail_start, self.logical_length, device=self.keys.device).expand(b, h, -1)
        return tail if self._kept is None else torch.cat([self._kept.long(), tail], dim=-1)

    # -- transformers layer API ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._awaiting_key is not None:
            self._awaiting_key = None
            attention.cancel_queries(self.layer_idx)
            raise EvictionError(f"decoding ({self.scorer.name}) needs the queries of layer {self.layer_idx}, but the "
                                f"attention function never handed them over: call policy.prepare(model) first")
        in_prompt = self.prompt_length is None or (
            self._stream_length is not None and self.logical_length < self._stream_length)
        if not in_prompt and self._since >= self.policy.interval:
            self._compress()
        n_new = key_states.shape[-2]
        keys, values = super().update(key_states, value_states)
        self.logical_length += n_new
        self.physical_length += n_new
        if in_prompt:
            self.prompt_length = self.logical_length
            return keys, values
        self._since += n_new
        if self.window and self._since > self.policy.interval - self.window:  # a query the score needs
            self._awaiting_key = keys
            attention.expect_queries(self.layer_idx, self)
        return keys, values

    def awaits(self, key: torch.Tensor) -> bool:
        return self._awaiting_key is not None and self._awaiting_key is key

    def receive_queries(self, query: torch.Tensor, attention_mask, scaling) -> None:
        self._awaiting_key = None
        self._scaling = scaling
        self._queries.append(query)
        rows = sum(q.shape[-2] for q in self._queries)
        while rows - self._queries[0].shape[-2] >= self.window:  # keep the last `window` queries
            rows -= self._queries.pop(0).shape[-2]

    def _compress(self) -> None:
        """Evict back to ``target`` rows (when over it) with the scorer; restart the count."""
        rows = self.keys.shape[-2]
        if rows > self.policy.target:
            probs = None
            if self.window:
                if not self._queries:
                    raise EvictionError(f"decoding ({self.scorer.name}): layer {self.layer_idx} received no "
                                        f"queries before its compression: call policy.prepare(model) first")
                query = torch.cat(self._queries, dim=-2)[..., -self.window:, :]
                probs = attention.window_attention(query, self.keys, self._scaling, self.window)
            idx = self.scorer.select(self.keys, self.values, probs, self.policy.target, self.layer_idx,
                                     self.num_layers)
            positions = self.kept_positions
            self._kept = positions.gather(-1, idx.to(positions.device)).to(torch.int32)
            gather = idx.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
            self.keys, self.values = self.keys.gather(2, gather), self.values.gather(2, gather)
            self._tail_start = self.logical_length
            self.physical_length = self.policy.target
            self.compressions += 1
        self._since = 0
        self._queries = []

    def reset(self) -> None:
        if self._awaiting_key is not None:
            attention.cancel_queries(self.layer_idx)
        super().reset()
        self._clear()

    def crop(self, tokens_to_remove: int) -> None:
        raise EvictionError("a decode-time compressed cache cannot be cropped: build a fresh cache per question")


@dataclass(frozen=True)
class DecodingPolicy(Policy):
    name = "decoding"
    summary = "full prompt; every `interval` new tokens evict back to `target` rows with `score` (DecodingPress)"

    score: str = field(default="snapkv", metadata={"help": f"scoring method: {', '.join(SCORERS)}"})
    target: int = int_param(2048, "rows per layer and KV head kept at each compression", minimum=1)
    interval: int = int_param(512, "tokens appended after the prompt between compressions", minimum=1)
    score_params: dict | None = field(default=None, metadata={
        "help": "the scorer's knobs, e.g. {window_size: 32} (snapkv) or {n_sink: 4} (streamingllm)"})

    def __post_init__(self):
        super().__post_init__()
        if self.score_params is not None and not isinstance(self.score_params, dict):
            raise PolicyError(f"score_params must be a mapping such as {{window_size: 32}}, got {self.score_params!r}")
        scorer = make_scorer(self.score, self.score_params)
        window = scorer.query_window(self.target) if scorer.needs_attention else 0
        if window > self.interval:
            raise PolicyError(f"the {self.score} window ({window} queries) is longer than interval={self.interval}: "
                              f"use score_params: {{window_size: {self.interval}}} or a longer interval")
        object.__setattr__(self, "_scorer", scorer)

    @property
    def scorer(self):
        return self._scorer

    @property
    def label(self) -> str:
        return self.chunk_label(f"decoding {self.score} {self.target}/{self.interval}")

    def params(self) -> dict[str, Any]:
        out = super().params()
        out["score_params"] = dict(self.score_params or {})
        return out

    def check(self, model) -> None:
        model_shape(model).check_full_attention("decoding evicts", fix="use 'full'")

    def prepare(self, model) -> None:
        if self.scorer.needs_attention:
            attention.install(hf_model(model))

    def make_cache(self, model):
        self.prepare(model)
        num_layers = model_shape(model).num_layers
        return Cache(layers=[DecodingLayer(self, self.scorer, i, num_layers) for i in range(num_layers)])

    def storage(self):
        raise PolicyError("decode-time compression (decoding) shrinks the cache while decoding, and the fast "
                          "engine's static buffers cannot: use engine hf")
