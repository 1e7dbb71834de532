"""The fast engine's two dense decode attentions on the GPU: flash varlen vs masked SDPA.

    python benchmarks/fast_attention.py --ctx 16384 --batch 1 16

At the Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128), bf16 static
buffers of ``ctx + 64`` slots with ``ctx`` used: max abs error of each against a float32
reference, and kernel time per layer call (CUDA events over 200 calls, also replayed from a
captured CUDA graph), with the GB/s each reaches on the K/V bytes it must read.
"""

from __future__ import annotations

import argparse

import torch

from kvlab.engine.kvstore import flash_decode, sdpa_decode


def reference(q, keys, values, length, scale):
    bsz, hq, _, d = q.shape
    hkv = keys.shape[2]
    k = keys[:, :length].float().transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    v = values[:, :length].float().transpose(1, 2).repeat_interleave(hq // hkv, dim=1)
    p = torch.softmax(q.float() @ k.transpose(-1, -2) * scale, dim=-1)
    return (p @ v).reshape(bsz, hq, d)


def timed(fn, iters=200):
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
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    a.record()
    for _ in range(iters // 20):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    return eager, a.elapsed_time(b) / iters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    args = ap.parse_args()
    hq, hkv, d = 32, 8, 128
    scale = d**-0.5
    print("batch  ctx    kernel  max_err   eager_ms  graph_ms  GB/s(graph)")
    for bsz in args.batch:
        cap = args.ctx + 64
        g = torch.Generator(device="cuda").manual_seed(0)
        keys = torch.randn(bsz, cap, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        values = torch.randn(bsz, cap, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(bsz, hq, 1, d, device="cuda", dtype=torch.bfloat16, generator=g)
        length = torch.tensor([args.ctx], device="cuda")
        used = length.to(torch.int32).expand(bsz).contiguous()
        ref = reference(q, keys, values, args.ctx, scale)
        kv_bytes = 2 * bsz * args.ctx * hkv * d * 2
        kernels = {"flash": (flash_decode, used), "sdpa": (sdpa_decode, length)}
        for name, (kernel, lengths) in kernels.items():
            def fn(kernel=kernel, lengths=lengths, q=q, keys=keys, values=values):
                return kernel(q, keys, values, lengths, scale)

            try:
                err = (fn().float() - ref).abs().max().item()
                eager, graph = timed(fn)
                print(f"{bsz:5d} {args.ctx:6d}  {name:6s} {err:.2e}  {eager:8.4f}  {graph:8.4f}  "
                      f"{kv_bytes / graph / 1e6:8.0f}", flush=True)
            except Exception as e:
                print(f"{bsz:5d} {args.ctx:6d}  {name:6s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del keys, values, kernels
        torch.cuda.empty_cache()
    print(f"torch {torch.__version__}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
