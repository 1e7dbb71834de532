"""AdaKV: one budget per layer, spread over its KV heads by the scores of any scoring method.

Rule (kvpress ``AdaKVPress.compress`` at 0.5.4, arXiv 2407.11550): with the layer's budget
``n_kept`` per head on average, each head first keeps its top ``int(n_kept * alpha_safeguard)``
positions; of the rest, the ``Hkv * (n - n_kept)`` lowest scores of the whole layer are evicted, so
the layer keeps ``Hkv * n_kept`` positions in total and a head keeps what its scores earn. The
scores are the wrapped method's (``scorer``): snapkv, pyramidkv (its per-layer budgets too), tova,
knorm, expected_attention, kvzip. ``scope='model'`` (kvzip only, whose scores for every layer exist
before any layer evicts) spreads one budget over every layer and head: kvpress's ``KVzipPress()``
default; ``scope='layer'`` with kvzip and ``alpha_safeguard=0`` is its ``layerwise=True``.

Storage (:mod:`kvlab.policies.headwise`): on ``hf``, each head's kept positions padded to the
layer's longest head, the padding masked out of attention (exact); :func:`head_stats` gives the
logical kept tokens and the padded tokens/bytes. On ``fast`` (scope 'layer'), a ragged store
(:mod:`kvlab.storage.ragged`): a layer keeps exactly ``Hkv x budget`` rows per sequence, so
its buffer has a static size (graph-capturable) and only the per-(row, head) offsets and lengths,
device tensors filled after the prefill, change; nothing is allocated for padding. Scope 'model'
moves budget between layers after the prefill, which a fixed size per layer cannot hold: fast
refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from kvlab.policies.base import Policy, PolicyError, check_keep
from kvlab.policies.expected_attention import ExpectedAttentionPolicy, rotary_of
from kvlab.policies.headwise import HeadBudgetMixin, adakv_keep_mask, install_head_masks
from kvlab.policies.knorm import KnormPolicy
from kvlab.policies.kvzip import KVzipPolicy
from kvlab.policies.mixed import mixed_cache
from kvlab.policies.pyramidkv import PyramidKVPolicy
from kvlab.policies.snapkv import SnapKVPolicy
from kvlab.policies.tova import TOVAPolicy
from kvlab.storage.ragged import RaggedStorage

SCORERS = {cls.name: cls for cls in (SnapKVPolicy, PyramidKVPolicy, TOVAPolicy, KnormPolicy,
                                     ExpectedAttentionPolicy, KVzipPolicy)}


@dataclass(frozen=True)
class AdaKVPolicy(Policy):
    name = "adakv"
    summary = "head-adaptive budgets: one budget per layer spread over KV heads by a scorer's scores"

    keep: float = field(default=0.5, metadata={"help": "fraction of prompt positions kept per layer (mean over KV heads)"})
    scorer: str = field(default="snapkv", metadata={"help": f"scoring method: {', '.join(SCORERS)}"})
    alpha_safeguard: float = field(default=0.2, metadata={
        "help": "each head keeps at least this fraction of the layer's per-head budget"})
    scorer_params: dict | None = field(default=None, metadata={
        "help": "the scorer's own parameters, e.g. {'window_size': 32} (keep comes from adakv)"})
    scope: str = field(default="layer", metadata={
        "help": "'layer': one budget per layer over its heads; 'model' (kvzip only): one budget over every "
                "layer and head (kvpress's KVzip default)"})

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "keep", check_keep(self.keep))
        if self.scorer not in SCORERS:
            raise PolicyError(f"adakv scorer {self.scorer!r} is not supported: use one of {', '.join(SCORERS)}")
        a = self.alpha_safeguard
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise PolicyError(f"alpha_safeguard must be a number in [0, 1], got {a!r}")
        if self.scorer_params is not None and not isinstance(self.scorer_params, dict):
            raise PolicyError(f"scorer_params must be a mapping of the scorer's parameters, got {self.scorer_params!r}")
        params = dict(self.scorer_params or {})
        for banned in ("keep", "quant", "prefill_chunk"):
            if banned in params:
                raise PolicyError(f"scorer_params cannot set {banned}: adakv's own {banned} applies")
        allowed = {f["name"] for f in SCORERS[self.scorer].describe()} - {"keep", "quant", "prefill_chunk"}
        unknown = sorted(set(params) - allowed)
        if unknown:
            raise PolicyError(f"unknown scorer_params {', '.join(unknown)} for {self.scorer}; it takes: "
                              f"{', '.join(sorted(allowed)) or 'nothing'}")
        if self.scope not in ("layer", "model"):
            raise PolicyError(f"scope must be 'layer' or 'model', got {self.scope!r}")
        if self.scope == "model" and self.scorer != "kvzip":
            raise PolicyError("scope='model' needs every layer's scores before any layer evicts: only the kvzip "
                              "scorer has them (the others evict layer by layer during the prefill)")
        object.__setattr__(self, "_inner", SCORERS[self.scorer](keep=self.keep, **params))

    @property
    def inner(self) -> Policy:
        """The wrapped scoring policy (its budget per layer, its evidence, its score)."""
        return self._inner

    @property
    def label(self) -> str:
        scope = "" if self.scope == "layer" else ", model"
        return self.chunk_label(f"adakv({self.scorer}{scope}) {self.keep:.0%}")

    def check(self, model) -> None:
        self.inner.check(model)

    def prepare(self, model) -> None:
        self.inner.prepare(model)
        install_head_masks(model)

    def warmup(self, model) -> None:
        self.inner.warmup(model)

    def make_cache(self, model):
        self.prepare(model)
        mixins = (HeadBudgetMixin, *getattr(self.inner, "layer_mixins", tuple)())
        cache = mixed_cache(self.inner, model, mixins)
        select = partial(_select, alpha=self.alpha_safeguard)
        rotary = rotary_of(model) if self.scorer == "expected_attention" else None
        for layer in cache.layers:
            layer.select_heads = select
            layer.rotary = rotary
        if isinstance(self.inner, KVzipPolicy):
            self.inner.bind(cache)
            if self.scope == "model":
                cache.plan_heads = plan_model_budget
        cache.policy = self
        return cache

    def kept_tokens(self, n: int, num_layers: int) -> list[int]:
        return self.inner.kept_tokens(n, num_layers)

    def storage(self):
        """The ragged per-head store, filled from its own prefill (which selects per head), for scope 'layer'."""
        if self.scope == "model":
            raise PolicyError("adakv scope='model' moves budget between layers after the prefill, and the fast "
                              "engine's ragged store has a fixed size per layer: use scope='layer' (kvpress's "
                              "layerwise=True) on the fast engine, or engine hf for scope='model'")
        return RaggedStorage(prefill=self)


def _select(scores, n_kept, alpha):
    return adakv_keep_mask(scores, n_kept, alpha)


def plan_model_budget(layers) -> None:
    """kvpress ``KVzipPress.compress_post`` with ``layerwise=False``: per batch row, the lowest scores
    over every layer, KV head and position are evicted until ``sum over layers of Hkv x budget``
    remain; each layer then keeps its share (no safeguard)."""
    scores = torch.stack([layer.kvzip_scores for layer in layers])  # [L, B, Hkv, n]
    n_layers, bsz, heads, n = scores.shape
    kept_total = sum(heads * min(n, layer.policy.budget(n, layer.layer_idx, layer.num_layers)) for layer in layers)
    flat = scores.transpose(0, 1).reshape(bsz, -1)
    kept = torch.ones_like(flat, dtype=torch.bool)
    if flat.shape[1] > kept_total:
        kept.scatter_(1, (-flat).topk(flat.shape[1] - kept_total, dim=1).indices, False)
    kept = kept.view(bsz, n_layers, heads, n).transpose(0, 1)
    for layer, mask in zip(layers, kept, strict=True):
        layer.select_heads = partial(_planned, mask=mask)


def _planned(scores, n_kept, mask):
    return mask
