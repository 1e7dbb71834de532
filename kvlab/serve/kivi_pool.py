"""KIVI over block tables: a block is one key group of ``q_group_size`` tokens, so its keys' per-channel
scale and zero sit beside the pool one per block (``k_scale``/``k_zero [layers, blocks, Hkv, D]``) and
its values' per-token scales one per slot; codes are per slot. The tokens not yet quantized (the last
``R <= . < R + G`` of a request, ``R`` = ``residual_length``) are the request's bf16 tail, kept beside
the pool per request (KIVI's residual window: a fixed extra per sequence, not in the blocks' bytes).

The boundary is :class:`kvlab.kernels.kivi.KiviSpec`'s pure function of the length, as in the static
engines: after a write of ``n`` tokens the first ``quantized_tokens(stored)`` are codes. Reads follow
:class:`kvlab.storage.kivi.KiviLayer`: a prompt row sees the tokens quantized before its chunk
dequantized and the rest exact (a prompt in one chunk: all exact, as the static prefill), a decode row
at position ``p`` the first ``quantized_tokens(p + 1)`` dequantized and the rest exact; a re-fed run
after a preemption is read row by row that way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.kernels import kivi
from kvlab.serve.pool import Reads

RESIDUAL = kivi.RESIDUAL_DTYPE


@dataclass
class Tail:
    """A request's tokens not yet quantized: their slots and exact (bf16) K/V ``[n, Hkv, D]``."""

    quantized: int
    slots: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class KiviPool(Reads):
    def __init__(self, spec: kivi.KiviSpec, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device):
        spec.check_head_dim(head_dim)
        self.spec, self.block_size, self.dtype, self.device = spec, block_size, dtype, device
        slots = num_blocks * block_size

        def zeros(*shape, dtype=kivi.SCALE_DTYPE):
            return torch.zeros(num_layers, *shape, dtype=dtype, device=device)

        self.k_codes = zeros(slots, kv_heads, head_dim * spec.k_bits // 8, dtype=torch.uint8)
        self.k_scale, self.k_zero = zeros(num_blocks, kv_heads, head_dim), zeros(num_blocks, kv_heads, head_dim)
        self.v_codes = zeros(slots, kv_heads, head_dim * spec.v_bits // 8, dtype=torch.uint8)
        groups = head_dim // spec.value_group
        self.v_scale, self.v_zero = zeros(slots, kv_heads, groups), zeros(slots, kv_heads, groups)
        self.tails: list[dict[int, Tail]] = [{} for _ in range(num_layers)]  # per layer: owner -> its tail
        self.chunks: list[dict[int, tuple]] = [{} for _ in range(num_layers)]  # owner -> its last write's rows

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, owner: int = 0,
              first: bool = False) -> None:
        slots = slots.to(self.device)
        if first or owner not in self.tails[layer]:
            empty = k.new_zeros((0, *k.shape[1:]), dtype=RESIDUAL)
            self.tails[layer][owner] = Tail(0, slots[:0], empty, empty)
        tail = self.tails[layer][owner]
        ks, vs = torch.cat([tail.k, k.to(RESIDUAL)]), torch.cat([tail.v, v.to(RESIDUAL)])
        held = torch.cat([tail.slots, slots])
        nq = self.spec.quantized_tokens(tail.quantized + len(ks))
        flush = nq - tail.quantized
        if flush:
            self.quantize(layer, held[:flush], ks[:flush], vs[:flush])
        self.tails[layer][owner] = Tail(nq, held[flush:], ks[flush:], vs[flush:])
        # what the chunk's rows read exact: a first write (the prefill) in its own precision, as the
        # static prefill attends; later tokens as the bf16 tail holds them
        exact_k = k.float() if first else ks.float()
        exact_v = v.float() if first else vs.float()
        self.chunks[layer][owner] = (tail.quantized, exact_k, exact_v)

    def quantize(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Whole key groups (``slots`` start at a block's first slot) into codes and scales."""
        kc, ks, kz = kivi.quantize_keys(self.spec, k.transpose(0, 1)[None])
        vc, vs, vz = kivi.quantize_values(self.spec, v.transpose(0, 1)[None])
        blocks = slots[::self.spec.group] // self.block_size
        self.k_codes[layer, slots] = kc[0].transpose(0, 1)
        self.k_scale[layer, blocks], self.k_zero[layer, blocks] = ks[0].transpose(0, 1), kz[0].transpose(0, 1)
        self.v_codes[layer, slots] = vc[0].transpose(0, 1)
        self.v_scale[layer, slots], self.v_zero[layer, slots] = vs[0].transpose(0, 1), vz[0].transpose(0, 1)

    def dequantized(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of quantized tokens at ``slots`` (whole groups, token order), float32 ``[Hkv, n, D]``."""
        blocks = slots[::self.spec.group] // self.block_size
        keys = kivi.dequantize_keys(self.spec, self.k_codes[layer, slots].transpose(0, 1)[None],
                                    self.k_scale[layer, blocks].transpose(0, 1)[None],
                                    self.k_zero[layer, blocks].transpose(0, 1)[None])
        values = kivi.dequantize_values(self.spec, self.v_codes[layer, slots].transpose(0, 1)[None],
                                        self.v_scale[layer, slots].transpose(0, 1)[None],
                                        self.v_zero[layer, slots].transpose(0, 1)[None])
        return keys[0], values[0]

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's K/V as stored (``slots``: its held slots from token 0): codes dequantized, tail exact."""
        slots = slots.to(self.device)
        tail = self.tails[layer][int(slots[0]) // self.block_size]
        keys, values = self.dequantized(layer, slots[:tail.quantized])
        return (torch.cat([keys, tail.k.transpose(0, 1).float()], 1).to(self.dtype),
                torch.cat([values, tail.v.transpose(0, 1).float()], 1).to(self.dtype))

    def attend(self, layer: int, q: torch.Tensor, held: torch.Tensor, scale: float, decode_from: int) -> torch.Tensor:
        held = held.to(self.device)
        owner = int(held[0]) // self.block_size
        start, exact_k, exact_v = self.chunks[layer].pop(owner)  # the chunk this step wrote (then attends)
        q_heads, n, d = q.shape
        m = len(held)
        nq = self.tails[layer][owner].quantized
        keys, values = self.dequantized(layer, held[:nq])  # [Hkv, nq, D]
        kv_heads = keys.shape[0]
        pos = torch.arange(m - n, m, device=q.device).view(n, 1)  # each row's position
        seen = torch.tensor([start if i < decode_from else self.spec.quantized_tokens(m - n + i + 1)
                             for i in range(n)], device=q.device).view(n, 1)  # tokens it reads dequantized
        t_exact = torch.arange(start, m, device=q.device).view(1, m - start)
        visible = torch.cat([torch.arange(nq, device=q.device).view(1, nq) < seen,
                             (t_exact >= seen) & (t_exact <= pos)], dim=1)  # [n, nq + m - start]
        k = torch.cat([keys, exact_k.transpose(0, 1)], 1)
        v = torch.cat([values, exact_v.transpose(0, 1)], 1)
        qf = q.float().view(kv_heads, q_heads // kv_heads, n, d)
        logits = torch.einsum("hgnd,htd->hgnt", qf, k) * scale
        probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        return torch.einsum("hgnt,htd->hgnd", probs, v).reshape(q_heads, n, d).to(q.dtype)


def tail_bytes(spec: kivi.KiviSpec, num_layers: int, kv_heads: int, head_dim: int) -> int:
    """The most a request's bf16 tails hold over every layer: ``R + G - 1`` tokens of K and V."""
    return num_layers * 2 * kv_heads * head_dim * RESIDUAL.itemsize * (spec.window - 1)
