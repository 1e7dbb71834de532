"""A registered attention function that hands a step's queries to the cache layer that asked for them.

Why: SnapKV, PyramidKV and TOVA score prompt tokens by the attention of the last ``window`` prompt
queries, but SDPA and flash kernels never return attention weights, and eager attention over a
32k prompt is O(n^2) memory. The wrapper registered here computes the layer output with the stock
kernel (bit-identical to it) and, only for a layer that asked for queries during its prefill
``update``, gives that layer the post-RoPE query tensor and the mask; the layer computes the
``window x n`` attention rows itself (:func:`window_attention`), never the ``n x n`` matrix.

A read the stock kernel cannot do uses the same hand-off: a cache layer with
``attends_own_queries`` set that asked for the queries of a step attends them itself
(``layer.attend``) instead of the stock kernel: a storage whose read is its own, such as Quest's
sparse read (:mod:`kvlab.storage.quest`) and KIVI's per-row read of a multi-token chunk
(:mod:`kvlab.storage.kivi`).

The hand-off is a per-thread slot keyed by layer index: the cache layer's ``update`` runs right
before the attention call of the same layer, so no reference from model to cache is needed; the
slot matches only the very key tensor the layer returned.

Chunked prefill (:func:`lower_right_chunks`): stock SDPA attends a chunk to its cache through a
4-D mask, and with a mask transformers repeats every K/V head per query head first (on
Llama-3.1-8B at 16k, 4x a layer's cache, 268 MB per sequence). While the flag is on, the wrapper
attends each multi-token chunk with torch's lower-right causal bias and ``enable_gqa`` instead (no
mask, no repeat; flash attention on CUDA) and the mask function builds no mask.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

PREFIX = "kvlab_"

_pending = threading.local()


def _slots() -> dict:
    slots = getattr(_pending, "slots", None)
    if slots is None:
        slots = _pending.slots = {}
    return slots


def expect_queries(layer_idx: int, layer) -> None:
    """Called by a cache layer in its prefill ``update``: the next attention call of this layer
    index whose keys are the ones the layer returned goes to ``layer.receive_queries``.

    Only a weak reference is kept, so an abandoned cache (an exception mid-forward) is freed, and
    the key identity check keeps a stale entry from ever reaching another model's forward.
    """
    _slots()[layer_idx] = weakref.ref(layer)


def cancel_queries(layer_idx: int) -> None:
    _slots().pop(layer_idx, None)


def _take_layer(layer_idx: int | None, key: torch.Tensor):
    slots = _slots()
    ref = slots.get(layer_idx)
    if ref is None:
        return None
    layer = ref()
    if layer is None:
        slots.pop(layer_idx, None)
        return None
    if not layer.awaits(key):
        return None
    slots.pop(layer_idx, None)
    return layer


def window_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    scaling: float | None,
    window: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention of the last ``window`` query rows over all keys, in float32.

    ``query`` is ``[B, Hq, q, D]`` (post-RoPE), ``keys`` ``[B, Hkv, n, D]`` with ``n >= q`` (the
    queries are the last ``q`` positions). Returns ``[B, Hq, w, n]``, ``w = min(window, q)``. Cost
    is O(w x n) per head: the GQA groups are folded into the query rows, so keys are never
    repeated. ``attention_mask`` may be the 4-D mask the model built (bool or additive float), a
    2-D padding mask, or None (causal).
    """
    bsz, n_heads, q_len, dim = query.shape
    n_kv, n = keys.shape[1], keys.shape[-2]
    groups = n_heads // n_kv
    w = max(1, min(window, q_len))
    scale = scaling if scaling is not None else dim**-0.5
    q = query[:, :, -w:, :].float().reshape(bsz, n_kv, groups * w, dim)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)).mul_(scale).view(bsz, n_heads, w, n)

    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        rows = attention_mask[..., -w:, -n:]
        if rows.dtype == torch.bool:
            logits.masked_fill_(~rows, float("-inf"))  # in place: logits is the largest transient here
        else:
            logits.add_(rows.float())
    else:
        first_row = n - w  # absolute key index visible to the first window row
        rows = torch.arange(w, device=keys.device)[:, None] + first_row
        future = torch.arange(n, device=keys.device)[None, :] > rows
        logits.masked_fill_(future, float("-inf"))
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            padding = attention_mask[:, -n:].to(torch.bool)[:, None, None, :]
            logits.masked_fill_(~padding, float("-inf"))
    return torch.softmax(logits, dim=-1)


def fit_mask(attention_mask, kv_length: int):
    """Resize a 4-D mask built for another layer's cache length to this layer's.

    transformers builds one mask per forward from layer 0's ``get_mask_sizes``; with per-layer
    budgets (PyramidKV) other layers hold a different number of kept tokens. Every kept token
    precedes every query, so the cached part is fully visible and only the last ``q`` columns
    (the new tokens, causal) are copied. Padding inside an evicted prompt is not represented:
    eviction assumes equal-length (unpadded) prompts.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return attention_mask
    if attention_mask.shape[-1] == kv_length:
        return attention_mask
    q_len = attention_mask.shape[-2]
    tail = attention_mask[..., -q_len:]
    if attention_mask.dtype == torch.bool:
        head = tail.new_ones(*tail.shape[:-1], kv_length - q_len)
    else:
        head = tail.new_zeros(*tail.shape[:-1], kv_length - q_len)
    return torch.cat([head, tail], dim=-1)


def _chunks_lower_right() -> bool:
    return getattr(_pending, "lower_right", 0) > 0


def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None):
    """A chunk of queries (the last ``q`` positions) over all ``n >= q`` keys, causal from the end,
    K/V heads as they are; output laid out as transformers' attention functions return it."""
    from torch.nn.attention.bias import causal_lower_right

    q_len, kv_len = query.shape[-2], key.shape[-2]
    groups = query.shape[1] // key.shape[1]
    if _repeat_heads(query, key, value):
        # no kernel attends grouped heads lower-right without a mask: repeat K/V (as stock SDPA does)
        # and let the memory-efficient kernel apply the lower-right mask without materializing it
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    bias = causal_lower_right(q_len, kv_len)
    try:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=bias, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    except TypeError:  # a torch whose causal bias takes no enable_gqa: repeated heads, still no mask
        groups = query.shape[1] // key.shape[1]  # 1 if already repeated above
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _repeat_heads(query, key, value) -> bool:
    """On CUDA, whether grouped K/V heads must be repeated: flash (the one kernel attending them
    lower-right as they are) cannot take these inputs. CPUs attend them as they are."""
    return query.shape[1] != key.shape[1] and query.is_cuda and not _flash_takes_gqa(query, key, value)


def _flash_takes_gqa(query, key, value) -> bool:
    try:
        params = torch.backends.cuda.SDPAParams(query, key, value, None, 0.0, True, True)
        return bool(torch.backends.cuda.can_use_flash_attention(params, False))
    except (AttributeError, TypeError, RuntimeError):  # an older torch: take the safe path
        return False


@contextmanager
def lower_right_chunks(model) -> Iterator[None]:
    """While unpadded prompt chunks go through ``model`` (SDPA attention): attend them with
    :func:`chunk_attention` and build no mask. Other attention implementations are left alone."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current not in ("sdpa", PREFIX + "sdpa"):
        yield
        return
    install(model)
    _pending.lower_right = getattr(_pending, "lower_right", 0) + 1
    try:
        yield
    finally:
        _pending.lower_right -= 1
        if current != model.config._attn_implementation:
            model.set_attn_implementation(current)


def _wrap(base: Callable) -> Callable:
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        scaling = kwargs.get("scaling", getattr(module, "scaling", None))
        layer = _take_layer(getattr(module, "layer_idx", None), key)
        if layer is not None and getattr(layer, "attends_own_queries", False):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return layer.attend(query, scale), None  # Quest's sparse read, KIVI's per-row chunk read
        if _chunks_lower_right() and query.shape[-2] > 1:
            output = chunk_attention(query, key, value, scaling)
        else:
            attention_mask = fit_mask(attention_mask, key.shape[-2])
            output = base(module, query, key, value, attention_mask, *args, **kwargs)
        if layer is not None:
            layer.receive_queries(query, attention_mask, scaling)
        return output

    attention.__doc__ = f"{getattr(base, '__name__', 'attention')} plus kvlab's prefill query hand-off."
    return attention


def _mask_wrap(base: Callable) -> Callable:
    def mask(*args, **kwargs):
        return None if _chunks_lower_right() else base(*args, **kwargs)

    mask.__doc__ = f"{getattr(base, '__name__', 'mask')}, or no mask while prompt chunks attend lower-right causal."
    return mask


def install(model) -> str:
    """Register ``kvlab_<base>`` for the model's current attention and switch the model to it.

    Idempotent. The base is the model's implementation when it is a registered kernel (sdpa,
    flash_attention_2, ...); eager attention (not in the registry) is replaced by SDPA, which
    computes the same output. Returns the implementation name now in use.
    """
    return install_wrapped(model, PREFIX, _wrap, _mask_wrap)


def install_wrapped(model, prefix: str, wrap, mask_wrap=None) -> str:
    """Register ``<prefix><base>``, ``wrap(attention of base)`` and ``mask_wrap(mask function of
    base)`` (None: the base's own), for the model's current attention ``base`` (eager: SDPA) and
    switch the model to it. Idempotent; returns the implementation name now in use."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    current = model.config._attn_implementation
    if current and current.startswith(prefix):
        return current
    base = current if current in ALL_ATTENTION_FUNCTIONS._global_mapping else "sdpa"
    name = prefix + base
    if name not in ALL_ATTENTION_FUNCTIONS._global_mapping:
        AttentionInterface.register(name, wrap(ALL_ATTENTION_FUNCTIONS[base]))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        mask_base = base if base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "sdpa"
        mask = ALL_MASK_ATTENTION_FUNCTIONS[mask_base]
        AttentionMaskInterface.register(name, mask_wrap(mask) if mask_wrap else mask)
    model.set_attn_implementation(name)
    return name
