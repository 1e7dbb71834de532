"""2-bit key variants on SmolLM2's needle (CPU), simulated: the context's K/V are quantized and
dequantized in place (the last R = 128 tokens exact, values K2V2's per-token 2 bits unless said),
then the question, the greedy reply and the gold answer go through an exact DynamicCache.
``k2g32`` is KIVI's layout (kvlab's store gives the same reply and KL within 0.01; kivi_settings.py).

    PYTHONPATH=. python reports/cpu-quality-reads-2026-12-03/kivi_variants.py 4096 k2g32 k2g32-sink32 ...

Variants: k2g32 (keys per channel over 32-token groups, post-RoPE), k2g32-sink32 (the first 32
tokens' keys exact), k2g32-prerope (keys quantized before RoPE, rotated back), k2tok-g32 (keys per
token in 32-element groups, kvq's layout), k4g32 (4-bit keys), k2g32-v16 (2-bit keys, exact values),
k2g32-l0exact (layers 0-1 exact, as Quest keeps them dense).
"""

import json
import sys
import time

import torch
from kivi_settings import answer_run
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import rotate_half

from kvlab.engine.generation import prefill_ids
from kvlab.kernels import kivi
from kvlab.metrics import answer_span_fidelity
from kvlab.models import load_model
from kvlab.quality import TaskSpec
from kvlab.quality.items import segments
from kvlab.quality.spec import build_items
from kvlab.tasks import Encoder

RESIDUAL = 128


def channel_keys(k, bits, group=32):
    spec = kivi.KiviSpec(bits=2, group=group, residual=0, key_bits=bits)
    return kivi.dequantize_keys(spec, *kivi.quantize_keys(spec, k.to(torch.bfloat16)))


def token_groups(x, bits, group=32):
    spec = kivi.KiviSpec(bits=bits, value_group=group)
    return kivi.dequantize_values(spec, *kivi.quantize_values(spec, x.to(torch.bfloat16)))


def prerope_keys(k, cos, sin):
    pre = k * cos - rotate_half(k) * sin  # undo the rotation
    deq = channel_keys(pre, 2)
    return deq * cos + rotate_half(deq) * sin


def sink_exact(k):
    deq = channel_keys(k, 2)
    deq[:, :, :32] = k[:, :, :32]
    return deq


KEYS = {
    "k2g32": lambda k, cos, sin: channel_keys(k, 2),
    "k2g32-l0exact": lambda k, cos, sin: channel_keys(k, 2),
    "k2g32-v16": lambda k, cos, sin: channel_keys(k, 2),
    "k2g32-sink32": lambda k, cos, sin: sink_exact(k),
    "k2g32-prerope": prerope_keys,
    "k2tok-g32": lambda k, cos, sin: token_groups(k, 2),
    "k4g32": lambda k, cos, sin: channel_keys(k, 4),
}


def variant(name, layer, k, v, cos, sin):
    if name == "full" or (name == "k2g32-l0exact" and layer < 2):
        return k.clone(), v.clone()
    nq = 32 * ((k.shape[2] - RESIDUAL) // 32)
    kd = KEYS[name](k[:, :, :nq], cos[:, None, :nq], sin[:, None, :nq])
    vd = v[:, :, :nq] if name == "k2g32-v16" else token_groups(v[:, :, :nq], 2)
    return torch.cat([kd.to(k.dtype), k[:, :, nq:]], 2), torch.cat([vd.to(v.dtype), v[:, :, nq:]], 2)


def main():
    loaded = load_model("smollm2-135m", device="cpu")
    model, enc = loaded.model, Encoder(loaded.tokenizer)
    lengths, names = [int(x) for x in sys.argv[1].split(",")], sys.argv[2:]
    for item in build_items(TaskSpec(tasks=["niah_single"], lengths=lengths, depths=[0.1, 0.5, 0.9], samples=1), enc):
        t0 = time.time()
        exact = DynamicCache()
        context = segments(item, False)[0]
        prefill_ids(model, context, exact)
        kv = [(layer.keys, layer.values) for layer in exact.layers]
        cos, sin = model.model.rotary_emb(kv[0][0], torch.arange(len(context))[None])
        results = {}
        for name in ["full", *names]:
            cache = DynamicCache()
            for i, (k, v) in enumerate(kv):
                cache.update(*variant(name, i, k, v, cos, sin), i)
            results[name] = answer_run(model, cache, item, enc)
        for name, (pred, logits) in results.items():
            fid = answer_span_fidelity(logits, item.answer_ids, results["full"][1], item.answer_start)
            print(json.dumps({"length": item.length, "depth": item.depth, "variant": name, "score": item.score(pred),
                              "prediction": pred.strip()[:24], "kl": round(fid["kl"], 4),
                              "top1": fid["top1_agree"]}), flush=True)
        print(f"# {time.time() - t0:.0f}s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
