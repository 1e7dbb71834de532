"""Every registered policy generating on one model shape: what each cache held after prefill.

Not a test: a check to run on a GPU (issue #3's device run), e.g.

    python benchmarks/policies_gpu.py --model llama-3.1-8b --ctx 16384 --new-tokens 16 --json-out out.jsonl

Prints, per policy: the attention implementation the model ran, logical/physical tokens and bytes
after prefill against the 16-bit budget, peak memory, prefill time and decode ms/token (one pass,
cold: read the sweep for timings), and the error for any policy that cannot run here.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from kvlab.budget import cache_bytes
from kvlab.card import device_card
from kvlab.engine.generation import greedy_decode, prefill
from kvlab.measure import sdpa_context
from kvlab.models import load_model
from kvlab.policies import cache_stats, make_policy

DEFAULT_POLICIES = [
    ("full", {}),
    ("streamingllm", {"keep": 0.1}),
    ("snapkv", {"keep": 0.1}),
    ("pyramidkv", {"keep": 0.1}),
    ("tova", {"keep": 0.1}),
    ("knorm", {"keep": 0.1}),
    ("random", {"keep": 0.1}),
    ("quanto", {"nbits": 4}),
    ("quanto", {"nbits": 2}),
    ("hqq", {"nbits": 4}),
    ("fp8", {}),
    ("snapkv", {"keep": 0.25, "quant": {"backend": "quanto", "nbits": 4}}),
]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_one(loaded, method: str, kwargs: dict, ctx: int, new_tokens: int, seed: int) -> dict:
    device = loaded.device
    model = loaded.model
    row = {"method": method, "params": kwargs, "ctx": ctx, "model": loaded.spec.name,
           "weights": loaded.weights, "transformers": __import__("transformers").__version__}
    try:
        policy = make_policy(method, **kwargs)
        row["label"] = policy.label
        policy.check(loaded)
        policy.prepare(model)
        t0 = time.perf_counter()
        policy.warmup(model)  # quanto's CUDA extension build lands here, not in the timings below
        row["warmup_s"] = time.perf_counter() - t0
        row["attn_implementation"] = model.config._attn_implementation
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, loaded.spec.vocab_size, (1, ctx), generator=gen).to(device)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        cache = policy.make_cache(model)
        sync(device)
        t0 = time.perf_counter()
        logits = prefill(model, ids, cache)
        sync(device)
        row["prefill_s"] = time.perf_counter() - t0
        row["after_prefill"] = cache_stats(cache)
        row["budget_16bit_bytes"] = cache_bytes(loaded.spec, ctx, bits=16 if loaded.dtype != "float32" else 32)
        first = logits[:, -1].argmax(-1)
        t0 = time.perf_counter()
        tokens = greedy_decode(model, cache, first, new_tokens, cache.get_seq_length())
        sync(device)
        row["decode_ms_per_token"] = (time.perf_counter() - t0) * 1e3 / max(1, new_tokens - 1)
        row["final"] = cache_stats(cache)
        row["tokens"] = tokens[0, :8].tolist()
        if device.startswith("cuda"):
            row["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
        row["status"] = "ok"
        del cache, logits
    except Exception as err:  # one policy failing must not hide the others
        row["status"] = "failed"
        row["error"] = f"{type(err).__name__}: {err}"
        row["traceback"] = traceback.format_exc(limit=4)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weights", default="synthetic")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sdpa-backend", default="auto", help="pin torch's SDPA kernel (auto, cudnn, flash, ...)")
    ap.add_argument("--only", nargs="*", help="run only these methods")
    ap.add_argument("--json-out", help="append one JSON line per policy here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    loaded = load_model(args.model, weights=args.weights, device=args.device, seed=args.seed)
    print(f"model {args.model} ({loaded.weights}, {loaded.dtype}) on {args.device} in {time.perf_counter() - t0:.1f} s;"
          f" transformers {__import__('transformers').__version__}, torch {torch.__version__}")
    for method, kwargs in DEFAULT_POLICIES:
        if args.only and method not in args.only:
            continue
        with sdpa_context(args.sdpa_backend):
            row = run_one(loaded, method, kwargs, args.ctx, args.new_tokens, args.seed)
        row.update(sdpa_backend=args.sdpa_backend, card=device_card(args.device))
        if args.json_out:
            with open(args.json_out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        if row["status"] != "ok":
            print(f"{row.get('label', method):<34} FAILED {row['error'][:160]}")
            continue
        p = row["after_prefill"]
        peak = row.get("peak_mem_bytes")
        print(f"{row['label']:<34} attn={row['attn_implementation']:<10} logical={p['logical_tokens']:>6} "
              f"physical={p['physical_tokens']:>6} bytes={p['bytes'] / 2**20:>8.1f} MiB "
              f"({p['bytes'] / row['budget_16bit_bytes']:.3f} of 16-bit) prefill={row['prefill_s']:.2f}s "
              f"decode={row['decode_ms_per_token']:.1f} ms/tok warmup={row['warmup_s']:.1f}s"
              + (f" peak={peak / 2**30:.1f} GiB" if peak else ""))


if __name__ == "__main__":
    main()
