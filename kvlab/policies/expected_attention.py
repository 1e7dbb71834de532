"""Expected Attention: keep what future queries are expected to attend to (kvpress's default method).

Rule (kvpress ``ExpectedAttentionPress`` at 0.5.4, arXiv 2510.00636), per layer:

1. statistics of the prompt's queries *before RoPE*, first ``n_sink`` positions left out: mean
   ``mu`` and biased covariance ``cov`` per query head;
2. the RoPE rotation averaged over the next ``n_future_positions`` positions
   ``Rbar = mean_t R(t)``, ``t = n .. n + T - 1``; ``mu' = Rbar mu``, ``cov' = Rbar cov Rbar^T``;
3. over the non-sink keys ``k_j`` (post-RoPE, as cached): ``z_h(j) = mu'_h . k_j / sqrt(d) +
   k_j^T cov'_h k_j / (2 d)`` (the log of E[exp(q.k/sqrt d)] for Gaussian queries);
   ``a_h = softmax_j(z_h)``, averaged over each GQA group;
4. ``(a + epsilon) * ||v_j||`` when ``use_vnorm``; the sinks score above everything.

Where the queries come from: kvpress recomputes them from the layer's hidden states with
``q_proj``; kvlab's attention hand-off (:mod:`kvlab.storage.attention`) gives the layer its
post-RoPE queries, which are un-rotated here with the model's own ``rotary_emb`` (the inverse of
``q cos + rotate_half(q) sin`` is exact up to float rounding). A cleaner shared hook would hand
over the pre-RoPE queries (or the hidden states) directly.

Chunked prefill: the statistics accumulate over every chunk seen so far (sums of ``q`` and
``q q^T``), so a chunk of the whole prompt is exactly the one-shot rule; smaller chunks score the
kept rows + chunk with the statistics of all queries up to the chunk.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvlab.policies.base import PolicyError, check_int, hf_model
from kvlab.policies.eviction import EvictionPolicy
from kvlab.policies.mixed import mixed_cache


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def unrotate(query: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of transformers' ``q cos + rotate_half(q) sin`` (``cos``/``sin`` ``[q, D]``), float32."""
    q, c, s = query.float(), cos.float(), sin.float()
    return (q * c - rotate_half(q) * s) / (c * c + s * s)


def mean_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``Rbar = mean_t (cos_t I + sin_t P)`` with ``P x = rotate_half(x)``; ``cos``/``sin`` ``[T, D]``."""
    dim = cos.shape[-1]
    half = dim // 2
    eye = torch.eye(dim, dtype=cos.dtype, device=cos.device)
    perm = torch.zeros(dim, dim, dtype=cos.dtype, device=cos.device)
    perm[half:, :half] = torch.eye(half, dtype=cos.dtype, device=cos.device)
    perm[:half, half:] = -torch.eye(half, dtype=cos.dtype, device=cos.device)
    return (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * perm).mean(dim=0)


@dataclass
class QueryStats:
    """Running sums of the pre-RoPE queries of one layer: ``count``, ``sum`` ``[B, Hq, D]``,
    ``outer`` ``[B, Hq, D, D]`` (float64 sums, so chunked and one-shot statistics agree)."""

    count: int = 0
    sum: torch.Tensor | None = None
    outer: torch.Tensor | None = None

    def add(self, queries: torch.Tensor, covariance: bool) -> None:
        q = queries.double()
        s = q.sum(dim=2)
        o = torch.einsum("bhsi,bhsj->bhij", q, q) if covariance else None
        self.count += q.shape[2]
        self.sum = s if self.sum is None else self.sum + s
        if o is not None:
            self.outer = o if self.outer is None else self.outer + o

    def moments(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        mu = self.sum / self.count
        cov = None if self.outer is None else self.outer / self.count - mu.unsqueeze(-1) * mu.unsqueeze(-2)
        return mu.float(), None if cov is None else cov.float()


def expected_attention_scores(keys: torch.Tensor, values: torch.Tensor, mu: torch.Tensor, cov: torch.Tensor | None,
                              rbar: torch.Tensor, n_sink: int, use_vnorm: bool = True,
                              epsilon: float = 0.0) -> torch.Tensor:
    """The scoring rule in pure torch: ``keys``/``values`` ``[B, Hkv, n, D]`` (post-RoPE, all prompt
    positions), ``mu`` ``[B, Hq, D]`` and ``cov`` ``[B, Hq, D, D]`` (pre-RoPE query moments, sinks
    excluded), ``rbar`` ``[D, D]``. Returns ``[B, Hkv, n]``, sinks above everything."""
    bsz, n_kv, n, dim = keys.shape
    groups = mu.shape[1] // n_kv
    k = keys[:, :, n_sink:].float()
    mu_r = mu @ rbar.T  # [B, Hq, D]
    mu_r = mu_r.view(bsz, n_kv, groups, dim)
    z = torch.einsum("bhgd,bhnd->bhgn", mu_r, k) / math.sqrt(dim)
    if cov is not None:
        cov_r = (rbar @ cov @ rbar.T).view(bsz, n_kv, groups, dim, dim)
        z = z + torch.einsum("bhnd,bhgde,bhne->bhgn", k, cov_r, k) / dim / 2
    scores = torch.softmax(z, dim=-1).mean(dim=2)
    if use_vnorm:
        scores = (scores + epsilon) * values[:, :, n_sink:].float().norm(dim=-1)
    top = scores.amax(dim=(1, 2), keepdim=True) + 1 if scores.shape[-1] else scores.new_ones(bsz, 1, 1)
    return torch.cat([top.expand(bsz, n_kv, min(n_sink, n)), scores], dim=-1)


def _float_probe(like: torch.Tensor) -> torch.Tensor:
    """An empty float32 tensor on ``like``'s device: rotary embeddings read only its dtype and device."""
    return torch.empty(0, dtype=torch.float32, device=like.device)


class QueryStatsMixin:
    """An evicting layer that scores with the statistics of every prompt query it was handed
    (in front of :class:`~kvlab.policies.cache.EvictingLayer` or an evicting quantized layer)."""

    rotary = None  # the model's rotary embedding module (:func:`rotary_of`), set when the cache is made

    def receive_queries(self, query: torch.Tensor, attention_mask, scaling) -> None:
        keys, values, n_kept, positions = self._awaiting
        self._awaiting = None
        stats = self.query_stats
        end = self.logical_length  # the chunk holds prompt positions end - q .. end - 1
        start = end - query.shape[2]
        pos = torch.arange(start, end, device=query.device)
        cos, sin = self.rotary(_float_probe(query), pos.unsqueeze(0))
        pre = unrotate(query, cos[0], sin[0])
        skip = max(0, self.policy.n_sink - start)
        if skip < pre.shape[2]:
            stats.add(pre[:, :, skip:], self.policy.use_covariance)
        self._evict(keys, values, n_kept, self._evidence(end, query), positions)

    def _evidence(self, n: int, query: torch.Tensor):
        """What ``policy.score`` reads: ``(mu, cov, Rbar)`` for the next ``n_future_positions``."""
        if self.query_stats.count == 0:
            raise PolicyError(f"expected_attention needs more than n_sink={self.policy.n_sink} prompt tokens")
        mu, cov = self.query_stats.moments()
        fut = torch.arange(n, n + self.policy.n_future_positions, device=query.device).unsqueeze(0)
        cos, sin = self.rotary(_float_probe(query), fut)
        return mu, cov, mean_rotation(cos[0].float(), sin[0].float())

    def _clear_eviction(self) -> None:
        super()._clear_eviction()
        self.query_stats = QueryStats()


def rotary_of(model):
    """The model's shared rotary embedding (``model.model.rotary_emb`` for Llama-like models)."""
    inner = hf_model(model)
    base = getattr(inner, "model", inner)
    base = getattr(base, "language_model", base)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise PolicyError(f"expected_attention needs a RoPE model with a shared rotary_emb; "
                          f"{type(inner).__name__} has none")
    return rotary


@dataclass(frozen=True)
class ExpectedAttentionPolicy(EvictionPolicy):
    name = "expected_attention"
    summary = "attention expected from future queries (prompt query statistics, averaged RoPE), x ||v||"
    needs_attention = True

    n_future_positions: int = field(default=512, metadata={"help": "future positions whose RoPE is averaged"})
    n_sink: int = field(default=4, metadata={"help": "first positions always kept and left out of the statistics"})
    use_covariance: bool = field(default=True, metadata={"help": "add the query covariance term"})
    use_vnorm: bool = field(default=True, metadata={"help": "rescale by the value norm"})
    epsilon: float = field(default=0.0, metadata={"help": "added to the attention before the value-norm rescale"})

    def __post_init__(self):
        super().__post_init__()
        check_int("n_future_positions", self.n_future_positions, minimum=1)
        check_int("n_sink", self.n_sink, minimum=0)
        for name in ("use_covariance", "use_vnorm"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.epsilon, bool) or not isinstance(self.epsilon, (int, float)) or not \
                math.isfinite(self.epsilon) or self.epsilon < 0:
            raise PolicyError(f"epsilon must be a finite number >= 0, got {self.epsilon!r}")

    def score(self, keys, values, attn, layer_idx):
        mu, cov, rbar = attn
        return expected_attention_scores(keys, values, mu, cov, rbar, self.n_sink, self.use_vnorm, self.epsilon)

    def layer_mixins(self) -> tuple[type, ...]:
        return (QueryStatsMixin,)

    def make_cache(self, model):
        cache = mixed_cache(self, model, self.layer_mixins())
        for layer in cache.layers:
            layer.rotary = rotary_of(model)
        return cache
