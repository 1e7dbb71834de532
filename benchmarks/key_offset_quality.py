"""Why per-token key stores fail on models with outlier key channels, and what the key offset buys.

    python benchmarks/key_offset_quality.py --model /work/qwen --ctx 1024 --out reports/DIR
    python benchmarks/key_offset_quality.py --model smollm2-135m --ctx 1024 --out reports/DIR --tag smollm2

Three parts, printed as tables and saved as JSON (``channels-TAG.json``, ``schemes-TAG.json``) and
quality records (``records.jsonl``, the quality pass's own records):
1. per layer: the k_proj bias's largest |value|, and each of K's and V's channel statistics over the
   prompt (channel absmax ratio: the loudest (KV head, dim) channel's max |x| over the median
   channel's; channels above 10x the median; the loudest channel's mean and std over tokens);
2. per storage scheme, per layer: the K and V reconstruction error, the attention-score error (centred
   per query, relative to the centred exact scores), the attention KL and the attention-output error
   of the last ``--queries`` prompt positions, every query head (GQA), causal;
3. end to end, kvlab's own policies on the hf engine: the quality pass's continuation task (KL and
   top-1 against the full cache over the teacher-forced continuation; every continuation token is
   stored through the policy's cache, so decode-time appends with the prompt's offset are in it).

The schemes quantize with kvlab's formats (``kernels.formats``) and KIVI's (``kernels.kivi``); a key
offset is the prompt's channel mean (``kernels.key_offset``); "window" keeps the last 128 tokens exact.
CPU, float32 (the model's converted weights).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvlab.columns import model_columns
from kvlab.engine.generation import cache_kwarg
from kvlab.kernels import kivi, parse_format
from kvlab.kernels.key_offset import KEY_OFFSETS, shifted
from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.quality.continuation import continuation_items, run_continuation
from kvlab.records import RecordWriter
from kvlab.tasks import Encoder

WINDOW = 128
POLICIES = (  # (method, params): the end-to-end rows
    ("full", {}),
    ("kvq-int4", {"key_offset": "none"}),
    ("kvq-int4", {"key_offset": "prompt-mean"}),
    ("kvq-fp8", {"key_offset": "none"}),
    ("kvq-fp8", {"key_offset": "prompt-mean"}),
    ("kvq-int2", {"key_offset": "none"}),
    ("kvq-int2", {"key_offset": "prompt-mean"}),
    ("kivi", {}),
    ("kivi", {"nbits": 4}),
)


def per_token(fmt_name: str, offset: str, window: int = 0):
    """A per-token scheme: K minus the offset and V quantized in ``fmt_name``; the last ``window``
    tokens exact. Returns (K as attention sees it, K reconstructed, V)."""
    fmt = parse_format(fmt_name)

    def run(k, v):
        m = KEY_OFFSETS[offset].fit(k)
        kq = fmt.quantize(shifted(k, m)).dequantize()
        vq = fmt.quantize(v).dequantize()
        if window:
            kq[:, :, -window:] = shifted(k, m)[:, :, -window:]
            vq[:, :, -window:] = v[:, :, -window:].float()
        recon = kq if m is None else kq + m.unsqueeze(-2)
        return kq, recon, vq
    return run


def kivi_scheme(bits: int):
    """KIVI: keys per channel (groups of 32 tokens), values per token; the prompt's whole groups
    quantized, the rest exact (as the policy's residual would hold them)."""
    spec = kivi.KiviSpec(bits=bits, group=32, residual=0, value_group=32)

    def run(k, v):
        t = k.shape[2] // 32 * 32
        kq, vq = k.float().clone(), v.float().clone()
        kq[:, :, :t] = kivi.dequantize_keys(spec, *kivi.quantize_keys(spec, k[:, :, :t]))
        vq[:, :, :t] = kivi.dequantize_values(spec, *kivi.quantize_values(spec, v[:, :, :t]))
        return kq, kq, vq
    return run


SCHEMES = {
    "int4-g64 (old kvq-int4)": per_token("int4-g64", "none"),
    "int4-g64 keys - prompt mean (new kvq-int4)": per_token("int4-g64", "prompt-mean"),
    "int4-g64, last 128 exact": per_token("int4-g64", "none", WINDOW),
    "int4-g64 keys - mean, last 128 exact": per_token("int4-g64", "prompt-mean", WINDOW),
    "fp8 (old kvq-fp8)": per_token("fp8", "none"),
    "fp8 keys - prompt mean (new kvq-fp8)": per_token("fp8", "prompt-mean"),
    "int2-g64 (old kvq-int2)": per_token("int2-g64", "none"),
    "int2-g64 keys - prompt mean (new kvq-int2)": per_token("int2-g64", "prompt-mean"),
    "KIVI int4 per-channel keys (G32)": kivi_scheme(4),
    "KIVI int2 per-channel keys (G32)": kivi_scheme(2),
}


def capture(loaded, ids: torch.Tensor, n_queries: int):
    """Prefill ``ids``; per layer: K and V as cached (after RoPE) and the RoPE'd queries of the last
    ``n_queries`` positions ``[B, Hq, m, D]``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = loaded.model
    layers = model.model.layers
    queries = {}

    def hook(module, args, kwargs):
        hs = kwargs["hidden_states"][:, -n_queries:]
        cos, sin = (t[:, -n_queries:] for t in kwargs["position_embeddings"])
        q = module.q_proj(hs).view(hs.shape[0], hs.shape[1], -1, module.head_dim).transpose(1, 2)
        queries[module.layer_idx] = apply_rotary_pos_emb(q, q, cos, sin)[0].float()

    hooks = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in layers]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(ids, **{cache_kwarg(model): cache})
    finally:
        for h in hooks:
            h.remove()
    return [(cache.layers[i].keys.float(), cache.layers[i].values.float(), queries[i]) for i in range(len(layers))]


def channel_stats(x: torch.Tensor) -> dict:
    """x ``[1, H, n, D]``: the (head, dim) channels' absmax ratio, count above 10x the median, loudest."""
    absmax = x[0].abs().amax(1).flatten()  # [H*D]
    med = absmax.median()
    top = int(absmax.argmax())
    h, d = divmod(top, x.shape[-1])
    ch = x[0, h, :, d]
    return {"absmax_ratio": float(absmax.max() / med), "loud_channels": int((absmax > 10 * med).sum()),
            "max_abs": float(absmax.max()), "loudest": [h, d], "loudest_mean": float(ch.mean()),
            "loudest_std": float(ch.std())}


def attention(q, k, v, start: int):
    """Scores, probabilities and outputs of queries ``q [1, Hq, m, D]`` at positions ``start..`` over
    ``k``/``v`` ``[1, Hkv, n, D]`` (GQA, causal)."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    pos = torch.arange(k.shape[2])
    mask = pos[None, :] > (start + torch.arange(q.shape[2]))[:, None]
    s = s.masked_fill(mask, float("-inf"))
    p = s.softmax(-1)
    return s, p, p @ vv, ~mask


def scheme_errors(k, v, q, run) -> dict:
    kq, recon, vq = run(k, v)
    start = k.shape[2] - q.shape[2]
    s, p, o, valid = attention(q, k, v, start)
    s2, p2, o2, _ = attention(q, kq, vq, start)

    def centred(x):
        x = x.masked_fill(~valid, 0.0)
        mean = x.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True)
        return (x - mean).masked_fill(~valid, 0.0)
    score_err = (centred(s2) - centred(s)).flatten(-2).norm(dim=-1) / centred(s).flatten(-2).norm(dim=-1)
    kl = (p * (p.clamp_min(1e-30).log() - p2.clamp_min(1e-30).log())).sum(-1).mean()
    return {"k_err": float((recon - k).norm() / k.norm()), "v_err": float((vq - v).norm() / v.norm()),
            "score_err": float(score_err.mean()), "attn_kl": float(kl),
            "out_err": float((o2 - o).norm() / o.norm())}


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--continuation-tokens", type=int, default=128)
    ap.add_argument("--queries", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tag", default="qwen")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    loaded = load_model(args.model)
    model = loaded.model
    enc = Encoder(loaded.tokenizer)
    item = continuation_items(enc, [args.ctx], 1, args.continuation_tokens)[0]
    print(f"model {args.model} ({loaded.spec.num_layers} layers, {loaded.spec.num_kv_heads} KV heads, head dim "
          f"{loaded.spec.head_dim}), {loaded.dtype}; item: {item.source} offset {item.offset}, {args.ctx} tokens")

    captured = capture(loaded, torch.tensor([item.context_ids]), args.queries)
    channels = []
    print("\n## Channel statistics of the prompt's K and V (after RoPE), per layer\n")
    print("| layer | max abs k_proj.bias | K absmax ratio | K channels > 10x median | K loudest (head, dim): mean +- std "
          "| V absmax ratio | V channels > 10x median |")
    print("|---|---|---|---|---|---|---|")
    for i, (k, v, _q) in enumerate(captured):
        bias = getattr(model.model.layers[i].self_attn.k_proj, "bias", None)
        ks, vs = channel_stats(k), channel_stats(v)
        channels.append({"layer": i, "k_bias_max_abs": None if bias is None else float(bias.abs().max()),
                         "k": ks, "v": vs})
        b = "none" if bias is None else f"{float(bias.abs().max()):.1f}"
        print(f"| {i} | {b} | {ks['absmax_ratio']:.1f} | {ks['loud_channels']} | {tuple(ks['loudest'])}: "
              f"{ks['loudest_mean']:.1f} +- {ks['loudest_std']:.1f} | {vs['absmax_ratio']:.1f} | {vs['loud_channels']} |")
    (args.out / f"channels-{args.tag}.json").write_text(json.dumps(channels, indent=1))

    print(f"\n## Per-layer error of each storage scheme (last {args.queries} prompt queries): median / max "
          "over layers (layer of the max)\n")
    print("| scheme | K rel err | V rel err | score err | attention KL | attention-output err |")
    print("|---|---|---|---|---|---|")
    schemes = {}
    for name, run in SCHEMES.items():
        rows = [scheme_errors(k, v, q, run) for k, v, q in captured]
        schemes[name] = rows
        cells = []
        for key in ("k_err", "v_err", "score_err", "attn_kl", "out_err"):
            xs = [r[key] for r in rows]
            worst = max(range(len(xs)), key=xs.__getitem__)
            cells.append(f"{median(xs):.3f} / {xs[worst]:.3f} (L{worst})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    (args.out / f"schemes-{args.tag}.json").write_text(json.dumps(schemes, indent=1))
    del captured
    print(f"\n(analysis: {time.monotonic() - t0:.0f} s)", flush=True)
    if args.skip_e2e:
        return 0

    policies = [make_policy(m, **p) for m, p in POLICIES]
    spec = {"tasks": ["continuation"], "lengths": [args.ctx], "samples": 1,
            "continuation_tokens": args.continuation_tokens}
    with RecordWriter(args.out / "records.jsonl") as writer:
        records = run_continuation(loaded, policies, spec, writer,
                                   base={**model_columns(loaded), "sweep": args.out.name, "seed": 0},
                                   progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(f"\n## End to end: continuation over {args.continuation_tokens} teacher-forced tokens after {args.ctx} "
          "context tokens (hf engine)\n")
    print("| policy | label | KL vs full | top-1 agree | continuation NLL | status |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['method']} {json.dumps({k: v for k, v in r['policy_params'].items() if k == 'key_offset'})} "
              f"| {r['label']} | {r.get('kl', float('nan')):.4f} | {r.get('top1_agree', float('nan')):.3f} "
              f"| {r.get('cont_nll', float('nan')):.3f} | {r['status']} |")
    print(f"\n(total: {time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
