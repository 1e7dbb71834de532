"""Quest's page bounds beside a transformers cache layer, for the ``hf`` engine.

:class:`QuestLayer` is a ``DynamicLayer`` (K/V kept whole, returned whole) that also keeps the
page bounds of :mod:`kvlab.kernels.quest`, folded in on every update. transformers' cache interface
never sees the query, so the sparse read happens in the attention function: for a decode step
(one query token) of a layer at or past ``dense_layers`` (Quest keeps the first two layers dense),
the function calls :meth:`QuestLayer.attend` instead of the stock kernel. The prefill (the first
update, or every chunk of a chunked prefill) attends densely, as Quest's own code does; a
multi-token chunk after it (a question, a teacher-forced answer or continuation) is read row by
row as decoding its tokens one at a time would read them (:func:`kvlab.kernels.quest.chunk_attend`),
so teacher-forced fidelity measures the sparse read. The hook belongs in kvlab's registered
attention wrapper (:mod:`kvlab.policies.attention`), which already hands queries to cache layers.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from kvlab.kernels import quest
from kvlab.policies import attention


class QuestLayer(DynamicLayer):
    """Whole K/V plus ``kmin``/``kmax`` per page of ``spec.page`` tokens and KV head."""

    def __init__(self, spec: quest.QuestSpec | None = None, layer_idx: int = 0, dense_layers: int = 2):
        super().__init__()
        self.spec = spec or quest.QuestSpec()
        self.layer_idx = layer_idx
        self.sparse = layer_idx >= dense_layers
        self.attends_own_queries = self.sparse  # kvlab's attention wrapper hands this layer its queries
        self.prompt_left = 0  # tokens of a chunked prefill still to come (they attend densely)
        self._returned: torch.Tensor | None = None  # the keys a decode update returned, for the attention hook
        self.kmin: torch.Tensor | None = None  # [B, H, pages, D]
        self.kmax: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        prefill = not self.is_initialized or self.prompt_left > 0
        start = self.get_seq_length() if self.is_initialized else 0
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self._fold(key_states, start)
        self.prompt_left = max(0, self.prompt_left - key_states.shape[-2])
        if self.sparse and not prefill:  # decode or a chunk after the prefill: kvlab's attention hands us the queries
            self._returned = keys
            attention.expect_queries(self.layer_idx, self)
        return keys, values

    def begin_stream(self, prompt_length: int) -> None:
        """A chunked prefill of ``prompt_length`` tokens starts: its chunks attend densely (Quest's
        prefill, and the fast engine's, is dense)."""
        self.prompt_left = prompt_length

    def end_stream(self) -> None:
        self.prompt_left = 0

    def awaits(self, key: torch.Tensor) -> bool:
        """Whether ``key`` is the tensor this layer's last decode update returned."""
        return self._returned is not None and self._returned is key

    def receive_queries(self, query: torch.Tensor, attention_mask, scaling) -> None:
        """Called only for queries the wrapper did not hand to :meth:`attend` (more than one token)."""
        self._returned = None

    def _fold(self, new: torch.Tensor, start: int) -> None:
        """Fold keys at positions ``start ..`` into the bounds: the pages they touch are recomputed
        from the stored keys (the partial last page included)."""
        page = self.spec.page
        first, end = start // page, self.keys.shape[2]
        pages = -(-end // page)
        if self.kmin is None or self.kmin.shape[2] < pages:
            grow = max(pages, 2 * (0 if self.kmin is None else self.kmin.shape[2]))
            b, h, _, d = self.keys.shape
            kmin = self.keys.new_full((b, h, grow, d), float("inf"))
            kmax = self.keys.new_full((b, h, grow, d), float("-inf"))
            if self.kmin is not None:
                kmin[:, :, :self.kmin.shape[2]] = self.kmin
                kmax[:, :, :self.kmax.shape[2]] = self.kmax
            self.kmin, self.kmax = kmin, kmax
        view = quest.PageBounds(self.spec, self.kmin[:, :, first:], self.kmax[:, :, first:])
        quest.load_bounds(view, self.keys[:, :, first * page:end])

    def bounds(self) -> quest.PageBounds:
        pages = -(-self.get_seq_length() // self.spec.page)
        return quest.PageBounds(self.spec, self.kmin[:, :, :pages], self.kmax[:, :, :pages])

    def attend(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """Quest's read for the queries ``[B, Hq, n, D]`` of the last ``n`` tokens -> ``[B, n, Hq, D]``
        (the layout transformers' attention functions return), in the query's dtype: one decode
        query, or a chunk read row by row as its tokens decoded one at a time would be."""
        self._returned = None
        b, hq, n, d = query.shape
        if n > 1:
            out = quest.chunk_attend(query, self.keys, self.values, self.bounds(), scaling)
            return out.transpose(1, 2).to(query.dtype).contiguous()
        lengths = torch.full((b,), self.get_seq_length(), device=query.device)
        out = quest.quest_attend(query[:, :, 0], self.keys, self.values, self.bounds(), lengths, scaling)
        return out.to(query.dtype).view(b, 1, hq, d)

    def nbytes(self) -> int:
        """K/V and the bounds of the pages holding tokens (``cache_stats`` counts this)."""
        if not self.is_initialized or self.kmin is None:
            return 0
        pages = -(-self.get_seq_length() // self.spec.page)
        kv = (self.keys.numel() + self.values.numel()) * self.keys.element_size()
        return kv + 2 * self.kmin[:, :, :pages].numel() * self.kmin.element_size()

    def reset(self) -> None:
        super().reset()
        self.kmin = self.kmax = self._returned = None
        self.prompt_left = 0


def quest_cache(num_layers: int, spec: quest.QuestSpec | None = None, dense_layers: int = 2) -> Cache:
    """A transformers cache of :class:`QuestLayer` s (the first ``dense_layers`` never read sparsely)."""
    return Cache(layers=[QuestLayer(spec, i, dense_layers) for i in range(num_layers)])
