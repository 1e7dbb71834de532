"""The block pool: a free list of block ids, and the K/V slots behind them (torch reference, CPU).

Slots are addressed flat: slot ``block * block_size + offset``. ``write`` stores K/V rows at
slots, ``read`` returns a request's K/V ``[Hkv, n, D]`` in the order of the slots it is given
(its block table expanded to its stored length), ``attend`` is a chunk's attention over the slots it
holds (every held slot, causally; a Quest pool reads only the selected pages of its decode rows:
:mod:`kvlab.serve.quest_pool`). ``paged_kernel``: whether the Triton paged decode reads the pool in
place (a dense pool). A dense pool holds the model dtype; a format
pool holds a ``kvlab.kernels`` format's codes and scales and dequantizes on read, so a quantized
request attends over exactly the bits its blocks store.

``write(layer, slots, k, v, owner, first)``: ``owner`` names the request (its first block id, unique
while it holds blocks) and ``first`` marks its first prefill chunk. A format pool with a key offset
(:mod:`kvlab.kernels.key_offset`) fits the request's per-channel offset ``[Hkv, D]`` on that chunk's
keys and stores every later key of the request minus it; reads return the shifted keys, which
attention does not see (``q . m`` is the same for every key of a request).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from kvlab.kernels.formats import KVStore
from kvlab.kernels.key_offset import KEY_OFFSETS, shifted


class BlockAllocator:
    """Block ids on a free list (FIFO, as nano-vllm's); ``used`` counts the ids handed out."""

    def __init__(self, num_blocks: int):
        self.total = num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def free(self) -> int:
        return len(self.free_ids)

    @property
    def used(self) -> int:
        return self.total - len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_ids):
            raise RuntimeError(f"allocate({n}) with {len(self.free_ids)} free blocks: the scheduler must check first")
        return [self.free_ids.popleft() for _ in range(n)]

    def release(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)


def slots_of(blocks: list[int], start: int, stop: int, block_size: int) -> torch.Tensor:
    """Flat slots of token indices ``start..stop-1`` of a request whose block table is ``blocks``."""
    idx = torch.arange(start, stop)
    table = torch.tensor(blocks, dtype=torch.long)
    return table[idx // block_size] * block_size + idx % block_size


class Reads:
    """A pool's attention for one chunk: dense over every slot it holds (the reference of every pool)."""

    paged_kernel = False

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def attend(self, layer: int, q: torch.Tensor, held: torch.Tensor, scale: float, decode_from: int) -> torch.Tensor:
        """``q [Hq, n, D]`` of a chunk whose ``n`` tokens are the last of ``held`` (flat slots, in token
        order) -> ``[Hq, n, D]``. ``decode_from``: the first row past the prompt (a dense read ignores it)."""
        keys, values = self.read(layer, held)
        return attend(q, keys, values, scale)


class DensePool(Reads):
    """K and V per layer as ``[slots, Hkv, D]`` in the model dtype."""

    paged_kernel = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device):
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.dtype = dtype

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        """``k``/``v`` ``[n, Hkv, D]`` into ``slots [n]`` (a dense pool keeps no key offset)."""
        self.k[layer, slots] = k.to(self.dtype)
        self.v[layer, slots] = v.to(self.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer, slots].transpose(0, 1), self.v[layer, slots].transpose(0, 1)


class FormatPool(Reads):
    """K and V per layer in a ``kvlab.kernels`` format: one ``KVStore`` of batch 1 whose token axis
    is the pool's slots; each token is quantized on its own (its scales are per token)."""

    def __init__(self, fmt, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, key_offset: str = "none"):
        self.fmt, self.dtype, self.head_dim = fmt, dtype, head_dim
        self.offset_rule = KEY_OFFSETS[key_offset]
        self.key_offsets: list[dict[int, torch.Tensor | None]] = [{} for _ in range(num_layers)]  # per owner
        slots = num_blocks * block_size
        self.k = [fmt.empty(1, kv_heads, slots, head_dim, device) for _ in range(num_layers)]
        self.v = [fmt.empty(1, kv_heads, slots, head_dim, device) for _ in range(num_layers)]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        keys = k.transpose(0, 1).unsqueeze(0).float()  # [1, Hkv, n, D]
        if first:
            self.key_offsets[layer][owner] = self.offset_rule.fit(keys)
        keys = shifted(keys, self.key_offsets[layer].get(owner))
        for store, x in ((self.k[layer], keys), (self.v[layer], v.transpose(0, 1).unsqueeze(0).float())):
            codes = self.fmt.quantize(x)
            for dst, src in zip(store.tensors(), codes.tensors(), strict=True):
                dst[:, :, slots] = src

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for store in (self.k[layer], self.v[layer]):
            picked = KVStore(self.fmt, *(t[:, :, slots] if t is not None else None
                                         for t in (store.codes, store.scale, store.zero)), self.head_dim)
            out.append(picked.dequantize(len(slots))[0].to(self.dtype))
        return out[0], out[1]


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [Hq, n, D]``, the last ``n`` of the ``m`` held rows being its own: causal over the held K/V
    ``[Hkv, m, D]`` (earlier held rows are all visible). -> ``[Hq, n, D]``."""
    n, m = q.shape[1], keys.shape[1]
    mask = None
    if n > 1:
        mask = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
    return F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                                          attn_mask=mask, scale=scale, enable_gqa=True)[0]
