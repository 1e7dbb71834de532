"""What a storage family hands the serving engine: a pool of fixed blocks holding its K/V
(:meth:`kvlab.storage.base.Storage.paged_pool`), and the dense attention every pool reads by default.

A pool holds ``num_blocks`` blocks of ``block_size`` token slots of every layer's K and V for every KV
head (vLLM's layout: one block id indexes the same slots in each layer). Slots are addressed flat:
slot ``block * block_size + offset``. The serving engine calls only :class:`PagedPool`'s methods:
``write`` stores K/V rows at slots, ``read`` returns a request's K/V ``[Hkv, n, D]`` in the order of
the slots it is given (its block table expanded to its stored length), ``attend`` is a chunk's
attention over the slots it holds (the torch reference: every held slot, causally, unless the family
reads otherwise). ``paged_kernel``: whether ``decode``, a step's decode tokens batched over their block
tables, runs a Triton kernel that reads the pool in place (:mod:`kvlab.kernels.paged`; the engine's
``attention="triton"``); ``captures_decode``: whether such a step may be captured in a CUDA graph
(:mod:`kvlab.serve.decode_graphs`, which writes the pool's ``k``/``v`` slots in place).

``write(layer, slots, k, v, owner, first)``: ``owner`` names the request (its first block id, unique
while it holds blocks) and ``first`` marks its first prefill chunk, so a family can keep per-request
state beside its blocks (a key offset fitted on the prompt, a tail of exact tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvlab.errors import PolicyError


@dataclass(frozen=True)
class PoolShape:
    """The geometry every pool is built for: layers, blocks (the allocator's and a spare), tokens per
    block, KV heads and head dim."""

    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int

    @property
    def slots(self) -> int:
        return self.num_blocks * self.block_size


class PoolDefaults:
    """The serving side of the :class:`~kvlab.storage.base.Storage` protocol for a family without a
    pool: it is not served, and it asks nothing of the block size."""

    def paged_pool(self, shape: PoolShape, dtype: torch.dtype, device) -> PagedPool:
        raise PolicyError(f"{type(self).__name__} has no paged pool")

    def block_size_problem(self, block_size: int) -> str | None:
        return None


class PagedPool:
    """A pool's reads for one chunk: dense over every slot it holds (the reference of every pool)."""

    paged_kernel = False
    captures_decode = False

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        """``k``/``v`` ``[n, Hkv, D]`` into ``slots [n]``."""
        raise NotImplementedError

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, held: torch.Tensor, scale: float, decode_from: int) -> torch.Tensor:
        """``q [Hq, n, D]`` of a chunk whose ``n`` tokens are the last of ``held`` (flat slots, in token
        order) -> ``[Hq, n, D]``. ``decode_from``: the first row past the prompt (a dense read ignores it)."""
        keys, values = self.read(layer, held)
        return attend(q, keys, values, scale)

    def decode(self, layer: int, q: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor,
               scale: float) -> torch.Tensor:
        """``q [B, Hq, D]``, one decode token per request, over each request's block table (``tables
        [B, blocks]`` int32, ``lengths [B]`` int32 slots held, its new token's included) -> ``[B, Hq, D]``."""
        raise NotImplementedError(f"{type(self).__name__} has no paged decode kernel: read it with attend")


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [Hq, n, D]``, the last ``n`` of the ``m`` held rows being its own: causal over the held K/V
    ``[Hkv, m, D]`` (earlier held rows are all visible). -> ``[Hq, n, D]``."""
    n, m = q.shape[1], keys.shape[1]
    mask = None
    if n > 1:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    return F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                          attn_mask=mask, scale=scale, enable_gqa=True)[0]
