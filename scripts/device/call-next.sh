#!/usr/bin/env bash
# The next H200 call (written 2026-12-03, session g, which had no device time left): what issues #27
# and #29 still need measured, each part under its own limit, all under outputs/h200g, packed into $OUT.
# Every part resumes (the sweeps skip what is recorded ok), so a second call continues where one stopped.
#   adakv    benchmarks/adakv_fast.py: the ragged store's flash path against its SDPA and float32
#            references, graph capture, ms per call vs dense flash; fast+adakv vs fast+full peak memory (#27)
#   methods  params/h200-methods.yaml: full, SnapKV, Expected Attention, KVzip, AdaKV(snapkv, EA) at keep
#            0.1 and 0.25, 16k, batch 16 and 1, fast (#27: J/token, TTFT, prefill J, peak memory)
#   reads    params/h200-reads.yaml at 16k: full, fp8, int4, KIVI k2v2/k4v2, Quest 2048, batch 1 and 16 (#29;
#            also the first CUDA run of Quest's chunk-aware select_pages under graph capture)
# Usage on the lent H200 (carry .whl and .whl-tf): . scripts/device/setup.sh && bash scripts/device/call-next.sh
# Set KVLAB_GIT_SHA to the commit carried: the device copy of .git can be stale.
set -u
out=outputs/h200g
mkdir -p "$out" "${OUT:-/tmp/out}"
part() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "=== $name rc=$? $(date -u +%T)"
  grep -v -i "warn" "$out/$name.log" | tail -n 30
}
part adakv 120 python3 benchmarks/adakv_fast.py --ctx 16384 --batch 4 --keep 0.25 --new-tokens 64 \
  --json-out "$out/adakv-fast.json"
part methods 240 python3 -m kvlab sweep params/h200-methods.yaml -o "$out/methods" --set time_budget_s=220 --no-progress
part reads 200 python3 -m kvlab sweep params/h200-reads.yaml -o "$out/reads" --set "ctx=[16384]" \
  --set time_budget_s=180 --no-progress
tar czf "${OUT:-/tmp/out}/h200g.tgz" "$out"
