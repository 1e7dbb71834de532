"""The numbers of README.md derived from this folder's JSON rather than printed by the benchmarks:
the kernel tune table, the step breakdowns (the fold kernel counted as attention: the on-device
tables filed it under "other ops", fixed since), throughput at batch 32, and both capacity lines per
config (allocated and reserved peaks, kvlab.capacity's arithmetic).

    python reports/h200-2026-12-03e/derived.py
"""
from pathlib import Path

from kvlab.capacity import compression_step_cost, fit_peaks, max_batch
from kvlab.records import read_json, read_jsonl

HERE = Path(__file__).parent
GB = 1e9


def load(path):
    return read_json(HERE / path)  # the file or its .xz twin


def best_ms(r):
    return min(r.get("kernel_ms", 9e9), r.get("kernel_graph_ms", 9e9))


print("== kernels at 16k, Llama-3.1-8B attention shape (kernels/tune.json): ms, GB/s (of copy bandwidth)")
tune = load("kernels/tune.json")
ok = [r for r in tune["tune"] if r["status"] == "ok"]
for label, before in (("fp8", "split"), ("int4-g64", "fold_asm")):
    won = tune["winners"][label]["config"]
    for batch in (1, 16, 32):
        rs = [r for r in ok if r["label"] == label and r["batch"] == batch]
        default = next(r for r in rs if r["config"] == {"block_n": 64, "num_warps": 4, "num_stages": 2,
                                                         "programs_per_sm": 4, "variant": before})
        winner = next(r for r in rs if r["config"] == won)
        top = min(rs, key=best_ms)
        print(f"{label:9s} B{batch:<3d} default ({before} 64/4/2/4) {best_ms(default):.3f} ms "
              f"{default['kernel_GBps']:.0f} GB/s ({default['of_copy_bw']:.2f}) | winner {best_ms(winner):.3f} ms "
              f"{winner['kernel_GBps']:.0f} GB/s ({winner['of_copy_bw']:.2f}) | fastest here {best_ms(top):.3f} ms "
              f"({top['of_copy_bw']:.2f}) | winner rel err {winner['rel_err']:.1e}")
print(f"copy bandwidth {tune['copy_GBps']:.0f} GB/s (read + write)")

print("\n== batch-16 step on the fast engine, profiled (engines/engines-b16-profile.json), ms per step")
b16 = load("engines/engines-b16-profile.json")
walls = {s["method"]: s["ms_step"] for s in b16["summary"]}
for p in b16["profiles"]:
    # the device filed the fold kernel under "other ops" (the reduce kernel already under attention)
    fold = sum(t["ms"] for t in p["top"] if t["op"] == "_decode_fold_kernel")
    cat = dict(p["by_category"])
    cat["attention"] += fold
    cat["other ops"] -= fold
    parts = ", ".join(f"{k} {v:.2f}" for k, v in cat.items() if v)
    print(f"{p['method']:8s} unprofiled {walls[p['method']]:.2f}, profiled wall {p['wall_ms']:.2f}, "
          f"kernels {p['busy_ms']:.2f}: {parts}")

print("\n== batch 32, 16k (engines/engines-b32-fast.json): tokens/s = 32 / ms per step")
for s in load("engines/engines-b32-fast.json")["summary"]:
    print(f"{s['method']:8s} {s['ms_step']:.2f} ms/step -> {32e3 / s['ms_step']:.0f} tokens/s, "
          f"{s['decode_j_per_token']:.3f} J/token, floor {s['floor_ms']:.2f} ms")

print("\n== capacity on the fast engine (capacity/capacity-fast-*.json): both lines, usable at load")
for ctx in ("16k", "32k"):
    cap = load(f"capacity/capacity-fast-{ctx}.json")
    for fit in cap["fits"]:
        rows = [r for r in cap["rows"] if r["config"] == fit["config"] and r["phase"] == "fit" and r["status"] == "ok"]
        reserved = fit_peaks([(r["batch"], r["peak_mem_reserved_bytes"]) for r in rows])
        usable = fit["usable_bytes"]
        print(f"{ctx} {fit['config']:24s} allocated {fit['intercept_bytes'] / GB:.2f} + {fit['slope_bytes'] / GB:.3f} "
              f"GB/seq -> {fit['predicted_max_batch']}; reserved {reserved.intercept / GB:.2f} + "
              f"{reserved.slope / GB:.3f} GB/seq -> {max_batch(reserved, usable)}")
    for r in cap["rows"]:
        if r["phase"] != "fit":
            seen = (f"allocated {r['peak_mem_bytes'] / GB:.2f} GB (line {r['predicted_peak_bytes'] / GB:.2f}), "
                    f"reserved {r['peak_mem_reserved_bytes'] / GB:.2f} GB" if r["status"] == "ok" else r["error"][:70])
            cap_text = f" cap {r['memory_cap_bytes'] / GB:.2f} GB" if r.get("memory_cap_bytes") else ""
            print(f"  {r['config']:24s} {r['phase']:8s} batch {r['batch']:3d} {r['status']:4s}{cap_text}: {seen}")

print("\n== decode-time compression, 2k prompt + 8192 new tokens, hf (h200-decoding/records.jsonl)")
for r in read_jsonl(HERE / "h200-decoding/records.jsonl"):
    cost = compression_step_cost(r["itl_ms"], 512)
    print(f"{r['label']}: peak {r['peak_mem_bytes'] / GB:.2f} GB, cache rows at the end "
          f"{r['cache_final_physical_tokens']} ({r['cache_final_bytes'] / GB:.3f} GB), ITL median "
          f"{r['itl_median_ms']:.1f} ms; eviction steps {[round(x) for x in cost['at_interval_ms']]} ms "
          f"(others' median {cost['other_median_ms']:.1f}, mean extra {cost['extra_ms']:.1f} ms)")
