"""Evicting cache layers with a method's own behaviour mixed in front (query statistics, per-head
budgets, reconstruction scoring), over the plain or the evict-then-quantize layer class."""

from __future__ import annotations

from kvlab.policies.base import model_shape
from kvlab.policies.cache import EvictingLayer, EvictionCache

_CLASSES: dict[tuple, type] = {}


def mixed_class(mixins: tuple[type, ...], base: type) -> type:
    """``type(<Mixins><Base>, (*mixins, base))``, made once per combination."""
    key = (*mixins, base)
    if key not in _CLASSES:
        name = "".join(m.__name__.replace("Mixin", "") for m in mixins) + base.__name__
        _CLASSES[key] = type(name, (*mixins, base), {})
    return _CLASSES[key]


def mixed_cache(policy, model, mixins: tuple[type, ...]) -> EvictionCache:
    """An :class:`~kvlab.policies.cache.EvictionCache` whose layers put ``mixins`` in front of the
    evicting layer class ``policy`` would use (``policy.quant``: evict-then-quantize)."""
    policy.prepare(model)
    num_layers = model_shape(model).num_layers
    if policy.quant is None:
        base, kwargs = EvictingLayer, {}
    else:
        base, kwargs = policy.quant.evicting_layer_class(), policy.quant.layer_kwargs()
    cls = mixed_class(tuple(mixins), base)
    return EvictionCache([cls(policy, i, num_layers, **kwargs) for i in range(num_layers)], policy)
