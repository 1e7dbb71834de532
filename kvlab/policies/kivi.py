"""KIVI-style 2/4-bit cache (:mod:`kvlab.kernels.kivi`): keys per channel over groups of
``q_group_size`` tokens, values per token, the last ``residual_length`` tokens in bf16.

On ``hf`` a :class:`~kvlab.policies.kivi_layer.KiviLayer` per layer (dequantize, then attend); on
``fast`` the engine's KIVI store (the fused Triton kernel on CUDA, the torch reference on CPU)
holds the same codes. Liu et al. 2024, github.com/jy-yuan/KIVI.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.kernels import kivi
from kvlab.kernels.kivi_decode import kernel_problem
from kvlab.policies import attention
from kvlab.policies.base import Policy, PolicyError, check_int, hf_model, model_shape, on_cuda
from kvlab.policies.full import FullPolicy
from kvlab.policies.kivi_layer import kivi_cache

GROUPS = (16, 32, 64, 128)


@dataclass(frozen=True)
class KiviPolicy(Policy):
    name = "kivi"
    summary = ("KIVI-style 2/4-bit cache: keys per channel over token groups, values per token, a bf16 "
               "residual of recent tokens (fast: fused kernel; hf: dequantize, then attend)")

    nbits: int = field(default=2, metadata={"help": "bits per stored value (and key, unless key_bits): 2 or 4"})
    key_bits: int | None = field(default=None, metadata={
        "help": "bits per stored key, 2 or 4 (null: nbits); KIVI's K4V2 is key_bits 4, nbits 2"})
    q_group_size: int = field(default=32, metadata={
        "help": "tokens per key channel group G (16, 32, 64 or 128)"})
    residual_length: int = field(default=128, metadata={"help": "recent tokens kept in bf16 (R >= 0)"})
    value_group: int = field(default=32, metadata={
        "help": "head_dim elements per value scale and zero (16, 32, 64 or 128; must divide head_dim)"})

    def __post_init__(self):
        super().__post_init__()
        check_int("nbits", self.nbits, choices=(2, 4))
        if self.key_bits is not None:
            check_int("key_bits", self.key_bits, choices=(2, 4))
        check_int("q_group_size", self.q_group_size, choices=GROUPS)
        check_int("residual_length", self.residual_length, minimum=0)
        check_int("value_group", self.value_group, choices=GROUPS)

    @property
    def spec(self) -> kivi.KiviSpec:
        return kivi.KiviSpec(self.nbits, self.q_group_size, self.residual_length, self.value_group, self.key_bits)

    @property
    def bits(self) -> int:
        """Mean stored bits of K and V (3 for K4V2), codes only."""
        return (self.spec.k_bits + self.spec.v_bits) // 2

    @property
    def label(self) -> str:
        s = self.spec
        extra = "".join(f" {k}{v}" for k, v, default in (("g", s.group, 32), ("r", s.residual, 128),
                                                          ("vg", s.value_group, 32)) if v != default)
        return self.chunk_label(f"kivi k{s.k_bits}v{s.v_bits}{extra}")

    def check(self, model) -> None:
        shape = model_shape(model)
        shape.check_full_attention("kivi stores")
        if shape.head_dim % self.value_group:
            raise PolicyError(f"value_group={self.value_group} does not divide {shape.name}'s head_dim "
                              f"{shape.head_dim}: use one of {', '.join(str(g) for g in GROUPS if shape.head_dim % g == 0) or 'none'}")
        why = kernel_problem(self.spec, shape.head_dim)
        if why and on_cuda(model):
            raise PolicyError(f"kivi's CUDA kernel cannot read {shape.name}: {why}")

    def prepare(self, model) -> None:
        attention.install(hf_model(model))  # a multi-token chunk's queries reach the layer (per-row read)

    def make_cache(self, model):
        self.prepare(model)
        return kivi_cache(model_shape(model).num_layers, self.spec)

    def fast_storage(self):
        return FullPolicy(), self.spec
