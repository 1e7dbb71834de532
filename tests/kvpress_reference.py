"""kvpress 0.5.4's scoring rules restated in plain torch, step for step as its presses compute them
(recomputing pre-RoPE queries from the hidden states with ``q_proj``), for the parity tests.

Each function takes the attention module, the hidden states entering it, and the layer's full
prompt K/V, like kvpress's ``ScorerPress.score``.
"""

import math

import torch
import torch.nn.functional as F


def prerope_queries(module, hidden_states):
    bsz, q_len, _ = hidden_states.shape
    q = module.q_proj(hidden_states)
    return q.view(bsz, q_len, -1, module.head_dim).transpose(1, 2)


def expected_attention(module, rotary, hidden_states, keys, values, n_future_positions=512, n_sink=4,
                       use_covariance=True, use_vnorm=True, epsilon=0.0):
    """``ExpectedAttentionPress.score`` (expected_attention_press.py, get_query_statistics,
    apply_avg_rope, score)."""
    q_len = hidden_states.shape[1]
    h = hidden_states[:, n_sink:]
    qs = prerope_queries(module, h)
    mu = qs.mean(dim=2, keepdim=True)
    cov = None
    if use_covariance:
        c = qs - mu
        cov = torch.einsum("bnsi,bnsj->bnij", c, c) / h.shape[1]
    mu = mu.squeeze(2)
    pos = torch.arange(q_len, q_len + n_future_positions).unsqueeze(0)
    d = module.head_dim
    cos, sin = rotary(mu, pos)
    cos, sin = cos[0], sin[0]
    eye = torch.eye(d, dtype=cos.dtype)
    perm = torch.zeros(d, d, dtype=cos.dtype)
    perm[d // 2:, : d // 2], perm[: d // 2, d // 2:] = torch.eye(d // 2), -torch.eye(d // 2)
    rbar = (cos.unsqueeze(1) * eye + sin.unsqueeze(1) * perm).mean(dim=0)
    mu = mu @ rbar.T
    if cov is not None:
        cov = rbar @ cov @ rbar.T

    keys, values = keys[:, :, n_sink:], values[:, :, n_sink:]
    bsz, n_kv, n, _ = keys.shape
    groups = module.config.num_attention_heads // n_kv
    k = keys.repeat_interleave(groups, dim=1).transpose(2, 3)
    scores = torch.matmul(mu.unsqueeze(2), k).squeeze(2) / math.sqrt(d)
    if use_covariance:
        scores = scores + torch.einsum("bhin,bhij,bhjn->bhn", k, cov, k) / d / 2
    scores = F.softmax(scores, dim=-1).view(bsz, n_kv, groups, n).mean(dim=2)
    if use_vnorm:
        scores = (scores + epsilon) * values.norm(dim=-1)
    return F.pad(scores, (n_sink, 0), value=scores.max().item() + 1)


def scorer_keep(scores, keep):
    """``ScorerPress.compress``: top ``int(n (1 - r))`` per KV head, r = 1 - keep; sorted positions."""
    n = scores.shape[-1]
    n_kept = int(n * (1 - (1 - keep)))
    return scores.topk(n_kept, dim=-1).indices.sort(dim=-1).values


def adakv_mask(scores, keep, alpha_safeguard=0.2):
    """``AdaKVPress.compress``: True where kept, ``[B, Hkv, n]``."""
    scores = scores.clone()
    bsz, heads, n = scores.shape
    n_kept = int(n * (1 - (1 - keep)))
    n_safe = int(n_kept * alpha_safeguard)
    top = torch.topk(scores, n_safe, dim=-1).indices
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    n_pruned = heads * (n - n_kept)
    idx = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices
    kept = torch.ones(bsz, heads * n, dtype=torch.bool)
    kept.scatter_(1, idx, False)
    return kept.view(bsz, heads, n)
