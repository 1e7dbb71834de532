"""NVFP4-format K/V (method ``nvfp4``): E2M1 codes, an E4M3 scale per 16 values and a float32 second
level per token and KV head (:mod:`kvlab.kernels.nvfp4` states the choices), for both engines.

``hf`` runs the torch reference (dequantize, then attend). The fast store reads the codes with the
fused Triton kernel (:mod:`kvlab.kernels.nvfp4_triton`: NVFP4's bytes read, decoded in registers,
float32 math, as Hopper must) where the other Triton kernels run (CUDA; ``backend='triton'`` on CPU:
the interpreter), else the reference. Blackwell's tensor cores would do the E2M1 x E4M3-scale math
natively; no kernel here uses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.errors import PolicyError
from kvlab.kernels import nvfp4
from kvlab.storage.base import ModelShape
from kvlab.storage.codec import CodecStorage
from kvlab.storage.slots import uses_kernel


@dataclass(frozen=True)
class Nvfp4Codes:
    four_over_six: bool = False

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return nvfp4.quantize(x, self.four_over_six)

    def decode(self, codes, scales, second) -> torch.Tensor:
        return nvfp4.dequantize(codes, scales, second)

    def token_bytes(self, head_dim: int) -> int:
        return nvfp4.token_bytes(head_dim)


@dataclass(frozen=True)
class Nvfp4Storage(CodecStorage):
    """K and V in NVFP4 (4.5 bits per value plus 4 bytes per vector)."""

    name = "nvfp4"
    summary = "NVFP4 K/V: E2M1 codes, E4M3 scale per 16 values, float32 scale per token"
    bits = 4

    four_over_six: bool = field(default=False, metadata={
        "help": "per block, scale its amax to 4 or to 6, whichever reconstructs it better"})

    def __post_init__(self):
        if not isinstance(self.four_over_six, bool):
            raise PolicyError(f"four_over_six must be true or false, got {self.four_over_six!r}")

    @property
    def label(self) -> str:
        return "nvfp4 4/6" if self.four_over_six else "nvfp4"

    @property
    def kv_format(self) -> str:
        return self.label

    def codecs(self):
        codes = Nvfp4Codes(self.four_over_six)
        return codes, codes

    def fused_decode(self, backend: str, device):
        if not uses_kernel(backend, device):
            return None
        from kvlab.kernels.nvfp4_triton import fused_nvfp4_decode

        return fused_nvfp4_decode

    def check(self, shape: ModelShape, cuda: bool) -> None:
        super().check(shape, cuda)
        if shape.head_dim % nvfp4.BLOCK:
            raise PolicyError(f"nvfp4 scales blocks of {nvfp4.BLOCK} values and {shape.name}'s head_dim "
                              f"{shape.head_dim} is not a multiple of {nvfp4.BLOCK}: use kvq-fp8 or kvq-int4")
