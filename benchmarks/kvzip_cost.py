"""What KVzip's prefill costs (issue #27): decoder forwards and the tokens they process, the SDPA calls
(their masks and K/V heads), the time of the context prefill against the reconstruction forwards and
the scoring, per context length, batch and ``prefill_rows`` (fast engine) or ``hf``.

    python benchmarks/kvzip_cost.py --model tiny-llama --weights synthetic --ctx 2048 4096 8192 --batch 2 --rows 0 1
    python benchmarks/kvzip_cost.py --model smollm2-135m --ctx 1024 4096 --batch 2 --rows 1 --json-out kvzip.json
    python benchmarks/kvzip_cost.py --model llama-3.1-8b --weights synthetic --device cuda --dtype bfloat16 \
        --ctx 4096 16384 --batch 2 --rows 2 --sdpa-backend flash --warmup 1 --json-out $OUT/kvzip_cost.json

``--rows 0``: the hf engine's prefill (one cache for the batch); ``--rows R``: the fast engine's prefill
R sequences at a time. Each case also runs ``full`` (one plain prefill) for the ratio. The SDPA counts
say which calls pass a mask tensor (it keeps CUDA's SDPA off flash and, with grouped heads, makes
transformers repeat K/V per query head first), which attend lower-right causal with no mask, and (on
CUDA) the backend torch picks for each. The cost before the lower-right reconstruction: the same
command with ``git checkout 25e2a08 -- kvlab/policies/kvzip.py``.
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import contextmanager

import torch
from torch.nn.attention.bias import CausalBias

import kvlab.policies.kvzip as kvzip
from kvlab.card import device_card
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


def cuda_backend(query, key, value, mask, is_causal: bool, gqa: bool) -> str | None:
    """The SDPA backend CUDA picks for these inputs under the backends enabled now (None on CPU): a
    lower-right causal bias is probed as torch's own dispatch probes it (no mask, not is_causal)."""
    if not query.is_cuda:
        return None
    if isinstance(mask, CausalBias):
        mask, is_causal = None, False
    cuda = torch.backends.cuda
    params = cuda.SDPAParams(query, key, value, mask, 0.0, is_causal, gqa)
    probes = [("cudnn", getattr(cuda, "can_use_cudnn_attention", None)), ("flash", cuda.can_use_flash_attention),
              ("efficient", cuda.can_use_efficient_attention)]
    for name, can_use in probes:
        if can_use is not None and can_use(params):
            return name
    return "math" if cuda.math_sdp_enabled() else "none"


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
                         "gqa": bool(kwargs.get("enable_gqa", False)),
                         "backend": cuda_backend(query, key, value, attn_mask, kwargs.get("is_causal", False),
                                                 kwargs.get("enable_gqa", False))})
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
def timed_phases(decoder, out: dict, device):
    """Decoder forwards (tokens each), the reconstruction's wall time and the scoring's (on CUDA each
    timed call is synchronized on both sides, so the times are the GPU's work, not its launches)."""
    forwards = out.setdefault("forwards", [])
    out.update(reconstruction_s=0.0, scoring_s=0.0)
    hook = decoder.register_forward_pre_hook(lambda m, a, k: forwards.append(list(k["input_ids"].shape)),
                                             with_kwargs=True)
    run, score = kvzip.score_by_reconstruction, kvzip.kvzip_chunk_scores

    def run_timed(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            sync(device)
            out["reconstruction_s"] += time.perf_counter() - t0

    def score_timed(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        try:
            return score(*args, **kwargs)
        finally:
            sync(device)
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


def measure(loaded, engines: dict, method: str, ctx: int, batch: int, rows: int, chunk_size: int,
            backend: str | None) -> dict:
    """One prefill of ``batch`` x ``ctx`` prompt tokens with ``method``; its forwards, SDPA calls and times.
    ``engines``: one engine per name, made once (the fast engine's step compiles when it is made)."""
    model = loaded.model
    device = next(model.parameters()).device
    params = {"keep": 0.1, "chunk_size": chunk_size} if method == "kvzip" else {}
    policy = make_policy(method, **params)
    ids = make_prompt(loaded, ctx, batch, seed=0).to(device)
    out: dict = {"method": method, "ctx": ctx, "batch": batch, "rows": rows}
    calls: list = []
    with policy.attach(loaded, warm=False):
        name = "fast" if rows else "hf"
        engine = engines[name] if name in engines else engines.setdefault(name, make_engine(name, loaded))
        decoder = engine.decoder(policy, batch, ctx, 4)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with timed_phases(model.model, out, device), counted_sdpa(calls), sdpa_context(backend):
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
    out["sdpa_kinds"] = sorted({json.dumps({k: c[k] for k in ("mask", "is_causal", "gqa", "backend")})
                                for c in calls})
    return out


def summary(r: dict) -> str:
    """One line per measured prefill."""
    backends = sorted({json.loads(k)["backend"] for k in r["sdpa_kinds"]} - {None})
    return (f"{r['method']:6s} ctx {r['ctx']:5d} B {r['batch']} rows {r['rows']}: prefill {r['prefill_s']:7.2f} s "
            f"(context {r['context_s']:6.2f}, reconstruction {r['reconstruction_s']:6.2f}, scoring "
            f"{r['scoring_s']:6.2f}); forwards {len(r['forwards'])} tokens {r['forward_tokens']}; sdpa "
            f"{r['sdpa_calls']} masked {r['masked_calls']} lower-right {r['lower_right_calls']} max mask "
            f"{r['max_mask_bytes'] / 2**20:.1f} MiB; K/V repeated {r['repeated_kv_calls']}"
            + (f"; backends {', '.join(backends)}" if backends else "")
            + (f"; peak {r['peak_mem_bytes'] / 2**30:.1f} GiB" if "peak_mem_bytes" in r else ""))


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
    ap.add_argument("--warmup", type=int, default=0, help="untimed prefills per method first (at the first "
                    "ctx, batch and rows): kernel builds, allocator growth")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    loaded = load_model(args.model, weights=args.weights, device=args.device, dtype=dtype)
    engines: dict = {}
    shape = (args.ctx[0], args.batch[0], min(args.rows[0], args.batch[0]))
    for _ in range(args.warmup):
        for method in args.methods:
            measure(loaded, engines, method, *shape, args.chunk_size, args.sdpa_backend)
    results = []
    for ctx in args.ctx:
        for batch in args.batch:
            for rows in args.rows:
                if rows > batch:
                    continue
                for method in args.methods:
                    results.append(measure(loaded, engines, method, ctx, batch, rows, args.chunk_size,
                                           args.sdpa_backend))
                    print(summary(results[-1]), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{**r, "card": device_card(args.device)} for r in results], f, indent=1)  # each row: its card


if __name__ == "__main__":
    main()
