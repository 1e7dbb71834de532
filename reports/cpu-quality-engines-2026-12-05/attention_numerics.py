"""Decode attention numerics per path on SmolLM2's own q/K/V (bf16, a 1k needle item, the question's
last token): each path's error against float64 attention over the same codes, as a share of the
format's own error (float64 attention over the codes against float64 over the unquantized K/V).
The Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1) on the first layers given.

    PYTHONPATH=. python reports/cpu-quality-engines-2026-12-05/attention_numerics.py 1024 3
"""
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
import torch.nn.functional as F

from kvlab.engine.engines import make_engine
from kvlab.engine.generation import as_batch, prefill_ids
from kvlab.kernels import decode_attention, make_workspace, parse_format
from kvlab.kernels.formats import LaunchConfig
from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.quality.spec import TaskSpec, build_items
from kvlab.tasks import Encoder

L = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
triton_layers = int(sys.argv[2]) if len(sys.argv) > 2 else 4
loaded = load_model("smollm2-135m", dtype=torch.bfloat16)
enc = Encoder(loaded.tokenizer)
item = build_items(TaskSpec(tasks=["niah_single"], lengths=[L], depths=[0.5], samples=1), enc, 8192)[0]
pol = make_policy("full")
eng = make_engine("fast", loaded)
rec = {}
with pol.attach(loaded.model, warm=False):
    cache = pol.make_cache(loaded.model)
    prefill_ids(loaded.model, item.context_ids, cache, None)
    dec = eng.decoder_for_cache(pol, cache, len(item.question_ids) + 4)
    store = dec.store
    orig = store._attend
    def attend(layer, q, k, v):
        rec[layer] = q.clone()
        return orig(layer, q, k, v)
    store._attend = attend
    with torch.no_grad():
        dec.feed(as_batch(list(item.question_ids), "cpu"), len(item.context_ids))
n = len(item.context_ids) + len(item.question_ids)
scale = eng.step.scaling
print(f"L={L} n={n} scale={scale}")
def sdpa_bf16(q, k, v):  # transformers' sdpa_attention_forward at q_len 1: repeat_kv / enable_gqa, no mask
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)[:, :, 0]
def exact(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    p = torch.softmax((q.double() @ k.transpose(-1, -2)) * scale, -1)
    return (p @ v)[:, :, 0]
for name in ["fp8", "int4-g64"]:
    fmt = parse_format(name)
    rows = []
    for layer in range(len(store.keys)):
        K, V = store.keys[layer][:, :n].transpose(1, 2).contiguous(), store.values[layer][:, :n].transpose(1, 2).contiguous()
        q = rec[layer]  # [1, Hq, 1, D] bf16
        ks, vs = fmt.quantize(K), fmt.quantize(V)
        kd, vd = ks.dequantize(), vs.dequantize()
        o_exact = exact(q, K, V)  # unquantized
        o_fmt = exact(q, kd, vd)  # the format's own attention, exact arithmetic
        fmt_err = (o_fmt - o_exact).norm()
        out = {
            "floor: exact output -> bf16": o_fmt.to(torch.bfloat16),
            "hf (deq->bf16, SDPA bf16)": sdpa_bf16(q, kd.to(torch.bfloat16), vd.to(torch.bfloat16)),
            "deq->bf16, exact attn": exact(q, kd.to(torch.bfloat16), vd.to(torch.bfloat16)),
            "deq fp32, SDPA fp32 -> bf16": sdpa_bf16(q.float(), kd, vd).to(torch.bfloat16),
            "fast CPU (fp32 ref -> bf16)": decode_attention(q[:, :, 0].contiguous(), ks, vs, torch.tensor([n], dtype=torch.int32), scale).to(torch.bfloat16),
        }
        # torch emulation of the fp8 fold/split kernels' value product: p * (scale / max scale) in float16
        if name == "fp8":
            g = q.shape[1] // 3
            kk = kd.repeat_interleave(g, 1)
            sc = vs.scale.repeat_interleave(g, 1)  # [1, Hq, T]
            codes = vs.codes.float().repeat_interleave(g, 1)
            s_ = (q.float() @ kk.transpose(-1, -2))[:, :, 0] * scale
            p = torch.exp(s_ - s_.amax(-1, keepdim=True))
            top = sc.amax(-1, keepdim=True)
            for tag, pv in (("emul: pv fp16", (p * sc / top).half().float()), ("emul: pv fp32", p * sc / top)):
                out[tag] = (torch.einsum("bht,bhtd->bhd", pv, codes) * top / p.sum(-1, keepdim=True)).to(torch.bfloat16)
        if layer < triton_layers:
            for var in ("split", "fold"):
                ws = make_workspace(q.shape[1], ks, config=LaunchConfig(variant=var))
                out[f"triton {var} (interp)"] = decode_attention(q[:, :, 0].contiguous(), ks, vs, torch.tensor([n], dtype=torch.int32), scale, workspace=ws, backend="triton")
        rows.append({k: ((o.double() - o_fmt).norm() / fmt_err).item() for k, o in out.items()})
        rows[-1]["(format error / |output|)"] = (fmt_err / o_exact.norm()).item()
    print(f"\n{name}: |path - format exact| / |format exact - unquantized exact| per layer: median, max over {len(rows)} layers")
    for k in rows[0]:
        vals = torch.tensor([r[k] for r in rows if k in r])
        print(f"  {k:32s} median {vals.median():.4f}  max {vals.max():.4f}  (n={len(vals)})")
