"""Rotated codebook K/V, TurboQuant-style (method ``turboquant``): a seeded randomized Hadamard rotation
per KV head, then per-vector norms and Lloyd-Max codebooks on the rotated unit vector, in vLLM's four
presets (``variant``: k8v4, 4bit, k3v4, 3bit). Sources, every choice copied and every difference:
:mod:`kvlab.kernels.turboquant`.

Both engines run the torch reference. ``fast`` attends in the rotated basis (query rotated once per step,
the weighted sum of values rotated back once); ``hf`` hands transformers the decoded K/V rotated back.
The fast store reads the codes with the fused Triton kernel (:mod:`kvlab.kernels.turboquant_triton`)
where the KIVI and Quest kernels run (CUDA; ``backend='triton'`` on CPU: the interpreter), for the
codebook presets; k8v4's FP8 keys stay on the torch reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvlab.errors import PolicyError
from kvlab.kernels import turboquant as tq
from kvlab.storage.base import ModelShape, check_int
from kvlab.storage.codec import CodecStorage
from kvlab.storage.slots import uses_kernel


@dataclass(frozen=True)
class TurboQuantStorage(CodecStorage):
    """K/V rotated per KV head, then codes per coordinate (``variant``: key and value codes)."""

    name = "turboquant"
    summary = "TurboQuant-style K/V: randomized Hadamard per head, Lloyd-Max codebooks, per-token norms"

    variant: str = field(default="k3v4", metadata={"help": "k8v4 | 4bit | k3v4 | 3bit (vLLM's presets)"})
    seed: int = field(default=0, metadata={"help": "seed of the rotations' random signs"})

    def __post_init__(self):
        if self.variant not in tq.VARIANTS:
            raise PolicyError(f"variant={self.variant!r} is not a turboquant preset: use one of "
                              f"{', '.join(tq.VARIANTS)}")
        check_int("seed", self.seed, minimum=0)

    @property
    def bits(self) -> int:
        return tq.VARIANTS[self.variant][1].bits

    @property
    def label(self) -> str:
        return f"turboquant {self.variant}"

    @property
    def kv_format(self) -> str:
        return self.label

    def codecs(self):
        return tq.VARIANTS[self.variant]

    def rotation(self, kv_heads: int, head_dim: int, device) -> torch.Tensor:
        return tq.rotations(kv_heads, head_dim, self.seed).to(device)

    def fused_decode(self, backend: str, device):
        keys, values = self.codecs()
        if not uses_kernel(backend, device) or not isinstance(keys, tq.Codebook):
            return None
        from kvlab.kernels.turboquant_triton import fused_rotated_decode

        return functools.partial(fused_rotated_decode, key_book=keys, value_book=values)

    def check(self, shape: ModelShape, cuda: bool) -> None:
        super().check(shape, cuda)
        d = shape.head_dim
        if d & (d - 1) or d < 8:
            raise PolicyError(f"turboquant rotates by a Hadamard matrix, which needs a power-of-two head_dim "
                              f">= 8, and {shape.name}'s is {d}: use kvq-int4 or kivi")
