"""KIVI's store behind a Hadamard rotation (method ``kivi-rot``): K and V rotated per KV head by a seeded
randomized Hadamard matrix (the rotations of ``turboquant`` and ``kvq-rot``), then stored in KIVI's
layout unchanged (keys per channel over token groups, values per token, a bf16 ring of recent tokens).

The rotation is exact for attention (:mod:`kvlab.storage.basis`); what it changes is the quantizer's
input: a value group's outlier coordinate is spread over the whole head, and a key channel's offset
(constant over tokens) becomes an offset on every channel, which KIVI's per-channel zero absorbs
either way. Both engines run what ``kivi`` runs, in the rotated basis: ``hf`` dequantizes and rotates
back; ``fast`` rotates the query once per step and the weighted sum of values back once, around KIVI's
own decode (the fused kernel on CUDA, the torch reference elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.errors import PolicyError
from kvlab.storage.base import ModelShape, check_int
from kvlab.storage.basis import RotatedBasis
from kvlab.storage.kivi import KiviStorage


@dataclass(frozen=True)
class RotatedKiviStorage(KiviStorage):
    """KIVI's knobs and the seed of the rotations' random signs."""

    name = "kivi-rot"
    summary = "KIVI-style 2/4-bit cache after a randomized Hadamard rotation per KV head"

    seed: int = field(default=0, metadata={"help": "seed of the rotations' random signs"})

    def __post_init__(self):
        super().__post_init__()
        check_int("seed", self.seed, minimum=0)

    @property
    def label(self) -> str:
        return super().label.replace("kivi", "kivi-rot", 1)

    @property
    def kv_format(self) -> str:
        return f"rot-{self.spec.label}"

    def basis(self, kv_heads: int, head_dim: int, device) -> RotatedBasis:
        return RotatedBasis.seeded(kv_heads, head_dim, self.seed, device)

    def check(self, shape: ModelShape, cuda: bool) -> None:
        d = shape.head_dim
        if d & (d - 1):
            raise PolicyError(f"kivi-rot rotates by a Hadamard matrix, which needs a power-of-two head_dim, "
                              f"and {shape.name}'s is {d}: use kivi")
        super().check(shape, cuda)
