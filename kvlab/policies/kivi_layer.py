"""The KIVI-style store (:mod:`kvlab.kernels.kivi`) as a transformers cache layer, for the ``hf`` engine.

Holds exactly what the fast engine's :class:`kvlab.kernels.kivi.KiviStore` holds at the same length:
the first ``quantized_tokens(n)`` tokens as codes (keys per channel over groups of G tokens, values
per token), the rest as bf16, flushed G at a time once R + G tokens are exact; the codes are
computed from the bf16 values, as the fast store's. Attention gets the whole cache dequantized to
the model dtype (the explicit dequantize-then-attend path, as :class:`kvlab.policies.quantized.kvq_layers.KVQLayer`);
the prefill's own attention reads the exact K/V.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.kernels import kivi


class KiviLayer(DynamicLayer):
    """One layer's K/V in a :class:`kvlab.kernels.kivi.KiviSpec` layout (codes grow by whole groups)."""

    is_croppable = False

    def __init__(self, spec: kivi.KiviSpec | None = None):
        super().__init__()
        self.spec = spec or kivi.KiviSpec()
        self.codes: list[tuple[torch.Tensor, ...]] = []  # per flushed chunk: k codes/scale/zero, v codes/scale/zero
        self.exact_k: torch.Tensor | None = None  # [B, H, r, D] bf16, the tokens not yet quantized
        self.exact_v: torch.Tensor | None = None
        self.quantized = 0
        self.dtype: torch.dtype | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype

    def _add(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        keys, values = keys.to(kivi.RESIDUAL_DTYPE), values.to(kivi.RESIDUAL_DTYPE)
        if self.exact_k is not None:
            keys, values = torch.cat([self.exact_k, keys], 2), torch.cat([self.exact_v, values], 2)
        flush = self.spec.quantized_tokens(self.quantized + keys.shape[2]) - self.quantized
        if flush:
            self.codes.append((*kivi.quantize_keys(self.spec, keys[:, :, :flush]),
                               *kivi.quantize_values(self.spec, values[:, :, :flush])))
            self.quantized += flush
        self.exact_k, self.exact_v = keys[:, :, flush:], values[:, :, flush:]

    def _dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        keys = [kivi.dequantize_keys(self.spec, *c[:3]) for c in self.codes] + [self.exact_k.float()]
        values = [kivi.dequantize_values(self.spec, *c[3:]) for c in self.codes] + [self.exact_v.float()]
        return torch.cat(keys, 2).to(self.dtype), torch.cat(values, 2).to(self.dtype)

    @property
    def stored_tokens(self) -> int:
        return self.quantized + (0 if self.exact_k is None else self.exact_k.shape[2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        self._add(key_states, value_states)
        if first:
            return key_states, value_states
        return self._dequantized()

    def get_seq_length(self) -> int:
        return self.stored_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a KIVI cache cannot be cropped: build a fresh cache for each question")

    def reset(self) -> None:
        super().reset()
        self.codes, self.exact_k, self.exact_v, self.quantized = [], None, None, 0

    def nbytes(self) -> int:
        tensors = [t for c in self.codes for t in c] + [t for t in (self.exact_k, self.exact_v) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def kivi_cache(num_layers: int, spec: kivi.KiviSpec | None = None) -> Cache:
    """A transformers cache of ``num_layers`` :class:`KiviLayer` s."""
    return Cache(layers=[KiviLayer(spec) for _ in range(num_layers)])
