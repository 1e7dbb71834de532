"""The KIVI-style store (:mod:`kvlab.kernels.kivi`) as a transformers cache layer, for the ``hf`` engine.

Holds exactly what the fast engine's :class:`kvlab.kernels.kivi.KiviStore` holds at the same length:
the first ``quantized_tokens(n)`` tokens as codes (keys per channel over groups of G tokens, values
per token), the rest as bf16, flushed G at a time once R + G tokens are exact; the codes are
computed from the bf16 values, as the fast store's. Attention gets the whole cache dequantized to
the model dtype (the explicit dequantize-then-attend path, as :class:`kvlab.policies.quantized.kvq_layers.KVQLayer`);
the prefill's own attention reads the exact K/V.

A multi-token chunk after the prefill (a question, a teacher-forced answer or continuation) is read
row by row as decoding its tokens one at a time would read them: the token at position ``p`` sees
the first ``quantized_tokens(p + 1)`` tokens as codes and the rest exact, up to itself
(:meth:`KiviLayer.attend`, handed the queries by kvlab's attention wrapper). Read as one block, every
row would see the state after the whole chunk (up to ``n`` more tokens quantized, its own recent
tokens among them, in groups whose ranges include tokens after it).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.kernels import kivi
from kvlab.policies import attention
from kvlab.policies.cache import StoredLengthMixin


class KiviLayer(StoredLengthMixin, DynamicLayer):
    """One layer's K/V in a :class:`kvlab.kernels.kivi.KiviSpec` layout (codes grow by whole groups)."""

    is_croppable = False
    attends_own_queries = True  # kvlab's attention wrapper hands a chunk's queries to :meth:`attend`

    def __init__(self, spec: kivi.KiviSpec | None = None, layer_idx: int = 0):
        super().__init__()
        self.spec = spec or kivi.KiviSpec()
        self.layer_idx = layer_idx
        self._returned: tuple[torch.Tensor, torch.Tensor] | None = None  # K/V a chunk's update returned, for the hook
        self._chunk: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (first exact position, exact K, V)
        self.codes: list[tuple[torch.Tensor, ...]] = []  # per flushed chunk: k codes/scale/zero, v codes/scale/zero
        self.exact_k: torch.Tensor | None = None  # [B, H, r, D] bf16, the tokens not yet quantized
        self.exact_v: torch.Tensor | None = None
        self.quantized = 0
        self.dtype: torch.dtype | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.dtype = key_states.dtype

    def _add(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Append; flush the groups that filled. Returns the first position not quantized before this
        update and the exact (bf16) K/V from there on."""
        start = self.quantized
        keys, values = keys.to(kivi.RESIDUAL_DTYPE), values.to(kivi.RESIDUAL_DTYPE)
        if self.exact_k is not None:
            keys, values = torch.cat([self.exact_k, keys], 2), torch.cat([self.exact_v, values], 2)
        flush = self.spec.quantized_tokens(self.quantized + keys.shape[2]) - self.quantized
        if flush:
            self.codes.append((*kivi.quantize_keys(self.spec, keys[:, :, :flush]),
                               *kivi.quantize_values(self.spec, values[:, :, :flush])))
            self.quantized += flush
        self.exact_k, self.exact_v = keys[:, :, flush:], values[:, :, flush:]
        return start, keys, values

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
        added = self._add(key_states, value_states)
        if first:
            return key_states, value_states
        keys, values = self._dequantized()
        if key_states.shape[-2] > 1:  # a chunk: kvlab's attention hands us its queries (:meth:`attend`)
            self._returned, self._chunk = (keys, values), added
            attention.expect_queries(self.layer_idx, self)
        return keys, values

    def awaits(self, key: torch.Tensor) -> bool:
        """Whether ``key`` is the tensor this layer's last chunk update returned."""
        return self._returned is not None and self._returned[0] is key

    def receive_queries(self, query: torch.Tensor, attention_mask, scaling) -> None:
        self._returned = self._chunk = None

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The last update's ``n`` queries ``[B, Hq, n, D]`` -> ``[B, n, Hq, D]`` in the query's dtype,
        each row over what the cache returned when its token was appended alone: tokens before
        ``quantized_tokens(p + 1)`` dequantized, the rest exact, causal (the K/V in the model dtype,
        as the one-token path hands them to the stock kernel)."""
        (keys, values), (start, exact_k, exact_v) = self._returned, self._chunk
        self._returned = self._chunk = None
        batch, q_heads, n, d = query.shape
        total, kv_heads = keys.shape[2], keys.shape[1]
        pos = torch.arange(total - n, total, device=query.device).view(n, 1)  # each row's position
        seen_q = torch.tensor([self.spec.quantized_tokens(p + 1) for p in range(total - n, total)],
                              device=query.device).view(n, 1)
        t_all = torch.arange(total, device=query.device).view(1, total)
        t_exact = torch.arange(start, total, device=query.device).view(1, total - start)
        visible = torch.cat([t_all < seen_q, (t_exact >= seen_q) & (t_exact <= pos)], dim=1)  # [n, T + T - start]
        k = torch.cat([keys, exact_k.to(keys.dtype)], 2).float()
        v = torch.cat([values, exact_v.to(values.dtype)], 2).float()
        qf = query.float().view(batch, kv_heads, q_heads // kv_heads, n, d)
        logits = torch.einsum("bhgnd,bhtd->bhgnt", qf, k) * scaling
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        out = torch.einsum("bhgnt,bhtd->bhgnd", probs, v).reshape(batch, q_heads, n, d)
        return out.transpose(1, 2).to(query.dtype).contiguous()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a KIVI cache cannot be cropped: build a fresh cache for each question")

    def reset(self) -> None:
        super().reset()
        self.codes, self.exact_k, self.exact_v, self.quantized = [], None, None, 0
        self._returned = self._chunk = None

    def nbytes(self) -> int:
        tensors = [t for c in self.codes for t in c] + [t for t in (self.exact_k, self.exact_v) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


def kivi_cache(num_layers: int, spec: kivi.KiviSpec | None = None) -> Cache:
    """A transformers cache of ``num_layers`` :class:`KiviLayer` s."""
    return Cache(layers=[KiviLayer(spec, i) for i in range(num_layers)])
