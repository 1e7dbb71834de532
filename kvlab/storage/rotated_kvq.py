"""kvq's integer formats behind a Hadamard rotation (method ``kvq-rot``): K and V rotated per KV head by a
seeded randomized Hadamard matrix, then stored in a kvlab format (``int4-g64``, ``int2-g32``, ...).

The rotation is exact for attention (queries and keys rotated by the same orthogonal matrix, values
rotated back after the weighted sum: :mod:`kvlab.storage.codec`); what it changes is the quantizer's
input. A group's outlier channel is spread over every coordinate, so the per-token groups' range
shrinks. It does not remove a per-channel offset (a bias-driven key channel spreads into a constant
on every coordinate).

Both engines run the torch reference of the format (dequantize, then attend). The fused kvq kernels
would read the same codes with the query rotated once per step; that wiring is not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.errors import PolicyError
from kvlab.kernels import KVStore, parse_format
from kvlab.kernels import turboquant as tq
from kvlab.kernels.formats import FormatError
from kvlab.storage.base import ModelShape, check_int
from kvlab.storage.codec import CodecStorage

FORMATS = ("int4-g32", "int4-g64", "int4-g128", "int2-g32", "int2-g64", "int2-g128", "fp8")


@dataclass(frozen=True)
class KVQCodes:
    """A kvlab format as a codec: its ``quantize`` tensors, its ``dequantize``."""

    format: str

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        store = parse_format(self.format).quantize(x.float().contiguous())
        return store.tensors()

    def decode(self, *parts: torch.Tensor) -> torch.Tensor:
        fmt = parse_format(self.format)
        codes, scale, zero = (*parts, None, None)[:3]
        head_dim = codes.shape[-1] * fmt.pack
        return KVStore(fmt, codes, scale, zero, head_dim).dequantize()

    def token_bytes(self, head_dim: int) -> int:
        return parse_format(self.format).bytes_per_token(1, head_dim)


@dataclass(frozen=True)
class RotatedKVQStorage(CodecStorage):
    """K/V rotated per KV head, then in kvq format ``format``."""

    name = "kvq-rot"
    summary = "kvq formats after a randomized Hadamard rotation per KV head (torch reference)"

    format: str = field(default="int4-g64", metadata={"help": " | ".join(FORMATS)})
    seed: int = field(default=0, metadata={"help": "seed of the rotations' random signs"})

    def __post_init__(self):
        if self.format not in FORMATS:
            raise PolicyError(f"format={self.format!r} is not a kvq-rot format: use one of {', '.join(FORMATS)}")
        check_int("seed", self.seed, minimum=0)

    @property
    def bits(self) -> int:
        return parse_format(self.format).bits

    @property
    def label(self) -> str:
        return f"kvq-rot {self.format}"

    @property
    def kv_format(self) -> str:
        return self.label

    def codecs(self):
        codes = KVQCodes(self.format)
        return codes, codes

    def rotation(self, kv_heads: int, head_dim: int, device) -> torch.Tensor:
        return tq.rotations(kv_heads, head_dim, self.seed).to(device)

    def check(self, shape: ModelShape, cuda: bool) -> None:
        super().check(shape, cuda)
        d = shape.head_dim
        if d & (d - 1):
            raise PolicyError(f"kvq-rot rotates by a Hadamard matrix, which needs a power-of-two head_dim, "
                              f"and {shape.name}'s is {d}: use kvq-int4")
        try:
            parse_format(self.format).check_head_dim(d)
        except FormatError:
            fits = [f for f in FORMATS if f == "fp8" or d % int(f.split("-g")[1]) == 0]
            raise PolicyError(f"kvq-rot format={self.format!r} groups do not divide {shape.name}'s head_dim {d}: "
                              f"use one of {', '.join(fits)}") from None
