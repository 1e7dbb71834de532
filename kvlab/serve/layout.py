"""How many pool blocks a request holds under each method, and what one block weighs.

A block holds ``block_size`` token slots of every layer's K and V for every KV head (vLLM's layout:
one block id indexes the same slots in each layer's pool). A method changes two things only:
the bytes of a block (a quantized store's blocks are smaller, so the same pool holds more) and
the tokens a request keeps after its prefill (an evicting method keeps ``budget`` per KV head,
compacted into the first blocks, and frees the rest). A sparse read keeps every block.

Head-adaptive budgets (AdaKV) keep a different count per head; in this layout a block holds every
head, so a request needs the blocks of its *largest* head and the nominal saving frees nothing
unless heads are padded to the same count (they are, in the hf engine) or get their own tables.

The bytes come from the storage protocol (:func:`block_layout`: the policy's storage's ``paged``
layout, one layer's block, times the layers), so a new storage family's blocks weigh what that
family says, scales and bounds included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvlab.models import ModelSpec


@dataclass(frozen=True)
class BlockLayout:
    """A method's block accounting. ``store`` names what a block holds (the storage's ``kv_format``)."""

    method: str
    block_size: int
    bytes_per_block: int
    store: str
    keep: float = 1.0  # prompt fraction kept per KV head after the prefill (1.0: no eviction)
    window: int = 0  # last prompt queries whose attention scores the prompt (evicting methods)
    sequence_bytes: int = 0  # what a running request holds outside its blocks, at most (a bf16 tail)

    @property
    def evicts(self) -> bool:
        return self.keep < 1.0

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def resident_tokens(self, prompt_tokens: int) -> int:
        """Tokens a request stores once its prompt is in (after the eviction, if any)."""
        if not self.evicts:
            return prompt_tokens
        return min(prompt_tokens, max(1, math.floor(prompt_tokens * self.keep)))

    def prefill_blocks(self, prompt_tokens: int) -> int:
        """Blocks held while the prompt is prefilled: every prompt token, before any eviction."""
        return self.blocks_for(prompt_tokens)

    def peak_blocks(self, prompt_tokens: int, new_tokens: int) -> int:
        """The most blocks the request ever holds: its prefill, or its kept prompt plus its output."""
        return max(self.prefill_blocks(prompt_tokens),
                   self.blocks_for(self.resident_tokens(prompt_tokens) + new_tokens))

    def pool_blocks(self, pool_bytes: float) -> int:
        return int(pool_bytes // self.bytes_per_block)


def predicted_concurrency(layout: BlockLayout, pool_blocks: int, lengths: list[tuple[int, int]]) -> float:
    """The capacity model's peak concurrent requests: the pool over the blocks a mean request holds
    at its end (its kept prompt plus its output), capped by the number of requests."""
    if not lengths:
        return 0.0
    held = sum(layout.blocks_for(layout.resident_tokens(p) + o) for p, o in lengths) / len(lengths)
    return min(float(len(lengths)), pool_blocks / held)


def block_layout(storage, method: str, spec: ModelSpec, element_size: int, block_size: int) -> BlockLayout:
    """The serving block of ``storage`` (a policy's ``storage()``): its paged layout's block of one
    layer, over every layer; an evicting prefill policy (``storage.prefill``) gives the prompt
    fraction kept and the query window that scores it; ``sequence_bytes`` is the layout's, over every layer."""
    paged = storage.paged(spec.num_kv_heads, spec.head_dim, block_size, element_size)
    evicting = storage.prefill
    return BlockLayout(method, paged.block_tokens, spec.num_layers * paged.block_bytes, storage.kv_format,
                       keep=getattr(evicting, "keep", 1.0), window=getattr(evicting, "window_size", 0),
                       sequence_bytes=spec.num_layers * paged.sequence_bytes)
