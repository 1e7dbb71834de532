"""What KVzip's prefill costs (issue #27): decoder forwards and the tokens they process, the SDPA calls
(their masks and K/V heads), the time of the context prefill against the reconstruction forwards and
the scoring, per context length, batch and ``prefill_rows`` (fast engine) or ``hf``.

    python benchmarks/kvzip_cost.py --model tiny-llama --ctx 512 1024 2048 --batch 1 2 --rows 0 1
    python benchmarks/kvzip_cost.py --model smollm2-135m --ctx 1024 4096 --batch 2 --rows 1 --json-out kvzip.json

``--rows 0``: the hf engine's prefill (one cache for the batch); ``--rows R``: the fast engine's prefill
R sequences at a time. Each case also runs ``full`` (one plain prefill) for the ratio. On CUDA the SDPA
rows say which calls pass a mask (a masked call cannot run on flash and, with grouped heads, transformers
repeats K/V per query head first).
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch
from torch.nn.attention.bias import CausalBias

import kvlab.policies.kvzip as kvzip
from kvlab.engine.engines import make_engine
from kvlab.measure import make_prompt, sdpa_context
from kvlab.models import load_model
from kvlab.policies import make_policy


def mask_form(mask) -> list | str | None:
    """None, ``"lower_right"`` (torch's causal bias: no mask materialized on CUDA) or ``[shape, dtype]``."""
    if mask is None:
        return None
    if isinstance(mask, CausalBias):
        return "lower_right"
    return [list(mask.shape), str(mask.dtype).replace("torch.", "")]


@contextmanager
def counted_sdpa(rows: list):
    """Record every SDPA call kvlab or transformers makes (not those torch makes inside one): query and
    key shapes, the mask's form and bytes, is_causal, enable_gqa."""
    fn = torch.nn.functional.scaled_dot_product_attention
    depth = [0]

    def recording(query, key, value, attn_mask=None, *args, **kwargs):
        if depth[0] == 0:
            rows.append({"q": list(query.shape), "k": list(key.shape), "mask": mask_form(attn_mask),
                         "mask_bytes": 0 if mask_form(attn_mask) in (None, "lower_right")
                         else attn_mask.numel() * attn_mask.element_size(),
                         "is_causal": bool(kwargs.get("is_causal", False)),
                         "gqa": bool(kwargs.get("enable_gqa", False))})
        depth[0] += 1
        try:
            if isinstance(attn_mask, CausalBias):  # its __torch_function__ only knows torch's own function
                return CausalBias._dispatch(query, key, value, attn_mask, *args, **kwargs)
            return fn(query, key, value, attn_mask, *args, **kwargs)
        finally:
            depth[0] -= 1

    torch.nn.functional.scaled_dot_product_attention = recording
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = fn


@contextmanager
def timed_phases(decoder, out: dict):
    """Decoder forwards (tokens each), the reconstruction's wall time and the scoring's."""
    forwards = out.setdefault("forwards", [])
    out.update(reconstruction_s=0.0, scoring_s=0.0)
    hook = decoder.register_forward_pre_hook(lambda m, a, k: forwards.append(list(k["input_ids"].shape)),
                                             with_kwargs=True)
    run, score = kvzip.score_by_reconstruction, kvzip.kvzip_chunk_scores

    def run_timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            out["reconstruction_s"] += time.perf_counter() - t0

    def score_timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return score(*args, **kwargs)
        finally:
            out["scoring_s"] += time.perf_counter() - t0

    kvzip.score_by_reconstruction, kvzip.kvzip_chunk_scores = run_timed, score_timed
    try:
        yield
    finally:
        kvzip.score_by_reconstruction, kvzip.kvzip_chunk_scores = run, score
        hook.remove()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(loaded, method: str, ctx: int, batch: int, rows: int, chunk_size: int, backend: str | None) -> dict:
    """One prefill of ``batch`` x ``ctx`` prompt tokens with ``method``; its forwards, SDPA calls and times."""
    model = loaded.model
    device = next(model.parameters()).device
    params = {"keep": 0.1, "chunk_size": chunk_size} if method == "kvzip" else {}
    policy = make_policy(method, **params)
    ids = make_prompt(loaded, ctx, batch, seed=0).to(device)
    out: dict = {"method": method, "ctx": ctx, "batch": batch, "rows": rows}
    calls: list = []
    with policy.attach(loaded, warm=False):
        engine = make_engine("fast" if rows else "hf", loaded)
        decoder = engine.decoder(policy, batch, ctx, 4)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with timed_phases(model.model, out), counted_sdpa(calls), sdpa_context(backend):
            sync(device)
            t0 = time.perf_counter()
            decoder.prefill(ids, None, rows or None)
            sync(device)
            out["prefill_s"] = time.perf_counter() - t0
        engine.release()
    if device.type == "cuda":
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    out["forward_tokens"] = sum(b * t for b, t in out["forwards"])
    out["context_s"] = out["prefill_s"] - out["reconstruction_s"]
    out["sdpa_calls"] = len(calls)
    out["masked_calls"] = sum(isinstance(c["mask"], list) for c in calls)
    out["max_mask_bytes"] = max((c["mask_bytes"] for c in calls), default=0)
    grouped = loaded.spec.num_kv_heads < loaded.spec.num_attention_heads
    out["repeated_kv_calls"] = sum(grouped and c["k"][1] == c["q"][1] for c in calls)  # K/V copied per query head
    out["lower_right_calls"] = sum(c["mask"] == "lower_right" for c in calls)
    out["sdpa_kinds"] = sorted({json.dumps({k: c[k] for k in ("mask", "is_causal", "gqa")}) for c in calls})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--weights", default=None, help="real | synthetic (default: the model's own)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", type=int, nargs="+", default=[0, 1], help="0: hf; R: fast, prefill_rows R")
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--sdpa-backend", default=None, help="pin SDPA as a sweep does (flash on CUDA)")
    ap.add_argument("--methods", nargs="+", default=["full", "kvzip"])
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    loaded = load_model(args.model, weights=args.weights, device=args.device, dtype=dtype)
    results = []
    for ctx in args.ctx:
        for batch in args.batch:
            for rows in args.rows:
                if rows > batch:
                    continue
                for method in args.methods:
                    r = measure(loaded, method, ctx, batch, rows, args.chunk_size, args.sdpa_backend)
                    results.append(r)
                    print(f"{method:6s} ctx {ctx:5d} B {batch} rows {rows}: prefill {r['prefill_s']:7.2f} s "
                          f"(context {r['context_s']:6.2f}, reconstruction {r['reconstruction_s']:6.2f}, "
                          f"scoring {r['scoring_s']:6.2f}); forwards {len(r['forwards'])} "
                          f"tokens {r['forward_tokens']}; sdpa {r['sdpa_calls']} masked {r['masked_calls']} "
                          f"max mask {r['max_mask_bytes'] / 2**20:.1f} MiB; K/V repeated {r['repeated_kv_calls']}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
