"""The numbers of README.md derived from this folder: the reads sweep's ratios with their CIs (kvlab's
methods table), each setting's ITL against its byte floor, the kernels side by side, and the AdaKV
ragged-store check. The byte floor of a decode step is the bytes it must read (16.06 GB of weights
plus the KV it reads) over the copy bandwidth measured in the same call (engines/*.json).

    python reports/h100-2026-12-05/derived.py
"""
from pathlib import Path

from kvlab.records import load_records, read_json
from kvlab.reporting.methods import methods_display, methods_table

HERE = Path(__file__).parent
WEIGHTS = 16.06e9  # Llama-3.1-8B bf16 weights (kvlab models)
PAGE, BUDGET, DENSE_LAYERS, LAYERS, CTX = 16, 2048, 2, 32, 16384  # params/h200-reads.yaml's Quest


def load(path):
    return read_json(HERE / path)  # the file or its .xz twin


def kv_read(label: str, cache_bytes: float, full_bytes: float) -> float:
    """Bytes of KV one decode step reads. Quest (its cache_bytes count the page bounds too): of the
    full cache's K/V, its dense layers whole, the budget's share of the others, and every page's key
    min and max (2 of every 2 x PAGE rows of K and V)."""
    if not label.startswith("quest"):
        return cache_bytes
    per_layer = full_bytes / LAYERS
    sparse = LAYERS - DENSE_LAYERS
    return per_layer * (DENSE_LAYERS + sparse * BUDGET / CTX + sparse / PAGE)


copy_bw = load("engines/engines-b16-warp-rows4.json")["copy_bandwidth_Bps"]
print(f"== copy bandwidth in the engines call: {copy_bw / 1e12:.2f} TB/s (read + write)")
records = load_records(HERE / "reads-16k")
for batch in (1, 16):
    part = records[records.batch == batch]
    print(f"\n== reads-16k, batch {batch}: kvlab's methods table (95% Welch-log intervals over the repeats, none "
          "below 3 runs a side)")
    print(methods_display(methods_table(part))[["method", "KV freed", "decode J/token vs full", "TTFT vs full"]]
          .to_string(index=False))
    means = part.groupby("label")[["itl_median_ms", "cache_bytes", "peak_mem_bytes", "decode_j_per_token"]].mean()
    floor_full = (WEIGHTS + means.loc["full", "cache_bytes"]) / copy_bw * 1e3
    print(f"{'setting':14s} {'ITL ms':>7s} {'KV read GB':>10s} {'floor ms':>8s} {'x floor':>7s} "
          f"{'floor/full floor':>16s} {'peak GB':>7s}")
    for label, row in means.iterrows():
        kv = kv_read(label, row.cache_bytes, means.loc["full", "cache_bytes"])
        floor = (WEIGHTS + kv) / copy_bw * 1e3
        print(f"{label:14s} {row.itl_median_ms:7.2f} {kv / 1e9:10.2f} {floor:8.2f} {row.itl_median_ms / floor:7.2f} "
              f"{floor / floor_full:16.3f} {row.peak_mem_bytes / 1e9:7.1f}")

print("\n== decode-attention kernels alone, 16k, Llama-3.1-8B attention shape, default geometry (64/4/2/4):"
      " ms per layer call (faster of eager and graph), fraction of a copy of the same bytes")
rows = [r for r in load("kernels/quant_attention-warp.json")["performance"]
        if r.get("label") in ("bf16", "fp8", "int4-g64") and r.get("cap") in (None, 16384)]
seen = set()
for r in rows:
    key = (r["label"], r["batch"], r["config"]["variant"])
    if key in seen:  # the second block of batch-1 rows is the 32k-capacity case
        continue
    seen.add(key)
    best = min(r["kernel_ms"], r["kernel_graph_ms"])
    print(f"{r['label']:9s} B{r['batch']:<3d} {r['config']['variant']:9s} {best:.4f} ms  {r['of_copy_same_bytes']:.2f}")

print("\n== fast engine, batch 16, 16k, warp_asm at the tuned geometry (engines/*.json)")
for name in ("engines-b16-warp.json", "engines-b16-warp-rows4.json"):
    d = load(f"engines/{name}")
    for s in d["summary"]:
        print(f"{name:28s} {s['method']:8s} {s['ms_step']:.2f} ms/step {s['decode_j_per_token']:.3f} J/token "
              f"floor {s['floor_ms']:.2f} ms")
    for k in d.get("kernel_bw") or []:
        print(f"{name:28s} {k['method']:8s} attention kernels {k['kernel_ms']:.3f} ms/step "
              f"({k['kernel_ms_per_layer']:.3f} per layer), {k['of_copy_same_bytes']:.2f} of a copy of the same bytes")

print("\n== AdaKV's ragged store (adakv-kernel.json), batch 4, 16k, keep 0.25")
for r in (r for r in load("adakv-kernel.json") if r["part"] == "kernel"):
    print(f"{r['kernel']:12s} graph {r['graph_ms']:.4f} ms  max|err| vs float32 {r['max_abs_err']}  "
          f"segments {r['lengths_min']}-{r['lengths_max']} rows (mean {r['budget']})")
