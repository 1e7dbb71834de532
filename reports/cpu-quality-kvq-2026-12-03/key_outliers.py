"""Why per-token int4 hurts SmolLM2: its keys have outlier channels. Prefill 512 tokens of real text,
then per layer compare the relative error ||x - deq(q(x))|| / ||x|| of the keys (post-RoPE, as cached)
and values under kvq's per-token formats and under int4 grouped per channel (64 tokens per group,
KIVI's key layout), plus how loud the loudest key channel is against the median channel.

    PYTHONPATH=. python reports/cpu-quality-kvq-2026-12-03/key_outliers.py
"""

import torch
from transformers import DynamicCache

from kvlab.engine.generation import prefill
from kvlab.kernels import make_format
from kvlab.models import load_model
from kvlab.quality.continuation import stdlib_text

torch.set_num_threads(1)
loaded = load_model("smollm2-135m", device="cpu")
text = stdlib_text()[0]
ids = loaded.tokenizer(text, return_tensors="pt").input_ids[:, :512]
cache = DynamicCache()
prefill(loaded.model, ids, cache)


def rel(x, y):
    return float((x - y).norm() / x.norm())


def per_channel_int4(x, group=64):
    """int4-g64 applied along tokens: transpose so each channel's 64-token runs share a scale."""
    b, h, n, d = x.shape
    n = n // group * group
    xt = x[:, :, :n].transpose(2, 3).reshape(b, h, d * n // group, group)  # [.., groups, 64 tokens]
    fmt = make_format("int4", group=64)
    y = fmt.dequantize(fmt.quantize(xt))
    return rel(x[:, :, :n], y.reshape(b, h, d, n).transpose(2, 3))


fmts = {"fp8": make_format("fp8"), "int4-g32": make_format("int4", group=32), "int4-g64": make_format("int4", group=64)}
rows = []
for i, layer in enumerate(cache.layers):
    k, v = layer.keys.float(), layer.values.float()
    chan = k.abs().mean(dim=(0, 2))  # [Hkv, D]
    outlier = float((chan.amax(-1) / chan.median(-1).values).max())
    row = {"layer": i, "key_outlier_ratio": outlier}
    for name, f in fmts.items():
        row[f"K {name}"] = rel(k, f.dequantize(f.quantize(k)))
        row[f"V {name}"] = rel(v, f.dequantize(f.quantize(v)))
    row["K int4 per-channel"] = per_channel_int4(k)
    rows.append(row)

cols = list(rows[0])
print(" | ".join(cols))
for r in rows:
    print(" | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
mean = {c: sum(r[c] for r in rows) / len(rows) for c in cols[1:]}
print("mean | " + " | ".join(f"{mean[c]:.3f}" for c in cols[1:]))
