"""Shared base of the prefill-eviction policies (kvpress semantics).

Once, at the end of the prefill, each layer keeps ``budget(n)`` = floor(n x keep) >= 1 prompt
positions per KV head: the top-k of the method's score, re-sorted so the kept tokens stay in
prompt order. Tokens that arrive later (a question, generated tokens) are appended uncompressed.
A method is a subclass that sets ``name`` and implements ``score`` (or ``select``); methods that
read attention set ``needs_attention`` and say how many last prompt queries they need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch

from kvlab.policies.base import Policy, check_keep, hf_model, model_shape
from kvlab.policies.cache import EvictingLayer, EvictionCache
from kvlab.policies.quantized.key_outliers import warn_per_token_keys
from kvlab.policies.quantized.storage import QuantSpec
from kvlab.storage import attention
from kvlab.storage.dense import DenseStorage


@dataclass(frozen=True)
class EvictionPolicy(Policy):
    keep: float = field(default=0.5, metadata={"help": "fraction of prompt positions kept per layer and KV head"})
    quant: QuantSpec | None = field(default=None, metadata={
        "help": "evict, then quantize the kept K/V: {'backend': 'quanto', 'nbits': 4, ...} (default: no)"})

    needs_attention: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "keep", check_keep(self.keep))
        object.__setattr__(self, "quant", QuantSpec.coerce(self.quant))

    # -- what a method defines ----------------------------------------------------------------
    def budget(self, n: int, layer_idx: int, num_layers: int) -> int:
        """Prompt positions this layer keeps per KV head."""
        return max(1, math.floor(n * self.keep))

    def query_window(self, n: int) -> int:
        """How many last prompt queries the score needs (0: none)."""
        return 0

    def score(self, keys: torch.Tensor, values: torch.Tensor, attn: torch.Tensor | None,
              layer_idx: int) -> torch.Tensor:
        """``[B, Hkv, n]``, higher is kept. ``attn`` is ``[B, Hq, w, n]`` float32 when needed."""
        raise NotImplementedError

    def select(self, keys: torch.Tensor, values: torch.Tensor, attn: torch.Tensor | None, n_kept: int,
               layer_idx: int, num_layers: int) -> torch.Tensor:
        """Kept prompt positions, ``[B, Hkv, n_kept]`` ascending."""
        scores = self.score(keys, values, attn, layer_idx)
        return scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values

    # -- the Policy contract ------------------------------------------------------------------
    def kept_tokens(self, n: int, num_layers: int) -> list[int]:
        return [min(n, self.budget(n, i, num_layers)) for i in range(num_layers)]

    def storage(self):
        """The kept K/V at the model dtype, or in the kvq format of ``quant``; the prefill fills this
        policy's own cache (unquantized) and the store takes what it kept."""
        if self.quant is None:
            return DenseStorage(prefill=self)
        return self.quant.storage(prefill=replace(self, quant=None))

    @property
    def bits(self) -> int | None:
        return self.quant.nbits if self.quant else None

    @property
    def label(self) -> str:
        text = f"{self.name} {self.keep:.0%}"
        return self.chunk_label(f"{text} + {self.quant.label}" if self.quant else text)

    def engine_label(self, engine: str) -> str:
        if engine != "fast" or self.quant is None:
            return self.label
        return self.asked_as(self.chunk_label(f"{self.name} {self.keep:.0%} + {self.quant.fast_label}"))

    def check(self, model) -> None:
        shape = model_shape(model)
        shape.check_full_attention(f"{self.name} evicts")
        if self.quant:
            self.quant.check(shape)
        if self.stores_keys_per_token():
            warn_per_token_keys(model, self.label)

    def stores_keys_per_token(self) -> bool:
        return self.quant is not None and self.quant.impl.per_token_keys(self.quant)

    def prepare(self, model) -> None:
        if self.needs_attention:
            attention.install(hf_model(model))

    def warmup(self, model) -> None:
        if self.quant:
            self.quant.warmup(model)

    def make_cache(self, model):
        self.prepare(model)
        num_layers = model_shape(model).num_layers
        if self.quant is None:
            layers = [EvictingLayer(self, i, num_layers) for i in range(num_layers)]
        else:
            layer_class = self.quant.evicting_layer_class()
            layers = [layer_class(self, i, num_layers, **self.quant.layer_kwargs()) for i in range(num_layers)]
        return EvictionCache(layers, self)
