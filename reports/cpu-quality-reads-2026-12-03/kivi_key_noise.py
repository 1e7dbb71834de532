"""Why 2-bit keys lose SmolLM2's needle at 4k: the attention of the question's last token (the one
that predicts the first answer token) over the context, with the cached keys exact vs KIVI-quantized
(per channel over 32-token groups, post-RoPE, as cached; values exact). Per layer: the std of the
logit error ``q.(k_hat - k) * scale`` against the std of the logits, the total-variation distance
between the two attention rows, and the attention mass on the needle sentence (heads' max).

    PYTHONPATH=. python reports/cpu-quality-reads-2026-12-03/kivi_key_noise.py [LENGTH] [DEPTH]
"""

import sys

import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlab.engine.generation import prefill_ids
from kvlab.kernels import kivi
from kvlab.models import load_model
from kvlab.quality import TaskSpec
from kvlab.quality.spec import build_items
from kvlab.tasks import Encoder

torch.set_num_threads(1)
length = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
depth = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
loaded = load_model("smollm2-135m", device="cpu")
model, enc = loaded.model, Encoder(loaded.tokenizer)
item = next(it for it in build_items(TaskSpec(tasks=["niah_single"], lengths=[length], depths=[depth], samples=1), enc)
            if it.depth == depth)
ids = list(item.context_ids + item.question_ids + item.answer_prefix_ids)
n_ctx = len(item.context_ids)
answer = enc.encode(item.references[0])
ctx = list(item.context_ids)
start = next(i for i in range(n_ctx) if ctx[i:i + len(answer)] == list(answer))
needle = range(max(0, start - 12), start + len(answer))  # the needle sentence's tail and its number

queries = {}


def grab(module, args, kwargs):
    h = kwargs["hidden_states"][:, -1:]
    cos, sin = kwargs["position_embeddings"]
    q = module.q_proj(h).view(1, 1, -1, module.head_dim).transpose(1, 2)
    q, _ = apply_rotary_pos_emb(q, q, cos[:, -1:], sin[:, -1:])
    queries[module.layer_idx] = (q[0, :, 0].float(), module.scaling)


hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers]
cache = DynamicCache()
prefill_ids(model, ids, cache)
for h in hooks:
    h.remove()


def fake_keys(k, bits):
    spec = kivi.KiviSpec(bits=2, group=32, residual=0, key_bits=bits)
    n = spec.group * (k.shape[2] // spec.group)
    return kivi.dequantize_keys(spec, *kivi.quantize_keys(spec, k[:, :, :n].to(torch.bfloat16))), n


print(f"item L={length} depth={depth}: needle tokens {needle.start}-{needle.stop - 1} of {n_ctx}; answer {item.references[0]}")
print("layer | logit std | err std K2 | err std K4 | TV K2 | TV K4 | needle mass exact | K2 | K4")
totals = []
for i, layer in enumerate(cache.layers):
    q, scale = queries[i]  # [Hq, D]
    k = layer.keys[:, :, :n_ctx].float()  # the context's keys, as cached (post-RoPE)
    hkv, group = k.shape[1], q.shape[0] // k.shape[1]
    qg = q.view(hkv, group, -1)
    row = {}
    for name, bits in (("exact", None), ("K2", 2), ("K4", 4)):
        kk, n = (k, n_ctx) if bits is None else fake_keys(k, bits)
        logits = torch.einsum("hgd,htd->hgt", qg, kk[0, :, :n]) * scale
        row[name] = logits
    n = row["K2"].shape[-1]
    exact = row["exact"][..., :n]
    p = {name: torch.softmax(row[name][..., :n], -1) for name in row}
    err = {name: float((row[name][..., :n] - exact).std()) for name in ("K2", "K4")}
    tv = {name: float(0.5 * (p[name] - p["exact"]).abs().sum(-1).max()) for name in ("K2", "K4")}
    mass = {name: float(p[name][..., list(needle)].sum(-1).max()) for name in p}
    totals.append((err["K2"], err["K4"], tv["K2"], tv["K4"]))
    print(f"{i} | {float(exact.std()):.2f} | {err['K2']:.3f} | {err['K4']:.3f} | {tv['K2']:.3f} | {tv['K4']:.3f} | "
          f"{mass['exact']:.3f} | {mass['K2']:.3f} | {mass['K4']:.3f}")
means = [sum(t[j] for t in totals) / len(totals) for j in range(4)]
print(f"mean | | {means[0]:.3f} | {means[1]:.3f} | {means[2]:.3f} | {means[3]:.3f} | | |")
