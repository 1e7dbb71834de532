"""Quest over block tables: every block kept at the model dtype, and beside the pool each block's key
min and max per KV head (``kmin``/``kmax [layers, blocks, Hkv, D]``, folded in as slots are written; a
block's first slot replaces them). A page is one block, so a request's page bounds are its block
table's rows of ``kmin``/``kmax`` and the storage's paged layout (K/V plus one min and max per page)
is exactly what a block weighs.

Rows of a chunk past the prompt read as Quest's decode step reads them (:mod:`kvlab.kernels.quest`'s
torch reference): the first page, the latest, then the top-bound pages up to the budget;
``quest_attend`` for one row, ``chunk_attend`` row by row for generated tokens re-fed after a
preemption. Prompt rows and the first ``dense_layers`` layers attend densely, as in the static engines.
"""

from __future__ import annotations

import torch

from kvlab.kernels import quest
from kvlab.serve.pool import DensePool, attend


class QuestPool(DensePool):
    """A dense pool plus per-block key bounds; decode rows of sparse layers read the selected pages."""

    paged_kernel = False  # the Triton paged decode reads every block; Quest's read is the torch reference here

    def __init__(self, read: quest.QuestRead, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        super().__init__(num_layers, num_blocks, block_size, kv_heads, head_dim, dtype, device)
        self.quest, self.block_size = read, block_size
        shape = (num_layers, num_blocks, kv_heads, head_dim)
        self.kmin = torch.full(shape, float("inf"), dtype=dtype, device=device)
        self.kmax = torch.full(shape, float("-inf"), dtype=dtype, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        super().write(layer, slots, k, v, owner, first)
        slots = slots.to(self.kmin.device)
        blocks = slots // self.block_size
        fresh = blocks[slots % self.block_size == 0]  # a block's first slot: a new owner, or a new page
        self.kmin[layer, fresh] = float("inf")
        self.kmax[layer, fresh] = float("-inf")
        keys = k.to(self.dtype)
        where = blocks.view(-1, 1, 1).expand_as(keys)
        self.kmin[layer].scatter_reduce_(0, where, keys, "amin")
        self.kmax[layer].scatter_reduce_(0, where, keys, "amax")

    def page_bounds(self, layer: int, held: torch.Tensor) -> quest.PageBounds:
        """The bounds ``[1, Hkv, pages, D]`` of the request whose held slots are ``held`` (token order)."""
        blocks = (held[::self.block_size] // self.block_size).to(self.kmin.device)
        kmin, kmax = self.kmin[layer, blocks], self.kmax[layer, blocks]  # [pages, Hkv, D]
        return quest.PageBounds(self.quest.spec, kmin.transpose(0, 1)[None], kmax.transpose(0, 1)[None])

    def attend(self, layer: int, q: torch.Tensor, held: torch.Tensor, scale: float, decode_from: int) -> torch.Tensor:
        n = q.shape[1]
        if layer < self.quest.dense_layers or decode_from >= n:
            return super().attend(layer, q, held, scale, decode_from)
        keys, values = self.read(layer, held)  # [Hkv, m, D]
        m = keys.shape[1]
        parts = []
        if decode_from > 0:  # prompt rows of the chunk: dense, causal over the slots up to each
            upto = m - (n - decode_from)
            parts.append(attend(q[:, :decode_from], keys[:, :upto], values[:, :upto], scale))
        bounds = self.page_bounds(layer, held)
        rows = q[:, decode_from:]
        if rows.shape[1] == 1:
            lengths = torch.full((1,), m, device=q.device)
            out = quest.quest_attend(rows[None, :, 0], keys[None], values[None], bounds, lengths, scale)[0][:, None]
        else:
            out = quest.chunk_attend(rows[None], keys[None], values[None], bounds, scale)[0]
        parts.append(out.to(q.dtype))
        return torch.cat(parts, 1)
