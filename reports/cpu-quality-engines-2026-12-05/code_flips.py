"""Stored bytes (codes) after the question and gold: hf (one forward) vs hf1 (token by token) vs fast, per layer.

    PYTHONPATH=. python reports/cpu-quality-engines-2026-12-05/code_flips.py bfloat16 kvq-int4
"""
import sys

import torch

from kvlab.engine.engines import make_engine
from kvlab.engine.generation import as_batch, prefill_ids
from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.quality.spec import TaskSpec, build_items
from kvlab.tasks import Encoder

dtype = getattr(torch, sys.argv[1])
method = sys.argv[2] if len(sys.argv) > 2 else "kvq-int4"
loaded = load_model("smollm2-135m", dtype=dtype)
enc = Encoder(loaded.tokenizer)
item = build_items(TaskSpec(tasks=["niah_single"], lengths=[1024], depths=[0.1], samples=1), enc, 8192)[0]
pol = make_policy(method)
ctx, q = item.context_ids, list(item.question_ids) + list(item.answer_ids[:-1])
n0 = len(ctx)
def codes_hf(token_by_token):
    eng = make_engine("hf", loaded, feed="stepwise" if token_by_token else "batched")
    cache = pol.make_cache(loaded.model)
    prefill_ids(loaded.model, ctx, cache, None)
    dec = eng.decoder_for_cache(pol, cache, len(q))
    with torch.no_grad():
        dec.feed(as_batch(q, "cpu"), n0)
    return [(la.key_store.codes.view(torch.uint8), la.value_store.codes.view(torch.uint8)) for la in dec.cache.layers]
def codes_fast():
    eng = make_engine("fast", loaded)
    storage = eng.storage_policy(pol)
    cache = storage.make_cache(loaded.model)
    prefill_ids(loaded.model, ctx, cache, None)
    dec = eng.decoder_for_cache(pol, cache, len(q))
    with torch.no_grad():
        dec.feed(as_batch(q, "cpu"), n0)
    n = n0 + len(q)
    return [(k.codes[:, :, :n].view(torch.uint8), v.codes[:, :, :n].view(torch.uint8)) for k, v in zip(dec.store.keys, dec.store.values, strict=False)]
with pol.attach(loaded.model, warm=False):
    runs = {"hf": codes_hf(False), "hf1": codes_hf(True), "fast": codes_fast()}
def diff(a, b, sl):
    # differing bytes (a byte holds 2 int4 codes / 1 fp8 code) in the slots sl, K and V
    return sum(int((x[:, :, sl] != y[:, :, sl]).sum()) for x, y in zip(a, b, strict=False))
print(f"{dtype} {method}: context {n0} tokens, fed {len(q)} (question + gold[:-1]); bytes per layer fed K+V = {2*runs['hf'][0][0][:, :, n0:].numel()}")
for a, b in (("hf", "hf1"), ("hf", "fast"), ("hf1", "fast")):
    ctx_diff = sum(diff(*pair, slice(0, n0)) for pair in zip(runs[a], runs[b], strict=False))
    per_layer = [diff(x, y, slice(n0, None)) for x, y in zip(runs[a], runs[b], strict=False)]
    first = next((i for i, v in enumerate(per_layer) if v), None)
    print(f"  {a:4s} vs {b:4s}: context bytes differing {ctx_diff}; fed bytes differing per layer {per_layer} (first layer {first})")
