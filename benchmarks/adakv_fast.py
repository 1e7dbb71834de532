"""AdaKV on the fast engine's ragged store (issue #27 item 3), on the GPU: the flash varlen path against
the masked-SDPA reference, and the memory the store frees.

    python benchmarks/adakv_fast.py --ctx 16384 --batch 4 --keep 0.25 --new-tokens 64 --json-out $OUT/adakv-fast.json

1. Kernel (``kernel`` rows): at the model's attention shape, bf16 flat buffers with uneven kept rows per
   (row, KV head) (each row keeps ``Hkv x budget``; lengths drawn at random): max abs error of
   ``ragged_flash_decode`` and ``ragged_sdpa_decode`` against a float32 per-segment reference, and ms per
   layer call (CUDA events, eager and replayed from a captured graph), next to the dense ``flash_decode``
   over a store of the same budget (what an even split would cost).
2. Engine (``engine`` rows): the model (synthetic weights unless ``--weights real``), ``fast`` with
   ``full`` and with ``adakv(scorer, keep)``, each with ``attention`` flash and sdpa: peak allocated memory
   over build + capture + prefill + decode (reset before each), the store's allocated bytes, ms per
   decode step, and the greedy tokens and teacher-forced logits of the flash store against the sdpa one.
   ``--hf-steps N`` (default 8; 0: skip) also compares fast+adakv with hf+adakv (``compare_engines``).

On CPU (``--device cpu --model tiny-llama``) the flash rows say they need CUDA; the rest runs (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from kvlab.card import device_card
from kvlab.engine.compare import compare_engines
from kvlab.engine.fast import FastEngine
from kvlab.measure import make_prompt
from kvlab.models import load_model
from kvlab.policies import make_policy
from kvlab.storage.ragged import ragged_flash_decode, ragged_sdpa_decode, segment_offsets
from kvlab.storage.slots import cumulative_offsets, flash_available, flash_decode

ATTENTIONS = ("flash", "sdpa")


def uneven_lengths(batch: int, heads: int, budget: int, generator) -> torch.Tensor:
    """``[batch, heads]`` kept rows summing to ``heads x budget`` per row, split at random."""
    weights = torch.rand(batch, heads, generator=generator) + 0.1
    lengths = (weights / weights.sum(-1, keepdim=True) * heads * budget).floor().long()
    lengths[:, 0] += heads * budget - lengths.sum(-1)
    return lengths


def segment_reference(q, keys, values, offsets, used, scale):
    """float32, one segment at a time: ``[B, Hq, D]``."""
    bsz, n_heads, _, dim = q.shape
    heads = used.numel() // bsz
    groups = n_heads // heads
    out = torch.empty(bsz, n_heads, dim, dtype=torch.float32, device=q.device)
    for s in range(used.numel()):
        b, h = divmod(s, heads)
        k = keys[offsets[s]:offsets[s] + used[s]].float()
        v = values[offsets[s]:offsets[s] + used[s]].float()
        qs = q[b, h * groups:(h + 1) * groups, 0].float()
        out[b, h * groups:(h + 1) * groups] = torch.softmax(qs @ k.T * scale, dim=-1) @ v
    return out


def call_ms(fn, device: str, iters: int = 100) -> tuple[float, float | None]:
    """(eager ms per call, graph-replayed ms per call; None off CUDA)."""
    if not device.startswith("cuda"):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) * 1e3 / iters, None
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    eager = a.elapsed_time(b) / iters
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    a.record()
    for _ in range(iters // 10):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return eager, a.elapsed_time(b) / iters


def kernel_rows(spec, args) -> list[dict]:
    """Part 1: the two ragged attentions on one layer's flat buffers, and dense flash at the budget."""
    device, dtype = args.device, torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hq, hkv, dim = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
    budget, new, bsz = max(1, int(args.ctx * args.keep)), args.new_tokens, args.batch
    g = torch.Generator().manual_seed(args.seed)
    lengths = uneven_lengths(bsz, hkv, budget, g)
    offsets = segment_offsets(lengths, budget, new).reshape(-1).to(device)
    used = (lengths.reshape(-1) + new // 2).to(torch.int32).to(device)  # mid-decode
    n_rows = bsz * hkv * (budget + new)
    keys = torch.randn(n_rows, dim, generator=g).to(device, dtype)
    values = torch.randn(n_rows, dim, generator=g).to(device, dtype)
    q = torch.randn(bsz, hq, 1, dim, generator=g).to(device, dtype)
    scale = dim**-0.5
    cu_q = torch.arange(bsz * hkv + 1, dtype=torch.int32, device=device)
    cu_k = torch.cat([offsets, torch.tensor([n_rows], device=device)]).to(torch.int32)
    ref = segment_reference(q, keys, values, offsets, used, scale)
    dense_k = keys.view(bsz, hkv, budget + new, dim).clone()  # [B, Hkv, C, D], the dense store's layout
    dense_v = values.view(bsz, hkv, budget + new, dim).clone()
    dense_used = torch.full((bsz * hkv,), budget + new // 2, dtype=torch.int32, device=device)  # per segment
    kernels = {
        "ragged flash": lambda: ragged_flash_decode(q, keys, values, cu_q, cu_k, used, hkv * budget + new, scale),
        "ragged sdpa": lambda: ragged_sdpa_decode(q, keys, values, offsets, used, scale),
        "dense flash": lambda: flash_decode(q, dense_k, dense_v, dense_used, scale,
                                            *cumulative_offsets(bsz * hkv, budget + new, device)),
    }
    rows = []
    base = {"part": "kernel", "ctx": args.ctx, "batch": bsz, "keep": args.keep, "budget": budget,
            "lengths_min": int(lengths.min()), "lengths_max": int(lengths.max()),
            "kv_bytes_read": int(2 * used.sum()) * dim * keys.element_size()}
    for name, fn in kernels.items():
        row = {**base, "kernel": name}
        if "flash" in name and not flash_available(device, dtype):
            row["error"] = "needs a CUDA device and bf16/fp16"
        else:
            try:
                out = fn().float()
                row["max_abs_err"] = None if name == "dense flash" else (out - ref).abs().max().item()
                row["eager_ms"], row["graph_ms"] = call_ms(fn, device)
            except Exception as err:  # noqa: BLE001 - a failure is a row
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def engine_row(loaded, policy, attention: str, prompt, args, fed) -> tuple[dict, dict]:
    """Part 2, one (policy, attention): peak memory and ms/step; (row, {tokens, logits})."""
    device = args.device
    cuda = device.startswith("cuda")
    row = {"part": "engine", "label": policy.label, "attention": attention, "ctx": args.ctx,
           "batch": args.batch, "new_tokens": args.new_tokens}
    engine = FastEngine(loaded, attention=attention, max_decoders=1)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row["weights_gb"] = torch.cuda.memory_allocated() / 1e9
    with policy.attach(loaded, warm=True), torch.no_grad():
        decoder = engine.decoder(policy, args.batch, args.ctx, args.new_tokens)
        first = decoder.prefill(prompt)
        mark = decoder.checkpoint()
        logits = decoder.feed(fed, args.ctx)  # teacher-forced: the same tokens through both stores
        decoder.restore(mark)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = decoder.decode(first, args.new_tokens, args.ctx)
        if cuda:
            torch.cuda.synchronize()
    row["ms_per_step"] = (time.perf_counter() - t0) * 1e3 / max(1, args.new_tokens - 1)
    row["store_bytes"] = decoder.store.bytes_allocated()
    row["kv_format"] = decoder.store.kv_format
    row["cuda_graph"] = decoder.replays
    if cuda:
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        row["peak_over_weights_gb"] = row["peak_gb"] - row["weights_gb"]
    engine.release()
    return row, {"tokens": tokens.cpu(), "logits": logits.float().cpu()}


def engine_rows(loaded, args) -> list[dict]:
    prompt = make_prompt(loaded, args.ctx, args.batch, seed=args.seed)
    fed = prompt[:, : min(8, args.new_tokens)]  # any tokens: the same for every store
    policies = [make_policy("full"), make_policy("adakv", keep=args.keep, scorer=args.scorer)]
    rows = []
    for policy in policies:
        outs = {}
        for attention in ATTENTIONS:
            try:
                row, outs[attention] = engine_row(loaded, policy, attention, prompt, args, fed)
            except Exception as err:  # noqa: BLE001 - a failure is a row
                row = {"part": "engine", "label": policy.label, "attention": attention,
                       "error": f"{type(err).__name__}: {str(err)[:300]}", "trace": traceback.format_exc()[-800:]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        if len(outs) == 2:
            a, b = outs["flash"], outs["sdpa"]
            same = (a["tokens"] == b["tokens"]).float().mean().item()
            diff = (a["logits"] - b["logits"]).abs().max().item()
            row = {"part": "flash vs sdpa", "label": policy.label, "token_agree": same, "max_abs_logit_diff": diff,
                   "top1_agree_fed": (a["logits"].argmax(-1) == b["logits"].argmax(-1)).float().mean().item()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.hf_steps:
        policy = policies[1]
        try:
            with policy.attach(loaded, warm=False):
                out = compare_engines(loaded, policy, prompt[:1], args.hf_steps)
            row = {"part": "fast vs hf", "label": policy.label, **out}
        except Exception as err:  # noqa: BLE001 - a failure is a row
            row = {"part": "fast vs hf", "label": policy.label, "error": f"{type(err).__name__}: {str(err)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--weights", default="synthetic", choices=["synthetic", "real"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--scorer", default="snapkv")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", nargs="+", default=["kernel", "engine"], choices=["kernel", "engine"])
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    loaded = load_model(args.model, weights=args.weights, device=args.device)
    rows = []
    if "kernel" in args.parts:
        rows += kernel_rows(loaded.spec, args)
    if "engine" in args.parts:
        rows += engine_rows(loaded, args)
    rows.append({"part": "env", "torch": torch.__version__, "device": args.device,
                 "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                 "card": device_card(args.device)})
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
