"""kvq's integer formats behind a Hadamard rotation (method ``kvq-rot``): K and V rotated per KV head by a
seeded randomized Hadamard matrix, then stored in a kvlab format (``int4-g64``, ``int2-g32``, ...).

The rotation is exact for attention (queries and keys rotated by the same orthogonal matrix, values
rotated back after the weighted sum: :mod:`kvlab.storage.codec`); what it changes is the quantizer's
input. A group's outlier channel is spread over every coordinate, so the per-token groups' range
shrinks. It does not remove a per-channel offset (a bias-driven key channel spreads into a constant
on every coordinate).

``hf`` runs the torch reference of the format (dequantize, then attend). The fast store reads the codes
with kvq's own decode kernel (:func:`kvlab.kernels.decode_attention`) where the Triton kernels run
(CUDA; ``backend='triton'`` on CPU: the interpreter): the query is rotated once per step and the output
rotated back once (:func:`rotated_kvq_decode`); elsewhere, and for shapes the kernel does not read, the
reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvlab.errors import PolicyError
from kvlab.kernels import KVStore, decode_attention, parse_format
from kvlab.kernels import turboquant as tq
from kvlab.kernels.decode import kernel_supports
from kvlab.kernels.formats import FormatError
from kvlab.storage.base import ModelShape, check_int
from kvlab.storage.codec import CodecStorage
from kvlab.storage.slots import uses_kernel

FORMATS = ("int4-g32", "int4-g64", "int4-g128", "int2-g32", "int2-g64", "int2-g128", "fp8")


@dataclass(frozen=True)
class KVQCodes:
    """A kvlab format as a codec: its ``quantize`` tensors, its ``dequantize``."""

    format: str

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        store = parse_format(self.format).quantize(x.float().contiguous())
        return store.tensors()

    def store(self, *parts: torch.Tensor) -> KVStore:
        fmt = parse_format(self.format)
        codes, scale, zero = (*parts, None, None)[:3]
        return KVStore(fmt, codes, scale, zero, codes.shape[-1] * fmt.pack)

    def decode(self, *parts: torch.Tensor) -> torch.Tensor:
        return self.store(*parts).dequantize()

    def token_bytes(self, head_dim: int) -> int:
        return parse_format(self.format).bytes_per_token(1, head_dim)


@dataclass(frozen=True)
class RotatedKVQStorage(CodecStorage):
    """K/V rotated per KV head, then in kvq format ``format``."""

    name = "kvq-rot"
    summary = "kvq formats after a randomized Hadamard rotation per KV head"

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

    def fused_decode(self, backend: str, device):
        if not uses_kernel(backend, device):
            return None
        return functools.partial(rotated_kvq_decode, codes=KVQCodes(self.format))

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


def rotated_kvq_decode(q: torch.Tensor, key_parts, value_parts, used: torch.Tensor, rot: torch.Tensor,
                       scale: float, codes: KVQCodes) -> torch.Tensor:
    """kvq's decode kernel over rotated codes: ``q [B, Hq, 1, D]`` rotated once per KV head group, the
    kernel's attention over the first ``used`` slots, the output rotated back; float32 ``[B, Hq, D]``.
    A store the kernel cannot read (:func:`kvlab.kernels.decode.kernel_supports`) goes through the
    reference of the same call."""
    bsz, n_heads, _, d = q.shape
    k_store, v_store = codes.store(*key_parts), codes.store(*value_parts)
    n_kv = k_store.kv_heads
    groups = n_heads // n_kv
    qr = torch.matmul(q.float().reshape(bsz, n_kv, groups, d), rot).reshape(bsz, n_heads, d).to(q.dtype)
    lengths = used.to(torch.int32).expand(bsz).contiguous()
    backend = "reference" if kernel_supports(k_store) else "triton"
    out = decode_attention(qr.contiguous(), k_store, v_store, lengths, scale, backend=backend)
    back = torch.matmul(out.float().view(bsz, n_kv, groups, d), rot.transpose(-1, -2))
    return back.reshape(bsz, n_heads, d)
