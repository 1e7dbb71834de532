"""What every storage family shares: the :class:`Storage` protocol the engines call, the model's
shape as a storage sees it, the cache layers' length and stats contract, and the paged layout math.

A storage family (dense, kvq, kivi, quest, ragged, or a new one) is one module of
:mod:`kvlab.storage` holding every half of one way of keeping K/V: a transformers cache layer for
the ``hf`` engine, a store of static buffers (:class:`kvlab.storage.slots.SlotStore`) for the
``fast`` engine and, if it is served, a pool of blocks (:mod:`kvlab.storage.paged`) for the serving
engine, with its parameter check, its bytes per token, its stats and its paged layout.
A policy hands its storage to the engines (``Policy.storage()``); the engines call the protocol
below and never test a store's type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvlab.errors import PolicyError
from kvlab.models import LoadedModel, ModelSpec, spec_from_config


@dataclass(frozen=True)
class ModelShape:
    """What a policy needs to know about a model before any tensor exists: its spec (the numbers the byte
    budget reads too, so head dim and name have one rule) and each layer's attention kind."""

    spec: ModelSpec
    layer_types: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def non_full_layers(self) -> set[str]:
        return set(self.layer_types) - {"full_attention"}

    def check_full_attention(self, doing: str, fix: str = "use 'full' or a full-attention model") -> None:
        """Raise :class:`PolicyError` if the model has other layers than full attention; ``doing``
        (e.g. ``"kivi stores"``) names what takes full-attention layers only."""
        if self.non_full_layers:
            raise PolicyError(f"{doing} full-attention layers only, and {self.name} has "
                              f"{', '.join(sorted(self.non_full_layers))} layers: {fix}")


def hf_model(model):
    """The transformers model inside a kvlab ``LoadedModel``, or the model itself."""
    return model.model if isinstance(model, LoadedModel) else model


def on_cuda(model) -> bool:
    """Whether ``model`` (a loaded model; not a spec or config) holds its weights on a CUDA device."""
    params = getattr(hf_model(model), "parameters", None)
    if params is None:
        return False
    first = next(params(), None)
    return first is not None and first.device.type == "cuda"


def layer_types(config) -> list[str]:
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(config)[0])
    except Exception:  # private helper; its signature moved between releases
        sliding = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            sliding = None
        kind = "sliding_attention" if sliding else "full_attention"
        return list(getattr(config, "layer_types", None) or [kind] * config.num_hidden_layers)


def model_shape(model) -> ModelShape:
    """Shape of a transformers model, a ``LoadedModel``, a ``ModelSpec`` or a transformers config."""
    if isinstance(model, ModelSpec):
        kind = "sliding_attention" if model.sliding_window else "full_attention"
        return ModelShape(model, (kind,) * model.num_layers)
    spec = model.spec if isinstance(model, LoadedModel) else None
    model = hf_model(model)
    config = getattr(model, "config", model)
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return ModelShape(spec or spec_from_config(config), tuple(layer_types(config)))


def check_int(name: str, value: Any, minimum: int | None = None, choices: tuple | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PolicyError(f"{name} must be an integer, got {value!r}")
    if choices is not None and value not in choices:
        raise PolicyError(f"{name}={value} is not supported: use one of {', '.join(map(str, choices))}")
    if minimum is not None and value < minimum:
        raise PolicyError(f"{name} must be >= {minimum}, got {value}")
    return value


# -- the fast engine's side ------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreOptions:
    """What the fast engine fixes for every store it builds: the model's dtype, device, query heads and
    attention scale, and its kernel choices (``attention``: the dense kernel or ``triton``;
    ``quant_attention``: a quantized store's; ``flash_splits``: flash's split-KV count; ``backend``:
    the KIVI and Quest kernels', ``triton`` on CPU runs the interpreter)."""

    dtype: torch.dtype
    device: Any
    num_heads: int
    scale: float
    attention: str = "auto"
    quant_attention: str = "auto"
    flash_splits: int | None = None
    backend: str = "auto"  # the KIVI and Quest kernels': Triton on CUDA, the torch reference elsewhere


@dataclass(frozen=True)
class PagedLayout:
    """A storage's layout in fixed blocks of ``block_tokens`` tokens (a paged allocator's unit): one
    block holds that many tokens of one sequence in one layer, K and V of every KV head, in
    ``block_bytes`` bytes (scales and bounds included). ``sequence_bytes``: what one sequence holds in
    one layer outside its blocks, at most (a tail of exact tokens kept per request; 0 for most)."""

    block_tokens: int
    block_bytes: int
    sequence_bytes: int = 0

    def blocks(self, tokens: int) -> int:
        """Blocks one layer of one sequence needs to hold ``tokens`` tokens."""
        return -(-max(0, tokens) // self.block_tokens)

    def sequence_blocks(self, kept: list[int], new_tokens: int = 0) -> int:
        """Blocks of one sequence over every layer: ``kept[l]`` prompt tokens after the prefill's
        compression, plus ``new_tokens`` appended while decoding."""
        return sum(self.blocks(k + new_tokens) for k in kept)


def paged_layout(token_bytes: float, block_tokens: int) -> PagedLayout:
    """Blocks of ``block_tokens`` tokens at ``token_bytes`` bytes per token (rounded up to whole bytes)."""
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise PolicyError(f"block_tokens must be a whole number of tokens >= 1, got {block_tokens!r}")
    return PagedLayout(block_tokens, math.ceil(token_bytes * block_tokens))


def storage_bytes(storage, spec: ModelSpec, kept: list[int], new_tokens: int = 0, batch: int = 1) -> int:
    """The budget math of any storage: bytes of ``batch`` sequences holding ``kept[l]`` prompt tokens
    in layer ``l`` (after the prefill's compression) plus ``new_tokens`` appended while decoding."""
    per_token = storage.token_bytes(spec.num_kv_heads, spec.head_dim, element_size(spec))
    return batch * sum(math.ceil((k + new_tokens) * per_token) for k in kept)


def storage_blocks(storage, spec: ModelSpec, kept: list[int], new_tokens: int = 0, batch: int = 1,
                   block_tokens: int = 16) -> int:
    """Blocks of ``block_tokens`` tokens a paged allocator gives ``batch`` such sequences."""
    layout = storage.paged(spec.num_kv_heads, spec.head_dim, block_tokens, element_size(spec))
    return batch * layout.sequence_blocks(kept, new_tokens)


def element_size(spec: ModelSpec) -> int:
    """Bytes of one element at the model's dtype."""
    return torch.finfo(getattr(torch, spec.dtype)).bits // 8


class Storage(Protocol):
    """One way of keeping K/V, for both engines (a frozen dataclass of its parameters).

    ``prefill``: the policy whose transformers cache the prefill fills when the prompt is compressed
    before it is stored (an evicting policy); None when the prompt enters whole.
    ``kv_format``: the record's ``kv_format`` column on ``fast``."""

    prefill: Any

    def check(self, shape: ModelShape, cuda: bool) -> None:
        """Raise :class:`PolicyError` if this storage cannot hold ``shape``'s K/V (``cuda``: the model
        is on a CUDA device, where the kernels run)."""

    def make_cache(self, num_layers: int):
        """The ``hf`` half: a fresh transformers cache of this storage's layers (a storage with a
        ``prefill`` policy is held on ``hf`` by that policy's cache: eviction over a dense, kvq or
        head-padded layer)."""

    def token_bytes(self, kv_heads: int, head_dim: int, element_size: int = 2) -> float:
        """Bytes of one stored token in one layer (K and V, every KV head, scales included;
        ``element_size``: the model dtype's)."""

    def paged(self, kv_heads: int, head_dim: int, block_tokens: int = 16, element_size: int = 2) -> PagedLayout:
        """The layout in blocks of ``block_tokens`` tokens."""

    def paged_pool(self, shape, dtype: torch.dtype, device):
        """The serving half: a :class:`kvlab.storage.paged.PagedPool` of ``shape``
        (:class:`~kvlab.storage.paged.PoolShape`) blocks at the model ``dtype``; a family that is not
        served raises :class:`PolicyError` (:class:`~kvlab.storage.paged.PoolDefaults`)."""

    def block_size_problem(self, block_size: int) -> str | None:
        """Why this storage cannot be held in pool blocks of ``block_size`` tokens (None: it can)."""

    def store(self, layout, options: StoreOptions):
        """The ``fast`` half: static buffers for ``layout`` (a :class:`kvlab.storage.slots.SlotStore`)."""

    def prefill_cache(self, store, rows: slice | None, model):
        """The transformers cache a fast prefill fills (batch rows ``rows`` of ``store``)."""

    def load(self, store, cache, rows: slice | None = None) -> None:
        """Move a prefilled cache's kept K/V into ``store`` (rows ``rows``)."""

    def kept(self, cache) -> tuple[int, tuple[int, ...]]:
        """(batch, kept tokens per layer) of a prefilled cache: sizes a store that loads it."""


# -- the hf engine's side --------------------------------------------------------------------------
class StorageLayer:
    """A transformers cache layer kvlab made: it says what it holds (:func:`cache_stats` reads these)."""

    @property
    def physical_tokens(self) -> int:
        """Tokens stored per sequence and KV head."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of everything the layer stores (codes, scales, bounds, exact tokens)."""
        raise NotImplementedError


class StoredLengthMixin(StorageLayer):
    """A cache layer that holds every token it has seen, but not in ``DynamicLayer``'s ``keys``
    (codes, the fast engine's store): the sequence length and the mask follow ``stored_tokens``
    (spelled out: ``DynamicLayer``'s ``get_mask_sizes`` varies by release)."""

    stored_tokens: int

    def get_seq_length(self) -> int:
        return self.stored_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.stored_tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    @property
    def physical_tokens(self) -> int:
        return self.stored_tokens


def tensor_bytes(obj: Any, _seen: set | None = None) -> int:
    """Bytes held by tensors inside ``obj`` (tensors, quanto tensor subclasses, HQQ (W, meta), tuples,
    anything with ``tensors()``: kvlab ``KVStore`` s)."""
    seen = set() if _seen is None else _seen
    if callable(getattr(obj, "tensors", None)):  # kvlab formats: codes, scales, zeros
        return sum(tensor_bytes(t, seen) for t in obj.tensors())
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name), seen) for name in names)
        key = (obj.data_ptr(), obj.numel(), obj.dtype)
        if obj.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    return 0


def layer_stats(layer) -> tuple[int, int]:
    """(tokens stored per sequence and KV head, bytes) of one cache layer: a kvlab layer says so
    itself; transformers' quantized layers store every token (packed or residual); a plain layer
    holds its ``keys``."""
    if isinstance(layer, StorageLayer):
        return layer.physical_tokens, layer.nbytes()
    seen: set = set()
    nbytes = sum(tensor_bytes(getattr(layer, name, None), seen)
                 for name in ("keys", "values", "_quantized_keys", "_quantized_values"))
    if hasattr(layer, "_quantized_keys"):
        return layer.get_seq_length(), nbytes
    keys = getattr(layer, "keys", None)
    return (keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0), nbytes


def cache_stats(cache) -> dict[str, Any]:
    """Logical tokens (seen, per sequence), physical tokens (stored per sequence and KV head,
    averaged over layers) and bytes (all K/V storage incl. quantization scales) of a cache."""
    from transformers.cache_utils import CacheLayerMixin

    stats = [layer_stats(layer) for layer in cache.layers if isinstance(layer, CacheLayerMixin)]
    per_layer = [tokens for tokens, _ in stats]
    mean = sum(per_layer) / len(per_layer) if per_layer else 0
    return {
        "logical_tokens": int(cache.get_seq_length()),
        "physical_tokens": int(mean) if mean == int(mean) else round(mean, 2),
        "bytes": int(sum(nbytes for _, nbytes in stats)),
        "physical_tokens_per_layer": per_layer,
    }


def layer_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the stored K/V ``[B, Hkv, n_l, D]`` of an unquantized cache (dynamic or evicting):
    what the fast engine copies into its static buffers after the prefill."""
    out = []
    for i, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if (not isinstance(keys, torch.Tensor) or keys.dim() != 4 or hasattr(layer, "_quantized_keys")
                or keys.shape[-2] != layer_stats(layer)[0]):
            raise PolicyError(f"layer {i} ({type(layer).__name__}) holds no plain K/V tensors to copy")
        out.append((keys, values))
    return out
