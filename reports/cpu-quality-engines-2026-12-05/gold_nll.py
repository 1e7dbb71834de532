"""Gold NLL of one needle item per (length, depth) on hf, fast and hf1 (hf fed token by token), on CPU.

Each engine runs kvlab.quality.items.run_item (the quality pass's own item); the teacher-forced logits
of the gold answer are saved per (dtype, engine, method, length, depth) under --out for summary.py,
and the summed gold NLL printed (the records' gold_nll).

    PYTHONPATH=. python reports/cpu-quality-engines-2026-12-05/gold_nll.py --dtype bfloat16 --lengths 1024
"""
import argparse
import os
import time

import torch
import torch.nn.functional as F

from kvlab.engine.engines import make_engine
from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.policies.base import attached
from kvlab.quality.items import run_item
from kvlab.quality.spec import TaskSpec, build_items
from kvlab.tasks import Encoder

ap = argparse.ArgumentParser()
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
ap.add_argument("--methods", nargs="+", default=["full", "kvq-int4", "kvq-fp8"])
ap.add_argument("--engines", nargs="+", default=["hf", "fast", "hf1"])
ap.add_argument("--tag", default="")
ap.add_argument("--out", default="logits")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)

dtype = getattr(torch, a.dtype)
t0 = time.time()
loaded = load_model("smollm2-135m", dtype=dtype)
enc = Encoder(loaded.tokenizer)
items = build_items(TaskSpec(tasks=["niah_single"], lengths=a.lengths, depths=a.depths, samples=1), enc, loaded.spec.max_context)
mk = {"hf": lambda: make_engine("hf", loaded), "fast": lambda: make_engine("fast", loaded), "hf1": lambda: make_engine("hf", loaded, feed="stepwise")}
engines = {e: mk[e]() for e in a.engines}
pols = [make_policy(m) for m in a.methods]
with attached(pols, loaded.model):
    for item in items:
        for p in pols:
            row = {}
            for name, eng in engines.items():
                r = run_item(loaded, p, item, enc, eng)
                row[name] = F.cross_entropy(r.tf_logits, torch.tensor(item.answer_ids), reduction="sum").item()
                torch.save({"logits": r.tf_logits, "answer": list(item.answer_ids), "pred": r.prediction},
                           f"{a.out}/{a.dtype}{a.tag}_{name}_{p.name}_{item.length}_{item.depth}.pt")
            s = " ".join(f"{k}={v:.4f}" for k, v in row.items())
            print(f"{a.dtype}{a.tag} L={item.length} d={item.depth} {p.name:9s} {s} [{time.time()-t0:.0f}s]", flush=True)
