#!/usr/bin/env bash
# The session's one H200 call of 2026-12-03 (f): what issues #27, #28 and #29 could measure in one
# 10-minute command, each part under its own limit, all under outputs/h200f, packed into $OUT:
#   methods  params/h200-methods.yaml: full, SnapKV, Expected Attention, KVzip at keep 0.1 on the fast
#            engine, 16k, batch 16 then 1 (#27)
#   engines  benchmarks/engines.py at 16k, batch 16 on fast: full (its prefill now writes straight
#            into the static store) and int4-g64 fused: peak memory, x_floor, kernel_bw (#28)
#   reads    params/h200-reads.yaml at 16k, batch 16: full, KIVI k2v2 and k4v2, Quest 2048 (#29)
#   minimal  benchmarks/minimal_step.py: the gpt-fast-style step beside kvlab's fast step (#28)
# Usage on the lent H200 (carry .whl and .whl-tf): . scripts/device/setup.sh && bash scripts/device/call-2026-12-03f.sh
set -u
out=outputs/h200f
mkdir -p "$out" "${OUT:-/tmp/out}"
part() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "=== $name rc=$? $(date -u +%T)"
  grep -v -i "warn" "$out/$name.log" | tail -n 30
}
part methods 160 python3 -m kvlab sweep params/h200-methods.yaml -o "$out/methods" --set time_budget_s=140 --no-progress
part engines 100 python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 32 --repeats 1 --max-decoders 1 \
  --methods full quanto4 --engines fast --compare-steps 0 --out "$out/engines-b16-fast.json"
part reads 100 python3 -m kvlab sweep params/h200-reads.yaml -o "$out/reads" --set "ctx=[16384]" --set "batch=[16]" \
  --set repeats=1 --set "methods=[full, {method: kivi}, {method: kivi, key_bits: 4}, {method: quest, budget: 2048}]" \
  --set time_budget_s=85 --no-progress
part minimal 45 python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 2 --steps 100 \
  --out "$out/minimal_step.json"
tar czf "${OUT:-/tmp/out}/h200f.tgz" "$out"
