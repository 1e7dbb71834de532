"""The numbers of README.md derived from this folder: the methods tables with their CIs (#27), the
AdaKV memory goal and KVzip's break-even, the fast step beside the minimal one (#28), the attention
calls alone, KVzip's prefill by phase and the KIVI decode kernels side by side (#29).

    python reports/h200-2026-12-05/derived.py
"""
from pathlib import Path

from kvlab.records import load_records, read_json, read_jsonl
from kvlab.reporting.methods import methods_display, methods_table

HERE = Path(__file__).parent
COLUMNS = ["method", "KV freed", "peak freed GB", "decode J/token vs full", "TTFT vs full", "prefill J vs full"]


def load(path):
    return read_json(HERE / path)  # the file or its .xz twin


def means(folder):
    records = load_records(HERE / folder)
    cols = ["decode_j_per_token", "itl_median_ms", "ttft_s", "prefill_j", "peak_mem_bytes", "cache_bytes"]
    return records, records.groupby("label")[cols].mean()


for folder in ("methods-b16", "methods-b1", "methods-b1-k25", "methods-hf"):
    records, m = means(folder)
    first = records.iloc[0]
    print(f"\n== {folder}: {first.engine}, batch {first.batch}, {first.ctx} tokens, {first.gpu_name}"
          f" (95% Welch-log intervals over {records.repeat.nunique()} repeats; none below 3 runs a side)")
    print(methods_display(methods_table(records))[COLUMNS].to_string(index=False))
    print(f"{'setting':30s} {'dJ/token':>8s} {'ITL ms':>7s} {'TTFT s':>7s} {'prefill J':>9s} {'peak GB':>7s} {'KV GB':>6s}")
    for label, row in m.iterrows():
        print(f"{label:30s} {row.decode_j_per_token:8.4f} {row.itl_median_ms:7.2f} {row.ttft_s:7.2f} {row.prefill_j:9.0f} "
              f"{row.peak_mem_bytes / 1e9:7.1f} {row.cache_bytes / 1e9:6.2f}")

_, b16 = means("methods-b16")
full, ada = b16.loc["full"], b16.loc["adakv(snapkv) 25%"]
evicted = full.cache_bytes - ada.cache_bytes
goal = full.peak_mem_bytes - 0.8 * evicted
print(f"\n== #27 AdaKV memory goal, fast, batch 16, keep 0.25: peak {ada.peak_mem_bytes / 1e9:.1f} GB; full's"
      f" {full.peak_mem_bytes / 1e9:.1f} GB minus 0.8 x {evicted / 1e9:.2f} GB evicted = {goal / 1e9:.1f} GB;"
      f" freed {(full.peak_mem_bytes - ada.peak_mem_bytes) / evicted:.2f} of the evicted bytes")
for label in ("snapkv 10%", "expected_attention 10%", "adakv(snapkv) 10%"):
    print(f"   batch 16, {label}: decode J/token {b16.loc[label].decode_j_per_token / full.decode_j_per_token:.3f}x full's")

for folder in ("methods-b1", "methods-b1-k25", "methods-hf"):
    _, m = means(folder)
    kv = next(label for label in m.index if label.startswith("kvzip"))
    snap = next(label for label in m.index if label.startswith("snapkv"))
    extra = m.loc[kv].prefill_j - m.loc["full"].prefill_j
    saved = m.loc["full"].decode_j_per_token - m.loc[kv].decode_j_per_token
    print(f"== KVzip break-even ({folder}, {kv}): +{extra:.0f} J of prefill against full's, {saved:.3f} J/token saved"
          f" in decode -> {extra / saved:.0f} tokens; against {snap}: +{m.loc[kv].prefill_j - m.loc[snap].prefill_j:.0f} J,"
          f" decode {m.loc[kv].decode_j_per_token - m.loc[snap].decode_j_per_token:+.3f} J/token")

warm = read_jsonl(HERE / "methods-b16-kvzip-warmups/warmup.jsonl")
print("\n== batch-16 warm-ups of the first methods call (compile and graph capture included; not results)")
for r in warm:
    print(f"   {r['label']:24s} TTFT {r['ttft_s']:6.1f} s  prefill {r['prefill_s']:5.1f} s"
          f"  host CPU in prefill {r['prefill_host_process_cpu_ms'] / 1e3:6.1f} s")

print("\n== KVzip's prefill by phase (benchmarks/kvzip_cost.py, batch 2, 16k, flash)")
for r in load("kvzip-cost.json"):
    print(f"   {r['method']:6s} prefill {r['prefill_s']:5.2f} s = context {r['context_s']:.2f} + reconstruction"
          f" {r['reconstruction_s']:.2f} (scoring {r['scoring_s']:.2f}); forwards {len(r['forwards'])},"
          f" tokens {r['forward_tokens']}, SDPA calls {r['sdpa_calls']} (K/V repeated {r['repeated_kv_calls']}),"
          f" peak {r['peak_mem_bytes'] / 2**30:.1f} GiB")

print("\n== #28 the fast step beside the minimal one (benchmarks/minimal_step.py, random K/V, 2 x 3 s windows)")
for b in load("step/minimal_step.json")["batches"]:
    cudnn = next(v for v in b["variants"] if v["variant"] == "attention=cudnn")
    print(f"   batch {b['batch']:2d}: kvlab {b['kvlab_ms_step']:.3f} ms {b['kvlab_j_per_token']:.4f} J/token"
          f" {b['kvlab_mean_power_w']:.0f} W | minimal {b['minimal_ms_step']:.3f} ms {b['minimal_j_per_token']:.4f}"
          f" {b['minimal_mean_power_w']:.0f} W | kvlab attention=cudnn {cudnn['ms_step']:.3f} ms"
          f" {cudnn['j_per_token']:.4f} J/token | floor {b['floor_ms']:.2f} ms;"
          f" kernels per step kvlab {b['kernel_totals']['kvlab']['kernels']:.0f}, minimal {b['kernel_totals']['minimal']['kernels']:.0f}")
    kv, mini = b["work"]["kvlab"], b["work"]["minimal"]
    for work in sorted(set(kv) | set(mini)):
        delta = kv.get(work, {"us": 0})["us"] - mini.get(work, {"us": 0})["us"]
        if abs(delta) >= 20:
            print(f"      {work:32s} kvlab - minimal {delta:+8.1f} us/step")

print("\n== attention calls alone (benchmarks/fast_attention.py, 16k, random K/V)")
for r in load("step/fast_attention.json")["rows"]:
    print(f"   batch {r['batch']:2d} {r['variant']:11s} {r['us_per_call']:7.1f} us {r['GB/s']:6.0f} GB/s"
          f" {r['mean_power_w']:4.0f} W  err {r['max_err']:.1e}  head-major flash == old layout: {r['flash_equals_bchd']}")

print("\n== #29 KIVI decode kernels, one layer call, 16k (benchmarks/kivi_quest.py --kivi-variants split warp_asm)")
rows = load("kivi-warp-kernel.json")
for r in rows:
    if r["read"] == "flash-bf16":
        bf16 = r
        print(f"   batch {r['batch']:2d} flash bf16 {r['ms']:.4f} ms")
        continue
    print(f"   batch {r['batch']:2d} {r['read']:32s} {r['variant']:8s} {r['ms']:.4f} ms  {r['GB/s']:6.0f} GB/s"
          f"  {r['ms'] / bf16['ms']:.2f}x bf16's time for {r['bytes'] / bf16['bytes']:.2f}x its bytes  err {r['rel_err']:.1e}")
