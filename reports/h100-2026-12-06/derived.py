"""The numbers of README.md derived from this folder: the reads sweep's ratios with their CIs (kvlab's
methods table) beside the 2026-12-05 H100 sweep of the same params with KIVI's split kernel, each
setting's ITL against its byte floor, the kernels side by side, the engines benchmark, the anatomy of a
batch-1 step and KVzip's prefill by phase. The byte floor of a decode step is the bytes it must read
(16.06 GB of weights plus the KV it reads) over the copy bandwidth measured in the same call
(engines-b16-fast.json).

    python reports/h100-2026-12-06/derived.py
"""
from collections import defaultdict
from pathlib import Path

from kvlab.records import load_records, read_json
from kvlab.reporting.methods import methods_display, methods_table

HERE = Path(__file__).parent
EARLIER = HERE.parent / "h100-2026-12-05"
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


engines = load("engines-b16-fast.json")
copy_bw = engines["copy_bandwidth_Bps"]
print(f"== copy bandwidth in the engines call: {copy_bw / 1e12:.2f} TB/s (read + write)")
records = load_records(HERE / "reads-16k")
earlier = load_records(EARLIER / "reads-16k")
print("runs per (setting, batch):", records.groupby(["label", "batch"]).size().to_dict())
for batch in (1, 16):
    part = records[records.batch == batch]
    print(f"\n== reads-16k, batch {batch}: kvlab's methods table (95% Welch-log intervals over the repeats;"
          " none below 3 runs a side)")
    print(methods_display(methods_table(part))[["method", "KV freed", "decode J/token vs full", "TTFT vs full"]]
          .to_string(index=False))
    old = earlier[earlier.batch == batch].groupby("label")["decode_j_per_token"].mean()
    old = old / old["full"]
    means = part.groupby("label")[["itl_median_ms", "cache_bytes", "peak_mem_bytes", "decode_j_per_token"]].mean()
    floor_full = (WEIGHTS + means.loc["full", "cache_bytes"]) / copy_bw * 1e3
    print(f"{'setting':14s} {'J/tok':>6s} {'vs full':>7s} {'12-05':>6s} {'ITL ms':>7s} {'KV read GB':>10s} "
          f"{'floor ms':>8s} {'x floor':>7s} {'peak GB':>7s}")
    for label, row in means.iterrows():
        kv = kv_read(label, row.cache_bytes, means.loc["full", "cache_bytes"])
        floor = (WEIGHTS + kv) / copy_bw * 1e3
        ratio = row.decode_j_per_token / means.loc["full", "decode_j_per_token"]
        print(f"{label:14s} {row.decode_j_per_token:6.3f} {ratio:7.3f} {old.get(label, float('nan')):6.3f} "
              f"{row.itl_median_ms:7.2f} {kv / 1e9:10.2f} {floor:8.2f} {row.itl_median_ms / floor:7.2f} "
              f"{row.peak_mem_bytes / 1e9:7.1f}")
    print(f"(full's byte floor {floor_full:.2f} ms)")

print("\n== decode-attention kernels alone, 16k, Llama-3.1-8B attention shape, default geometry (64/4/2/4):"
      " ms per layer call (faster of eager and graph), fraction of copy bandwidth and of a copy of the same bytes")
seen = set()
for r in load("quant_attention.json")["performance"]:
    if r.get("label") not in ("bf16", "fp8", "int4-g64") or r.get("cap") not in (None, 16384):
        continue
    key = (r["label"], r["batch"], r["config"]["variant"])
    if key in seen:  # the second block of batch-1 rows is the 32k-capacity case
        continue
    seen.add(key)
    best = min(r["kernel_ms"], r["kernel_graph_ms"])
    print(f"{r['label']:9s} B{r['batch']:<3d} {r['config']['variant']:9s} {best:.4f} ms  "
          f"{r['of_copy_bw']:.2f} of copy  {r['of_copy_same_bytes']:.2f} of same bytes")

print("\n== fast engine, batch 16, 16k, warp_asm kernels (engines-b16-fast.json; full ran out of memory)")
for row in engines["rows"]:
    if row["status"] != "ok":
        print(f"{row['method']:8s} repeat {row['repeat']}: {row['error'][:60]}")
for s in engines["summary"]:
    print(f"{s['method']:8s} {s['ms_step']:.2f} ms/step {s['decode_j_per_token']:.3f} J/token floor {s['floor_ms']:.2f} ms")
for k in engines.get("kernel_bw") or []:
    print(f"{k['method']:8s} attention kernels {k['kernel_ms']:.3f} ms/step, {k['of_copy_same_bytes']:.2f} of a copy"
          " of the same bytes")

print("\n== anatomy of a batch-1 step at 16k on fast (ms per step, 8 profiled steps)")
table, meta = defaultdict(dict), {}
for r in load("anatomy-fast-16k.json"):
    table[r["category"]][r["method"]] = r["ms"]
    meta[r["method"]] = r["wall_ms"]
methods = list(meta)
print(f"{'category':22s}" + "".join(f"{m:>8s}" for m in methods))
for category, row in table.items():
    print(f"{category:22s}" + "".join(f"{row.get(m, 0.0):8.3f}" for m in methods))
print(f"{'wall per step':22s}" + "".join(f"{meta[m]:8.3f}" for m in methods))

print("\n== KVzip's prefill by phase (kvzip-cost-b16.json)")
for r in load("kvzip-cost-b16.json"):
    print(f"{r['method']:6s} batch {r['batch']:2d} rows {r['rows']}: prefill {r['prefill_s']:6.2f} s (context "
          f"{r['context_s']:.2f}, reconstruction {r['reconstruction_s']:.2f}, of it scoring {r['scoring_s']:.2f}), "
          f"peak {r['peak_mem_bytes'] / 2**30:.1f} GiB")
