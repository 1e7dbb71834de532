"""The numbers of README.md derived from this folder: Quest's reads at 16k with the selection kernels
(kvlab's methods table, intervals over the repeats: kvlab.intervals), the reads at 32k, each setting's ITL against its byte
floor, the page selection's kernels against torch's ops, the sparse kernel's gather width, the anatomy
of a batch-1 step, and the int4/fp8 decode kernels at both launch geometries. The byte floor of a
decode step is the bytes it must read (16.06 GB of weights plus the KV it reads) over the copy
bandwidth measured in the same machine's kernel call (quant_attention_format.json).

    python reports/h100-2026-12-06b/derived.py
"""
from collections import defaultdict
from pathlib import Path

from kvlab.intervals import mean_interval, ratio_interval
from kvlab.records import load_records, read_json
from kvlab.reporting.methods import methods_display, methods_table

HERE = Path(__file__).parent
WEIGHTS = 16.06e9  # Llama-3.1-8B bf16 weights (kvlab models)
PAGE, BUDGET, DENSE_LAYERS, LAYERS = 16, 2048, 2, 32  # params/h200-reads.yaml's Quest


def load(path):
    return read_json(HERE / path)  # the file or its .xz twin


def kv_read(label: str, cache_bytes: float, full_bytes: float, ctx: int) -> float:
    """Bytes of KV one decode step reads. Quest (its cache_bytes count the page bounds too): of the
    full cache's K/V, its dense layers whole, the budget's share of the others, and every page's key
    min and max (2 of every 2 x PAGE rows of K and V)."""
    if not label.startswith("quest"):
        return cache_bytes
    per_layer = full_bytes / LAYERS
    sparse = LAYERS - DENSE_LAYERS
    return per_layer * (DENSE_LAYERS + sparse * BUDGET / ctx + sparse / PAGE)


copy_bw = load("quant_attention_format.json")["copy_GBps"] * 1e9
print(f"== copy bandwidth (calls 2-3's card): {copy_bw / 1e12:.2f} TB/s (read + write)")
for folder, ctx in (("reads-16k", 16384), ("reads-32k", 32768)):
    records = load_records(HERE / folder)
    print(f"\n== {folder}: runs per (setting, batch, status):",
          records.groupby(["label", "batch", "status"]).size().to_dict())
    for batch in sorted(records.batch.unique()):
        part = records[(records.batch == batch) & (records.status == "ok")]
        if "full" in set(part.label):
            print(f"-- batch {batch}: kvlab's methods table (95% Welch-log intervals over the repeats, none below 3 "
                  "runs a side)")
            print(methods_display(methods_table(part))[["method", "KV freed", "decode J/token vs full"]]
                  .to_string(index=False))
        means = part.groupby("label")[["itl_median_ms", "cache_bytes", "peak_mem_bytes", "decode_j_per_token"]].mean()
        full_kv = means.loc["full", "cache_bytes"] if "full" in means.index else ctx * batch * 131072
        print(f"{'setting':14s} {'J/tok':>6s} {'ITL ms':>7s} {'KV read GB':>10s} {'floor ms':>8s} {'x floor':>7s} "
              f"{'peak GB':>7s}")
        for label, row in means.iterrows():
            kv = kv_read(label, row.cache_bytes, full_kv, ctx)
            floor = (WEIGHTS + kv) / copy_bw * 1e3
            print(f"{label:14s} {row.decode_j_per_token:6.3f} {row.itl_median_ms:7.2f} {kv / 1e9:10.2f} {floor:8.2f} "
                  f"{row.itl_median_ms / floor:7.2f} {row.peak_mem_bytes / 1e9:7.1f}")
    failed = records[records.status != "ok"]
    for _, r in failed.drop_duplicates(["method", "batch"]).iterrows():
        print(f"failed ({(failed.method == r.method).sum()} runs): {r.method} batch {r.batch}: {str(r.error)[:110]}")

print("\n== Quest's page selection per layer call (quest_select.json, call 1's card): ms")
print(f"{'B':>3s} {'ctx':>6s} {'budget':>6s} {'torch':>7s} {'kernels':>7s} {'x':>5s} {'scores':>7s} {'topk':>7s} "
      f"{'top':>7s} {'top r1':>7s} {'top r4':>7s} {'append torch':>12s} {'append kernel':>13s} same pages")
for r in load("quest_select.json"):
    print(f"{r['batch']:3d} {r['length']:6d} {r['budget']:6d} {r['torch_ms']:7.4f} {r['fused_ms']:7.4f} "
          f"{r['ratio']:5.1f} {r['fused_scores_ms']:7.4f} {r['topk_ms']:7.4f} {r['top_kernel_ms']:7.4f} "
          f"{r['top_kernel_ms_radix1']:7.4f} {r['top_kernel_ms_radix4']:7.4f} {r['append_torch_ms']:12.4f} "
          f"{r['append_kernel_ms']:13.4f} {r['same_pages']}")

print("\n== the sparse read and KIVI's kernel at 16k (kivi_quest.json, call 1's card): ms per layer call")
for r in load("kivi_quest.json"):
    extra = f"  select {r['select_ms']:.4f} attend {r['attend_ms']:.4f}" if "select_ms" in r else ""
    print(f"B{r['batch']:<3d} {r['read']:30s} {r['ms']:.4f} ms {r['GB/s'] or 0:7.0f} GB/s rel err {r['rel_err']:.1e}"
          f"{extra}")

print("\n== anatomy of a batch-1 step at 16k on fast (anatomy-fast-16k.json, call 1's card; ms per step)")
table, meta = defaultdict(dict), {}
for r in load("anatomy-fast-16k.json"):
    table[r["category"]][r["method"]] = r["ms"]
    meta[r["method"]] = (r["wall_ms"], r["busy_ms"])
methods = list(meta)
print(f"{'category':22s}" + "".join(f"{m:>8s}" for m in methods))
for category, row in table.items():
    print(f"{category:22s}" + "".join(f"{row.get(m, 0.0):8.3f}" for m in methods))
print(f"{'GPU busy per step':22s}" + "".join(f"{meta[m][1]:8.3f}" for m in methods))
print(f"{'wall per step':22s}" + "".join(f"{meta[m][0]:8.3f}" for m in methods))

for name, what in (("quant_attention.json", "LaunchConfig's default geometry 64/4/2/4, call 1's card"),
                   ("quant_attention_format.json", "each format's own geometry (TUNED_CONFIGS), calls 2-3's card"),
                   ("quant_attention_warp2.json", "each format's own geometry, warp2 after da47c25, call 4's card")):
    data = load(name)
    print(f"\n== decode-attention kernels at 16k, {what}; copy {data['copy_GBps']:.0f} GB/s:"
          " ms per layer call (faster of eager and graph), fraction of copy bandwidth, error against the reference")
    seen = set()
    for r in data["performance"]:
        if r.get("label") not in ("bf16", "fp8", "int4-g64") or r.get("cap") not in (None, 16384):
            continue
        c = r["config"]
        key = (r["label"], r["batch"], r["variant"])
        if key in seen:  # the second block of batch-1 rows is the 32k-capacity case
            continue
        seen.add(key)
        best = min(r["kernel_ms"], r["kernel_graph_ms"])
        print(f"{r['label']:9s} B{r['batch']:<3d} {r['variant']:9s} {c['block_n']}/{c['num_warps']}/{c['num_stages']}/"
              f"{c['programs_per_sm']}  {best:.4f} ms  {r['of_copy_bw']:.2f} of copy  rel err {r['rel_err']:.1e}")

engines = load("engines-b16-warp2.json")
print(f"\n== fast engine, batch 16, 16k, int4 on {engines['kernel_variant']} (engines-b16-warp2.json, call 4's card;"
      f" copy {engines['copy_bandwidth_Bps'] / 1e12:.2f} TB/s)")
# recomputed from the rows through kvlab.intervals: the JSON's own "ci" of 2 runs is their range, no interval
joules = defaultdict(list)
for r in engines["rows"]:
    if r["status"] == "ok":
        joules[(r["method"], r["engine"])].append(r["decode_j_per_token"])
for r in engines["summary"]:
    j = mean_interval(joules[(r["method"], r["engine"])])
    print(f"{r['method']:8s} {r['ms_step']:.2f} ms/step, floor {r['floor_ms']:.2f} ms, {j.text(3)} J/token")
for (method, engine), js in joules.items():
    if method != "full" and ("full", engine) in joules:
        print(f"{engine}: {method} / full decode J/token: {ratio_interval(js, joules[('full', engine)]).text(3)}")
for k in engines.get("kernel_bw") or []:
    print(f"{k['method']:8s} attention kernels {k['kernel_ms']:.3f} ms/step, {k['of_copy_same_bytes']:.2f} of a copy"
          " of the same bytes")
