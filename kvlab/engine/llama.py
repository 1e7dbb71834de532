"""One decode step of a Llama-family model, read from the loaded transformers model's own modules.

Why the model's own modules: the fast step must compute what transformers computes (CPU tests
compare tokens one for one) with the weights the user loaded, so it calls the model's embedding,
norms, projections, MLP, rotary embedding and LM head directly and replaces only what sits between
the projections and ``o_proj``: the cache update and attention, which go to a static KV store
(:mod:`kvlab.storage`). No weight is copied: q/k/v and gate/up become views into one
fused tensor each (one GEMM instead of three and two), so memory is the model's.

Supported: decoder-only models whose layers are Llama's (``input_layernorm`` -> attention with
``q/k/v/o_proj`` and rotary embeddings -> ``post_attention_layernorm`` -> MLP) with full attention
in every layer: Llama (incl. SmolLM2), Mistral, Qwen2 (without sliding window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.engine import EngineError, check_model_type
from kvlab.models import head_dim_of


def check_model(model) -> None:
    """:func:`check_model_type`, plus the loaded config's sliding windows and layer types."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    check_model_type(kind)
    sliding = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if kind == "mistral" and sliding and sliding < getattr(config, "max_position_embeddings", 0):
        raise EngineError(f"the fast engine attends over every cached token, and this {kind} model uses a "
                          f"{sliding}-token sliding window: use --engine hf")
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if types != {"full_attention"}:
        raise EngineError(f"the fast engine supports full-attention layers only, this model has "
                          f"{', '.join(sorted(types))}: use --engine hf")


def _fuse_linears(linears: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) over several ``nn.Linear`` s that read the same input, sharing storage.

    The concatenated tensor replaces the modules' own weights, which become views into it: the
    model computes exactly what it did, no byte is duplicated once the old tensors are freed, and
    the fast step runs one GEMM where transformers runs three (q, k, v) or two (gate, up).
    Idempotent: a second call returns the tensors of the first.
    """
    cached = getattr(linears[0], "_kvlab_fused", None)
    if cached is not None and cached[2] == len(linears):
        return cached[0], cached[1]
    fused_w, fused_b = _concat_into_views(linears, "weight"), _concat_into_views(linears, "bias")
    linears[0]._kvlab_fused = (fused_w, fused_b, len(linears))
    return fused_w, fused_b


def _concat_into_views(linears: list, attr: str) -> torch.Tensor | None:
    """Concatenate ``attr`` (weight or bias) of ``linears`` and make each module's a view into it."""
    parts = [getattr(lin, attr) for lin in linears]
    if parts[0] is None:
        return None
    fused = torch.cat([p.detach() for p in parts])
    offset = 0
    for lin, part in zip(linears, parts, strict=True):
        n = part.shape[0]
        setattr(lin, attr, torch.nn.Parameter(fused[offset:offset + n], requires_grad=False))
        offset += n
    return fused


def rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama RMSNorm (normalize in float32, cast back, then scale) in 3 kernels."""
    return _rms(x, norm.weight, norm_eps(norm))


def norm_eps(norm) -> float:
    return getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def step_inputs(embed, rotary, token: torch.Tensor, position: torch.Tensor):
    """The model's embedding and rotary tables for one step: ``hidden [B, 1, H]``, ``cos``/``sin``
    ``[B, 1, 1, D]``. A function of the model's own modules, so that compiled with the layers it is
    one or two kernels instead of the rotary module's ~8 eager ones (casts, cat, cos, sin, scales)."""
    hidden = embed(token)
    cos, sin = rotary(hidden, position)
    return hidden, cos.unsqueeze(1), sin.unsqueeze(1)


def argmax_chunks(vocab: int) -> int:
    """How many equal chunks :func:`greedy_tokens` splits a vocabulary row into: the largest divisor
    of ``vocab`` up to 256 that leaves at least 64 entries per chunk (1: a plain argmax)."""
    return max(d for d in range(1, 257) if vocab % d == 0 and vocab // d >= 64) if vocab >= 64 else 1


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy tokens of ``logits [B, V]`` as ``[B, 1]``: exactly ``logits.argmax(-1, keepdim=True)``
    (the first maximal index on ties), in two stages.

    Why: torch's argmax over a row of 128,256 logits runs one thread block per row, 36 µs of a 5.65 ms
    step on the H200 at batch 1 and 16 alike (the minimal step's measurement, reports/), and
    inductor does not split arg-reductions. Each chunk's first maximum (``max`` returns the first
    index on ties), then the first chunk holding the row's maximum, give the row's first maximum:
    the same token, from ``B x chunks`` parallel reductions. The logits stay in the model dtype."""
    bsz, vocab = logits.shape
    chunks = argmax_chunks(vocab)
    if chunks == 1:
        return logits.argmax(dim=-1, keepdim=True)
    width = vocab // chunks
    best, where = logits.view(bsz, chunks, width).max(dim=-1)  # [B, chunks] each: first maximum per chunk
    chunk = best.argmax(dim=-1, keepdim=True)  # [B, 1]: the first chunk holding the row's maximum
    return chunk * width + where.gather(-1, chunk)


def record_token(logits: torch.Tensor, token: torch.Tensor, position: torch.Tensor, outputs: torch.Tensor,
                 column: torch.Tensor) -> None:
    """A decode step's bookkeeping after the model, on the device: the greedy token becomes the next
    step's input ``token [B, 1]`` and column ``column [1]`` of ``outputs [B, n]``; ``position [B, 1]``
    advances. One function so that compiled with the layers its writes fuse into the argmax's last
    kernel instead of a kernel each."""
    nxt = greedy_tokens(logits)
    outputs.index_copy_(1, column, nxt)
    token.copy_(nxt)
    position.add_(1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attention_inputs(hidden, norm_w, eps: float, qkv_w, qkv_b, cos, sin, heads: tuple[int, int, int]):
    """Norm, fused q/k/v projection and RoPE of one layer: ``q [B, Hq, 1, D]``, ``k``/``v [B, Hkv, 1, D]``.

    Pure (tensors in, tensors out), so the same function runs eagerly (CPU, the reference) or
    compiled once for every layer (their shapes are equal; the weights are arguments).
    """
    n_heads, n_kv, dim = heads
    bsz = hidden.shape[0]
    qkv = F.linear(_rms(hidden, norm_w, eps), qkv_w, qkv_b)
    q, k, v = qkv.split((n_heads * dim, n_kv * dim, n_kv * dim), dim=-1)
    q = q.view(bsz, 1, n_heads, dim).transpose(1, 2)
    k = k.view(bsz, 1, n_kv, dim).transpose(1, 2)
    v = v.view(bsz, 1, n_kv, dim).transpose(1, 2)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


def layer_output(hidden, attn, o_w, o_b, norm_w, eps: float, gu_w, gu_b, down_w, down_b, act):
    """``o_proj``, residual, norm, fused gate/up, activation, ``down_proj``, residual: the rest of a layer."""
    bsz = hidden.shape[0]
    hidden = hidden + F.linear(attn.reshape(bsz, 1, -1), o_w, o_b)
    gate, up = F.linear(_rms(hidden, norm_w, eps), gu_w, gu_b).chunk(2, -1)
    return hidden + F.linear(act(gate) * up, down_w, down_b)


STEP_COMPILE = ("none", "layers", "reduce-overhead")


class LlamaFamilyStep:
    """``step(token [B, 1], position [B, 1], kv) -> logits [B, V]``: one token through every layer.

    ``kv.begin()`` runs once per step; ``kv.attend(layer, q, k, v)`` (q ``[B, Hq, 1, D]``, k/v
    ``[B, Hkv, 1, D]``, post-RoPE) stores the new K/V and returns attention output ``[B, Hq, D]``.

    ``compile="layers"`` runs :func:`attention_inputs` and :func:`layer_output` through
    ``torch.compile`` (one compiled graph each, shared by all layers): inductor fuses the norms,
    RoPE, residual adds and the activation, which eagerly are ~20 small kernels per layer. The
    store's writes and attention stay outside (their kernels are already single launches). The
    step's own work around the layers is compiled too: :func:`step_inputs`, the final norm and
    :func:`record_token` (the decoder's bookkeeping, :attr:`record`).
    ``"reduce-overhead"`` leaves the layers eager here: :class:`kvlab.engine.fast.FastDecoder`
    compiles the whole step with torch's own CUDA graphs instead of capturing one itself.
    """

    def __init__(self, model, compile: str = "none"):
        check_model(model)
        if compile not in STEP_COMPILE:
            raise EngineError(f"compile={compile!r}: use one of {', '.join(STEP_COMPILE)}")
        config = model.config
        inner = model.model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = model.lm_head
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scaling = self.layers[0].self_attn.scaling
        with torch.no_grad():
            self.qkv = [_fuse_linears([la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj])
                        for la in self.layers]
            self.gate_up = [_fuse_linears([la.mlp.gate_proj, la.mlp.up_proj]) for la in self.layers]
        self.heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        self.eps = [(norm_eps(la.input_layernorm), norm_eps(la.post_attention_layernorm)) for la in self.layers]
        self.act = self.layers[0].mlp.act_fn  # one object for every layer (a compile guard, not 32)
        if any(type(la.mlp.act_fn) is not type(self.act) for la in self.layers):
            raise EngineError("the fast engine needs one activation function in every layer: use --engine hf")
        self.compile = compile
        self.final_eps = norm_eps(self.norm)
        self._start, self._inputs, self._output, self._norm = step_inputs, attention_inputs, layer_output, _rms
        self.record = record_token
        if compile == "layers":  # dynamic=False: one shape per engine; the graph fixes it anyway
            self._start = torch.compile(step_inputs, dynamic=False)
            self._inputs = torch.compile(attention_inputs, dynamic=False)
            self._output = torch.compile(layer_output, dynamic=False)
            self._norm = torch.compile(_rms, dynamic=False)
            self.record = torch.compile(record_token, dynamic=False)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def __call__(self, token: torch.Tensor, position: torch.Tensor, kv) -> torch.Tensor:
        hidden, cos, sin = self._start(self.embed, self.rotary, token, position)  # [B, 1, H], [B, 1, 1, D]
        kv.begin()
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            eps_in, eps_post = self.eps[i]
            q, k, v = self._inputs(hidden, layer.input_layernorm.weight, eps_in, *self.qkv[i], cos, sin, self.heads)
            out = kv.attend(i, q, k, v)  # [B, Hq, D]
            hidden = self._output(hidden, out, attn.o_proj.weight, attn.o_proj.bias,
                                  layer.post_attention_layernorm.weight, eps_post,
                                  *self.gate_up[i], mlp.down_proj.weight, mlp.down_proj.bias, self.act)
        return self.lm_head(self._norm(hidden, self.norm.weight, self.final_eps))[:, -1]
