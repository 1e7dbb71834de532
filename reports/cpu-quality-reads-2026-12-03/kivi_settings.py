"""KIVI settings on SmolLM2-135M's needle (CPU): one exact prefill per item, shared by every setting.

    PYTHONPATH=. python reports/cpu-quality-reads-2026-12-03/kivi_settings.py LENGTHS [SETTINGS...]

A setting is ``kBITS-vBITS-gG-rR`` (e.g. ``k2-v2-g32-r128``). Per item and setting: the needle score
(greedy reply, as ``run_item``), KL(full || kivi) and top-1 agreement over the teacher-forced gold
answer. The prefill attends exactly in both engines (it is the first forward), so the prefill's K/V
are handed to each setting's fresh cache as its first update instead of re-running the model: the
same state ``run_item`` would build, at one prefill per item instead of one per setting.
"""

import json
import sys
import time

import torch
from transformers import DynamicCache

from kvlab.engine.generation import as_batch, prefill_ids
from kvlab.engine.hf import HFDecoder
from kvlab.metrics import answer_span_fidelity
from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.quality import TaskSpec
from kvlab.quality.items import reply_text, segments
from kvlab.quality.spec import build_items
from kvlab.tasks import Encoder


def parse(setting: str):
    if setting == "full":
        return make_policy("full")
    parts = dict((p[0], int(p[1:])) for p in setting.split("-"))
    return make_policy("kivi", key_bits=parts["k"], nbits=parts["v"], q_group_size=parts["g"],
                       residual_length=parts["r"])


def answer_run(model, cache, item, enc):
    """run_item's steps after the prefill: question fed, greedy reply, gold teacher-forced."""
    first, second = segments(item, False)
    dec = HFDecoder(model, cache)
    answer = list(item.answer_ids)
    with torch.inference_mode():
        last = dec.feed(as_batch(list(second), "cpu"), len(first))[0, -1]
        start = len(first) + len(second)
        mark = dec.checkpoint()
        tokens = dec.decode(last.argmax().reshape(1), max(1, item.max_new_tokens), start)
        dec.restore(mark)
        rest = dec.feed(as_batch(answer[:-1], "cpu"), start)[0] if len(answer) > 1 else last[None][:0]
    generated = [int(t) for t in tokens[0].tolist()]
    return reply_text(enc, generated), torch.cat([last[None], rest]).float()


def main():
    lengths = [int(n) for n in sys.argv[1].split(",")]
    settings = sys.argv[2:] or ["k2-v2-g32-r128"]
    loaded = load_model("smollm2-135m", device="cpu")
    model, enc = loaded.model, Encoder(loaded.tokenizer)
    spec = TaskSpec(tasks=["niah_single"], lengths=lengths, depths=[0.1, 0.5, 0.9], samples=1, seed=0)
    for item in build_items(spec, enc):
        t0 = time.time()
        exact = DynamicCache()
        prefill_ids(model, segments(item, False)[0], exact)
        kv = [(layer.keys, layer.values) for layer in exact.layers]
        results = {}
        for setting in ["full", *settings]:
            policy = parse(setting)
            cache = policy.make_cache(model)
            for layer, (k, v) in zip(cache.layers, kv, strict=True):
                layer.update(k.clone(), v.clone())
            pred, logits = answer_run(model, cache, item, enc)
            results[setting] = (pred, logits)
        ref = results["full"][1]
        for setting, (pred, logits) in results.items():
            fid = answer_span_fidelity(logits, item.answer_ids, ref, item.answer_start)
            print(json.dumps({"length": item.length, "depth": item.depth, "setting": setting,
                              "score": item.score(pred), "prediction": pred.strip()[:30],
                              "kl": round(fid["kl"], 4), "top1": fid["top1_agree"],
                              "gold_nll": round(fid["gold_nll"], 3)}), flush=True)
        print(f"# item {item.length} {item.depth}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
