"""How a quantized cache stores K/V: :class:`QuantSpec` (the knobs) and the backends it names.

The cache is built by kvlab for every generation (never through ``generate(cache_config=...)``:
transformers 5.17 pops ``backend`` out of a shared dict and silently falls back to quanto on the
next call). Backend, bit width and package presence are checked when the spec is made.

Each backend is an object in :data:`BACKENDS` (:class:`QuantBackend`: its checks, label, record
params, layer class and cache); :class:`QuantSpec` holds the knobs and asks its backend. A new
backend is one class and one registry entry; the CLI reads the names from the registry.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata
from typing import Any, ClassVar

from packaging.version import Version

from kvlab.kernels.formats import GROUPS, FormatError, format_label, parse_format
from kvlab.kernels.key_offset import DEFAULT_KEY_OFFSET, KEY_OFFSETS
from kvlab.policies.base import ModelShape, PolicyError, check_int, hf_model, model_shape
from kvlab.policies.cache import EvictingPerTensor, EvictionError, EvictionMixin, evicting_quantized_class
from kvlab.storage.kvq import KVQLayer, KVQStorage

FP8_MIN_TRANSFORMERS = "5.21"


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


class QuantBackend:
    """One way of storing K/V in transformers' ``QuantizedCache``: its checks, label, records and layers.

    A :class:`QuantSpec` holds the knobs; the backend named by ``spec.backend`` gives them meaning.
    """

    name: ClassVar[str]
    nbits: ClassVar[tuple[int, ...]]  # supported bit widths
    default_nbits: ClassVar[int]
    axes: ClassVar[tuple[int, ...]] = ()  # grouping axes it accepts for keys/values
    install: ClassVar[str]
    key_offsets: ClassVar[tuple[str, ...]] = ("none",)  # key offsets it can subtract (kernels.key_offset)
    default_key_offset: ClassVar[str] = "none"

    def check_installed(self) -> None:
        """Raise :class:`PolicyError` naming the install command when the backend cannot run here."""
        raise NotImplementedError

    def check_knobs(self, spec: QuantSpec) -> None:
        """Validate the knobs besides ``nbits`` (checked by :class:`QuantSpec`)."""
        raise NotImplementedError

    def label(self, spec: QuantSpec) -> str:
        raise NotImplementedError

    def params(self, spec: QuantSpec) -> dict[str, Any]:
        """What records keep about the storage."""
        raise NotImplementedError

    def check(self, spec: QuantSpec, shape: ModelShape) -> None:
        """Model-dependent checks (after the full-attention check every backend shares)."""

    def per_token_keys(self, spec: QuantSpec) -> bool:
        """Whether each token's keys share one range with no key offset (outlier key channels break it)."""
        return spec.axis_key == 0 and spec.key_offset == "none"

    def layer_class(self) -> type | None:
        raise NotImplementedError

    def layer_kwargs(self, spec: QuantSpec) -> dict[str, int]:
        """Fresh keyword arguments for one quantized layer (a new dict on every call)."""
        raise NotImplementedError

    def make_cache(self, spec: QuantSpec, model):
        from transformers import QuantizedCache

        return QuantizedCache(self.name, hf_model(model).config, **self.layer_kwargs(spec))

    def evicting_layer_class(self, spec: QuantSpec) -> type:
        """The layer class of evict-then-quantize: ``(policy, layer_idx, num_layers, **layer_kwargs)``."""
        return evicting_quantized_class(self.layer_class())

    def fast_format(self, spec: QuantSpec) -> str:
        """The :mod:`kvlab.kernels` format that stores the same thing on the fast engine."""
        raise PolicyError(f"the {self.name} backend has no store on the fast engine: use engine hf")


class GroupwiseBackend(QuantBackend):
    """Integer codes with a scale and zero point per ``q_group_size`` elements, recent tokens in full precision."""

    package: ClassVar[str]  # distribution that must be installed
    min_version: ClassVar[str]

    def check_installed(self) -> None:
        have = installed_version(self.package)
        if have is None or Version(have) < Version(self.min_version):
            found = f"version {have} is installed" if have else "it is not installed"
            raise PolicyError(f"the {self.name} backend needs {self.package} >= {self.min_version}, "
                              f"but {found}: {self.install}")

    def check_knobs(self, spec: QuantSpec) -> None:
        check_int("q_group_size", spec.q_group_size, minimum=1)
        check_int("residual_length", spec.residual_length, minimum=1)
        check_int("axis_key", spec.axis_key, choices=self.axes)
        check_int("axis_value", spec.axis_value, choices=self.axes)

    def label(self, spec: QuantSpec) -> str:
        return f"{self.name} int{spec.nbits}"

    def params(self, spec: QuantSpec) -> dict[str, Any]:
        return {"backend": self.name, "nbits": spec.nbits, "q_group_size": spec.q_group_size,
                "residual_length": spec.residual_length, "axis_key": spec.axis_key, "axis_value": spec.axis_value}

    def check(self, spec: QuantSpec, shape: ModelShape) -> None:
        if shape.head_dim % spec.q_group_size:
            raise PolicyError(f"q_group_size={spec.q_group_size} does not divide {shape.name}'s head_dim "
                              f"{shape.head_dim}: use a divisor such as {shape.head_dim}")

    def layer_kwargs(self, spec: QuantSpec) -> dict[str, int]:
        return {"nbits": spec.nbits, "axis_key": spec.axis_key, "axis_value": spec.axis_value,
                "q_group_size": spec.q_group_size, "residual_length": spec.residual_length}

    def fast_format(self, spec: QuantSpec) -> str:
        """Per-token groups along head_dim, round to nearest: the same arithmetic as quanto's axis 0
        (without its bf16 residual window of recent tokens)."""
        if (spec.axis_key, spec.axis_value) != (0, 0):
            raise PolicyError("the fast engine stores per-token groups along head_dim (axis 0): use "
                              "axis_key=0 and axis_value=0, or engine hf")
        return format_label(f"int{spec.nbits}", spec.q_group_size)


class QuantoBackend(GroupwiseBackend):
    name = "quanto"
    nbits = (2, 4)
    default_nbits = 4
    axes = (0, -1)
    package = "optimum-quanto"
    min_version = "0.2.5"
    install = "pip install 'optimum-quanto>=0.2.5'"

    def check_knobs(self, spec: QuantSpec) -> None:
        """Axis -1 (per channel) is refused: quanto groups along the flattened batch x heads x tokens
        and raises unless that product is a multiple of q_group_size (a 4-token warm-up, most prompts),
        and its groups then straddle heads."""
        super().check_knobs(spec)
        if -1 in (spec.axis_key, spec.axis_value):
            raise PolicyError("quanto's per-channel axis (-1) groups along batch x heads x tokens and fails unless "
                              "their product is a multiple of q_group_size: use axis 0, or a method that stores keys "
                              "per channel (kvlab policies lists them)")

    def layer_class(self) -> type:
        from transformers import cache_utils

        return cache_utils.QuantoQuantizedLayer


class HQQBackend(GroupwiseBackend):
    name = "hqq"
    nbits = (1, 2, 3, 4, 8)
    default_nbits = 4
    axes = (0, 1)
    package = "hqq"
    min_version = "0.2.1"
    install = "pip install 'hqq>=0.2.8'"

    def layer_class(self) -> type:
        from transformers import cache_utils

        return cache_utils.HQQQuantizedLayer

    def fast_format(self, spec: QuantSpec) -> str:
        raise PolicyError("hqq's optimized scales have no kernel on the fast engine: use engine hf for hqq, "
                          "or quanto (round to nearest, same storage) on fast")


class FP8Backend(QuantBackend):
    """transformers' per-tensor float8_e4m3 layers, made saturating (:func:`saturating_fp8_layer_class`)."""

    name = "fp8"
    nbits = (8,)
    default_nbits = 8
    install = f"pip install 'transformers>={FP8_MIN_TRANSFORMERS},<5.25'"

    def check_installed(self) -> None:
        have = installed_version("transformers") or "0"
        if Version(have) < Version(FP8_MIN_TRANSFORMERS):
            raise PolicyError(
                f"the fp8 KV cache needs transformers >= {FP8_MIN_TRANSFORMERS} (installed: {have}): "
                f"{self.install}, or use --backend quanto / hqq"
            )

    def check_knobs(self, spec: QuantSpec) -> None:
        if (spec.q_group_size, spec.residual_length, spec.axis_key, spec.axis_value) != (64, 128, 0, 0):
            raise PolicyError("the fp8 backend quantizes per tensor: q_group_size, residual_length and "
                              "axis_key/axis_value do not apply (leave them at their defaults)")

    def label(self, spec: QuantSpec) -> str:
        return self.name

    def params(self, spec: QuantSpec) -> dict[str, Any]:
        return {"backend": self.name, "nbits": 8}

    def layer_class(self) -> type | None:
        return saturating_fp8_layer_class()

    def fast_format(self, spec: QuantSpec) -> str:
        """float8_e4m3 codes, but a scale per token and KV head (transformers: one per tensor)."""
        return "fp8"

    def layer_kwargs(self, spec: QuantSpec) -> dict[str, int]:
        return {}

    def evicting_layer_class(self, spec: QuantSpec) -> type:
        return evicting_quantized_class(self.layer_class(), EvictingPerTensor)

    def make_cache(self, spec: QuantSpec, model):
        cache = super().make_cache(spec, model)
        cache.layers = [self.layer_class()() for _ in cache.layers]  # the same cache with saturating layers
        return cache


class KVQBackend(QuantBackend):
    """kvlab's own formats (:mod:`kvlab.kernels`): ``nbits`` 8 = float8_e4m3 with a scale per token
    and KV head; 4 / 2 = asymmetric integers with a scale and zero per ``q_group_size`` elements of
    the head dim (32, 64, 128). Every token is stored quantized (no residual window). On ``hf`` the
    layers dequantize the whole store before attention (:mod:`kvlab.storage.kvq`); on ``fast`` the
    same codes are read by the fused kernels."""

    name = "kvq"
    nbits = (2, 4, 8)
    default_nbits = 4
    install = "nothing to install (pure torch; Triton kernels on CUDA)"
    key_offsets = tuple(KEY_OFFSETS)
    default_key_offset = DEFAULT_KEY_OFFSET

    def check_installed(self) -> None:
        pass

    def check_knobs(self, spec: QuantSpec) -> None:
        if (spec.residual_length, spec.axis_key, spec.axis_value) != (128, 0, 0):
            raise PolicyError("the kvq backend stores every token quantized, grouped along head_dim: "
                              "residual_length and axis_key/axis_value do not apply (leave them at their defaults)")
        if spec.nbits == 8:
            if spec.q_group_size != 64:
                raise PolicyError("kvq fp8 has one scale per token and KV head: q_group_size does not apply "
                                  "(leave it at its default)")
            return
        check_int("q_group_size", spec.q_group_size, choices=GROUPS)

    def format_label(self, spec: QuantSpec) -> str:
        """The :mod:`kvlab.kernels` format of ``spec``: ``fp8`` or ``int{nbits}-g{q_group_size}``."""
        return format_label("fp8") if spec.nbits == 8 else format_label(f"int{spec.nbits}", spec.q_group_size)

    def label(self, spec: QuantSpec) -> str:
        return kvq_label(self.format_label(spec), spec.key_offset)

    def params(self, spec: QuantSpec) -> dict[str, Any]:
        """The storage's record params; ``key_offset`` only when one is subtracted, so the runs of the
        layout without it keep their ids."""
        offset = {} if spec.key_offset == "none" else {"key_offset": spec.key_offset}
        return {"backend": self.name, "nbits": spec.nbits,
                "q_group_size": None if spec.nbits == 8 else spec.q_group_size, **offset}

    def check(self, spec: QuantSpec, shape: ModelShape) -> None:
        try:
            parse_format(self.format_label(spec)).check_head_dim(shape.head_dim)
        except FormatError as err:
            raise PolicyError(f"kvq {self.format_label(spec)} cannot store {shape.name}: {err}") from None

    def layer_class(self) -> type:
        return KVQLayer

    def layer_kwargs(self, spec: QuantSpec) -> dict[str, Any]:
        return {"kv_format": self.format_label(spec), "key_offset": spec.key_offset}

    def make_cache(self, spec: QuantSpec, model):
        from transformers.cache_utils import Cache

        layer = self.layer_class()
        return Cache(layers=[layer(**self.layer_kwargs(spec)) for _ in range(model_shape(model).num_layers)])

    def evicting_layer_class(self, spec: QuantSpec) -> type:
        return EvictingKVQLayer

    def fast_format(self, spec: QuantSpec) -> str:
        """The same format (the key offset goes beside it, :meth:`QuantSpec.storage`): both engines
        hold the same codes."""
        return self.format_label(spec)


def kvq_label(fmt: str, key_offset: str) -> str:
    """A kvq store's label: ``kvq int4-g64``, plus the key offset it subtracts (``(keys - prompt-mean)``)."""
    return f"kvq {fmt}" if key_offset == "none" else f"kvq {fmt} (keys - {key_offset})"


class EvictingKVQLayer(EvictionMixin, KVQLayer):
    """Evict at prefill (``policy.budget(n)`` positions per KV head), store the kept K/V in
    ``kv_format``; later tokens are quantized and appended as in :class:`KVQLayer`."""

    def __init__(self, policy, layer_idx: int, num_layers: int, kv_format: str = "int4-g64",
                 key_offset: str = "none"):
        KVQLayer.__init__(self, kv_format, key_offset)
        self._init_eviction(policy, layer_idx, num_layers)

    def _store(self, keys, values) -> None:
        self.dtype = keys.dtype
        self.key_store = self.value_store = self.key_offset = None
        self._add(keys, values)

    def _append(self, keys, values, *args, **kwargs):
        self._add(keys, values)
        return self._dequantized()

    def crop(self, tokens_to_remove: int) -> None:
        appended = self.logical_length - (self.prompt_length or 0)
        if tokens_to_remove > 0 or -tokens_to_remove > appended:
            raise EvictionError(f"an evicting cache can only crop tokens added after its prefill "
                                f"(at most {appended}, passed as a negative number); got {tokens_to_remove}")
        KVQLayer.crop(self, tokens_to_remove)
        self.logical_length += tokens_to_remove
        self.physical_length += tokens_to_remove


BACKENDS: dict[str, QuantBackend] = {b.name: b for b in (QuantoBackend(), HQQBackend(), FP8Backend(), KVQBackend())}
DEFAULT_BACKEND = "quanto"


@dataclass(frozen=True)
class QuantSpec:
    """How K/V are stored: backend, bits and the residual-window knobs of transformers' QuantizedLayer.

    ``residual_length`` recent tokens stay at full precision until they are flushed;
    ``q_group_size`` elements share one scale and zero point; axis 0 groups along head_dim
    (per token), quanto's -1 / hqq's 0 along tokens (per channel). What each knob means, and
    whether it applies, is the backend's business (:data:`BACKENDS`).
    """

    backend: str = DEFAULT_BACKEND
    nbits: int | None = None
    q_group_size: int = 64
    residual_length: int = 128
    axis_key: int = 0
    axis_value: int = 0
    key_offset: str | None = None  # the backend's default (kvq: prompt-mean; others: none)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise PolicyError(f"unknown quantization backend {self.backend!r}: use one of {', '.join(BACKENDS)}")
        backend = BACKENDS[self.backend]
        if self.nbits is None:
            object.__setattr__(self, "nbits", backend.default_nbits)
        check_int("nbits", self.nbits)
        if self.nbits not in backend.nbits:
            raise PolicyError(f"nbits={self.nbits} is not supported by the {self.backend} backend: "
                              f"use one of {', '.join(map(str, backend.nbits))}")
        if self.key_offset is None:
            object.__setattr__(self, "key_offset", backend.default_key_offset)
        if self.key_offset not in backend.key_offsets:
            raise PolicyError(f"key_offset={self.key_offset!r} is not supported by the {self.backend} backend: "
                              f"use one of {', '.join(backend.key_offsets)}")
        backend.check_knobs(self)
        backend.check_installed()

    @classmethod
    def coerce(cls, value: QuantSpec | dict | None) -> QuantSpec | None:
        if value is None or isinstance(value, QuantSpec):
            return value
        if not isinstance(value, dict):
            raise PolicyError(f"quant must be a dict like {{'backend': 'quanto', 'nbits': 4}}, got {value!r}")
        try:
            return cls(**value)
        except TypeError:
            allowed = ", ".join(f.name for f in cls.__dataclass_fields__.values())
            raise PolicyError(f"bad quant keys {sorted(value)}; allowed: {allowed}") from None

    @property
    def impl(self) -> QuantBackend:
        return BACKENDS[self.backend]

    @property
    def label(self) -> str:
        return self.impl.label(self)

    def params(self) -> dict[str, Any]:
        return self.impl.params(self)

    def check(self, shape: ModelShape) -> None:
        if shape.non_full_layers:
            raise PolicyError(
                f"{shape.name} has {', '.join(sorted(shape.non_full_layers))} layers, and transformers' "
                f"QuantizedCache only supports full-attention models: use an eviction method or 'full' for this model"
            )
        self.impl.check(self, shape)

    def layer_class(self) -> type | None:
        return self.impl.layer_class()

    def layer_kwargs(self) -> dict[str, int]:
        """Fresh keyword arguments for one quantized layer (a new dict on every call)."""
        return self.impl.layer_kwargs(self)

    def fast_format(self) -> str:
        """This storage in the fast engine's terms (a :mod:`kvlab.kernels` format name)."""
        return self.impl.fast_format(self)

    def storage(self, prefill=None) -> KVQStorage:
        """The kvq storage holding what this spec holds (:meth:`fast_format`); ``prefill``: the evicting
        policy whose cache the prefill fills (None: the prompt whole); kvq's key offset goes with it."""
        return KVQStorage(self.fast_format(), prefill, self.key_offset)

    @property
    def fast_label(self) -> str:
        """The label of the store the fast engine runs for this storage: kvlab's own format
        (``kvq int4-g64``, ``kvq fp8``), whatever the backend's name (quanto's and transformers' fp8
        layers do not run there). A storage with no fast store (hqq) keeps its own label: the fast
        engine refuses it before any record names it."""
        try:
            return kvq_label(self.fast_format(), self.key_offset)
        except PolicyError:
            return self.label

    def evicting_layer_class(self) -> type:
        """The layer class that evicts at prefill, then stores the kept K/V this way."""
        return self.impl.evicting_layer_class(self)

    def make_cache(self, model):
        return self.impl.make_cache(self, model)

    def warmup(self, model) -> None:
        """Quantize and dequantize a tiny tensor on the model's device.

        quanto JIT-builds its C++/CUDA extension on the first (de)quantize, which takes minutes on a
        fresh GPU machine; doing it here keeps that out of timed regions. Cheap once built.
        """
        import torch

        model = hf_model(model)
        param = next(model.parameters())
        shape = model_shape(model)
        if self.backend == "quanto" and param.device.type == "cpu" and quanto_cpu_build_pending():
            import sys

            from tqdm import tqdm  # prints above a live progress bar

            tqdm.write("kvlab: optimum-quanto compiles its C++ extension for the CPU once per install (about "
                       "2.5 minutes on 2 busy cores); later runs load it", file=sys.stderr)
        layer = self.layer_class()(**self.layer_kwargs())
        x = torch.randn(1, 1, 4, shape.head_dim, device=param.device, dtype=param.dtype)
        layer.update(x, x)
        layer.update(x[:, :, :1], x[:, :, :1])
        if param.device.type == "cuda":
            torch.cuda.synchronize(param.device)


def quanto_cpu_build_pending() -> bool:
    """Whether quanto's first CPU (de)quantize will JIT-compile its C++ extension (a fresh install):
    its build folder inside site-packages has no ``pytorch_version.txt`` yet. False when unsure."""
    import os

    try:
        from optimum.quanto.library.extensions import get_extension

        build = get_extension("quanto_cpp").build_directory
    except Exception:  # noqa: BLE001 - a quanto without this layout: say nothing
        return False
    return not os.path.isfile(os.path.join(build, "pytorch_version.txt"))


@functools.cache
def saturating_fp8_layer_class() -> type | None:
    """transformers' ``Fp8QuantizedLayer`` with a saturating cast for the tokens after prefill.

    Why: the layer freezes its per-tensor scale on the prefill and casts later tokens with
    ``.to(float8_e4m3fn)``; a token whose keys exceed the prefill's amplitude then overflows.
    Out-of-range casts saturate to +-448 on the CPU (torch >= 2.12, pytorch#178817) but can give
    NaN on CUDA: on the H200 (torch 2.11) every SmolLM2 answer under fp8 came out empty
    with non-finite logits while the CPU answered. Clamping first makes both devices saturate.
    """
    from transformers import cache_utils

    base = getattr(cache_utils, "Fp8QuantizedLayer", None)
    if base is None:
        return None

    def _quantize(self, tensor, scale=None):
        if scale is None:  # calibrating on this tensor: nothing exceeds it
            return base._quantize(self, tensor)
        return (tensor.float() / scale).clamp_(-self.fp8_max, self.fp8_max).to(self.fp8_dtype), scale

    return type("SaturatingFp8QuantizedLayer", (base,), {
        "_quantize": _quantize, "__doc__": saturating_fp8_layer_class.__doc__})
