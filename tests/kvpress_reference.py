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


def kvzip_scores(model, ids, n_sink=4, chunk_size=2048, prev_postfix_size=8, prompts=((), (), ())):
    """``KVzipPress`` scoring (0.5.5's kvzip_press.py: prepare, score_kvzip with kvzip_plus_normalization
    off, prefix_length 0): per layer ``[B, Hkv, n]``. ``prompts``: the (first, later, suffix) ids."""
    from transformers import DynamicCache
    from transformers.models.llama.modeling_llama import rotate_half

    from kvlab.engine.generation import cache_kwarg

    layers = model.model.layers
    n = ids.shape[1]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{cache_kwarg(model): cache})
    n_kv = model.config.num_key_value_heads
    scores = torch.zeros(len(layers), ids.shape[0], n_kv, n)
    first, later, suffix = (torch.tensor(list(p), dtype=ids.dtype).expand(ids.shape[0], -1) for p in prompts)
    chunks = [ids[:, i:i + chunk_size] for i in range(0, n, chunk_size)]
    start = 0
    for i, a_ids in enumerate(chunks):
        q_ids = first if i == 0 else torch.cat([later, chunks[i - 1][:, -prev_postfix_size:]], dim=1)
        repeat = torch.cat([q_ids, suffix, a_ids], dim=1)
        end = start + a_ids.shape[1]

        def hook(module, args, kwargs, output, start=start, end=end):
            hs = kwargs["hidden_states"]
            bsz, q_len, _ = hs.shape
            groups = module.config.num_attention_heads // n_kv
            d = module.head_dim
            q = prerope_queries(module, hs)
            cos, sin = kwargs["position_embeddings"]
            q = (q * cos.unsqueeze(1)) + (rotate_half(q) * sin.unsqueeze(1))
            q = q.view(bsz, n_kv, groups, q_len, d)
            keys = cache.layers[module.layer_idx].keys
            sink = min(n_sink, start)
            sub = torch.cat([keys[:, :, :sink], keys[:, :, start:end], keys[:, :, -q_len:]], dim=2)
            w = torch.matmul(q, sub.unsqueeze(2).transpose(-2, -1)) / math.sqrt(d)
            mask = torch.full((q_len, q_len), torch.finfo(w.dtype).min)
            cond = torch.arange(q_len)
            mask.masked_fill_(cond < (cond + 1).view(q_len, 1), 0)
            w[..., -q_len:, -q_len:] += mask
            w = F.softmax(w, dim=-1)[..., sink:sink + end - start]
            scores[module.layer_idx][..., start:end] = w.amax(dim=(-3, -2))

        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
        try:
            with torch.no_grad():
                model.model(input_ids=repeat, **{cache_kwarg(model.model): cache})
        finally:
            for h in hooks:
                h.remove()
        cache.crop(-repeat.shape[1])
        start = end
    scores[..., :n_sink] = scores.amax() + 1.0  # kvpress 0.5.5: sinks protected after scoring
    return scores
