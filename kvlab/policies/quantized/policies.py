"""The whole-cache quantized methods: transformers' ``QuantizedCache`` (quanto, hqq, fp8) and
kvlab's own formats (kvq-fp8, kvq-int4, kvq-int2). Each builds a :class:`QuantSpec`
(:mod:`kvlab.policies.quantized.storage`), which does the work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvlab.kernels.key_offset import DEFAULT_KEY_OFFSET, KEY_OFFSETS
from kvlab.policies.base import Policy, model_shape
from kvlab.policies.quantized.key_outliers import warn_per_token_keys
from kvlab.policies.quantized.storage import FP8_MIN_TRANSFORMERS, QuantSpec


def quant_field(default, help_text):
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class QuantizedPolicy(Policy):
    """A whole-cache quantized policy (no eviction); subclasses say how to build the :class:`QuantSpec`."""

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "_spec", self._make_spec())

    def _make_spec(self) -> QuantSpec:
        raise NotImplementedError

    @property
    def spec(self) -> QuantSpec:
        return self._spec

    @property
    def bits(self) -> int:
        return self.spec.nbits

    @property
    def label(self) -> str:
        return self.chunk_label(self.spec.label)

    def engine_label(self, engine: str) -> str:
        return self.asked_as(self.chunk_label(self.spec.fast_label)) if engine == "fast" else self.label

    def params(self) -> dict[str, Any]:
        return {"method": self.name, **self.spec.params(), "keep": 1.0, "bits": self.bits, **self.chunk_params()}

    def check(self, model) -> None:
        self.spec.check(model_shape(model))
        if self.stores_keys_per_token():
            warn_per_token_keys(model, self.label)

    def stores_keys_per_token(self) -> bool:
        return self.spec.impl.per_token_keys(self.spec)

    def warmup(self, model) -> None:
        self.spec.warmup(model)

    def make_cache(self, model):
        return self.spec.make_cache(model)

    def storage(self):
        return self.spec.storage()


@dataclass(frozen=True)
class GroupwisePolicy(QuantizedPolicy):
    nbits: int = quant_field(4, "bits per stored element")
    q_group_size: int = quant_field(64, "elements sharing one scale/zero point")
    residual_length: int = quant_field(128, "recent tokens kept at full precision between flushes")
    axis_key: int = quant_field(0, "grouping axis for keys (0: along head_dim)")
    axis_value: int = quant_field(0, "grouping axis for values (0: along head_dim)")

    def _make_spec(self) -> QuantSpec:
        return QuantSpec(self.name, self.nbits, self.q_group_size, self.residual_length,
                         self.axis_key, self.axis_value)


@dataclass(frozen=True)
class QuantoPolicy(GroupwisePolicy):
    name = "quanto"
    summary = "optimum-quanto int4/int2 cache (transformers QuantizedCache, recent tokens kept in full precision)"


@dataclass(frozen=True)
class HQQPolicy(GroupwisePolicy):
    name = "hqq"
    summary = "HQQ int1-8 cache (transformers QuantizedCache; its optimizer runs at every flush)"


@dataclass(frozen=True)
class FP8Policy(QuantizedPolicy):
    name = "fp8"
    summary = f"per-tensor float8_e4m3 cache (transformers >= {FP8_MIN_TRANSFORMERS}), no residual buffer"

    def _make_spec(self) -> QuantSpec:
        return QuantSpec("fp8")


@dataclass(frozen=True)
class KVQPolicy(QuantizedPolicy):
    """A whole cache in one kvlab format (subclasses fix ``nbits``); on ``hf``: dequantize, then attend
    (:mod:`kvlab.storage.kvq`); on ``fast``: the fused kernels read the same codes."""

    nbits: ClassVar[int] = 4  # fixed per subclass, not a parameter
    key_offset: str = field(default=DEFAULT_KEY_OFFSET, metadata={
        "help": f"per-channel key offset subtracted before quantizing ({', '.join(KEY_OFFSETS)}; "
                "none: the per-token layout without it)"})

    def _make_spec(self) -> QuantSpec:
        return QuantSpec("kvq", type(self).nbits, getattr(self, "q_group_size", 64), key_offset=self.key_offset)


@dataclass(frozen=True)
class KVQFp8Policy(KVQPolicy):
    """float8_e4m3fn codes, ``scale = amax / 448`` per token and KV head, saturating.

    Unlike transformers' ``fp8`` (one scale per tensor, frozen at prefill) a loud later token gets
    its own scale.
    """

    name = "kvq-fp8"
    summary = ("kvlab fp8 e4m3, scale per token and KV head (fast: fused kernel; "
               "hf: dequantize, then attend)")
    nbits = 8


@dataclass(frozen=True)
class KVQIntPolicy(KVQPolicy):
    """Asymmetric ``nbits`` integers packed along the head dim; float16 scale and zero per
    ``q_group_size`` elements of each token's head dim, round to nearest. No residual window: every
    token is stored quantized from its first step.

    Per-token groups cannot isolate a key channel that is an outlier in every token (a store that
    quantizes keys per channel can): ``key_offset='prompt-mean'`` (the default) subtracts each key
    channel's prompt mean first, which attention does not see (:mod:`kvlab.kernels.key_offset`);
    ``key_offset='none'`` is the layout without it.
    """

    q_group_size: int = field(default=64, metadata={
        "help": "int formats: elements of head_dim sharing a scale and zero (32, 64 or 128)"})

    def __init_subclass__(cls, **kwargs):
        """A subclass sets ``nbits``; its name and summary follow (``kvq-int4``)."""
        super().__init_subclass__(**kwargs)
        cls.name = f"kvq-int{cls.nbits}"
        cls.summary = (f"kvlab int{cls.nbits}, scale+zero per q_group_size of head_dim, no residual "
                       "(fast: fused kernel; hf: dequantize, then attend)")


@dataclass(frozen=True)
class KVQInt4Policy(KVQIntPolicy):
    nbits = 4


@dataclass(frozen=True)
class KVQInt2Policy(KVQIntPolicy):
    nbits = 2
