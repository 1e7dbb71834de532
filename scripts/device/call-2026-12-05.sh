#!/usr/bin/env bash
# This session's H200 calls (2026-12-05): what issues #27, #28 and #29 still need measured, as parts
# picked by PARTS, each under its own time limit (LIMIT_<part> overrides), all under outputs/h200i,
# packed into $OUT/h200i.tgz. The sweeps resume from their records, and each sweep warms every variant
# of a shape before measuring any, so a part is sized to finish its shape inside one call.
#   adakv     benchmarks/adakv_fast.py --parts kernel: the ragged store's flash path against its SDPA
#             and float32 references at the model's shape (#27, before any adakv run is trusted)
#   m16       params/h200-methods.yaml at batch 16, keep 0.1, 2 repeats, plus AdaKV(SnapKV) at keep 0.25,
#             prefilled 2 sequences at a time (#27: decode J/token, TTFT, prefill J, peak memory; the AdaKV
#             memory goal: an evicting prefill holds the whole batch's prompt K/V at its peak unless the
#             batch is prefilled a few rows at a time, and this fits an 80 GB card too)
#   m1        params/h200-methods.yaml at batch 1, keep 0.1 and 0.25, 2 repeats (#27)
#   reads     params/h200-reads.yaml at 16k, batch 1 and 16, 2 repeats: full, fp8, int4, KIVI k2v2/k4v2,
#             Quest 2048 (#29's goals; #28's int4/fp8 vs bf16 at batch 1 and 16)
#   mhf       params/h200-methods-hf.yaml: the methods on hf, keep 0.1, batch 1 (#27, both engines)
#   kernels   benchmarks/quant_attention.py's performance section, $VARIANTS (default fold_asm) (#28)
#   engines   benchmarks/engines.py, fast, batch 16: full, int4 and fp8 with $VARIANTS' first (#28)
#   minimal   benchmarks/minimal_step.py, batch 1 and 16, 5 s windows (#28)
#   kvzip     benchmarks/kvzip_cost.py at 16k, batch 2, 2 rows: KVzip's prefill by phase, the SDPA backend
#             of each call (#27: its 16k warm-up never finished on the H100; run before m16)
# Usage on the lent H200 (carry .whl and .whl-tf on a fresh machine):
#   . scripts/device/setup.sh && PARTS="adakv m16 kernels" bash scripts/device/call-2026-12-05.sh
# Set KVLAB_GIT_SHA to the commit carried (the device copy of .git can be stale).
set -u
out=outputs/h200i
mkdir -p "$out" "${OUT:-/tmp/out}"
PARTS=${PARTS:-"adakv m16 kernels"}
VARIANTS=${VARIANTS:-fold_asm}
part() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return;; esac
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1
  echo "=== $name rc=$? $(date -u +%T)"
  grep -v -i "warn\|attn_output = torch" "$out/$name.log" | tail -n 25
}
lim() { local v="LIMIT_$1"; echo "${!v:-$2}"; }
budget() { echo $(( $(lim "$1" "$2") - 25 )); }  # a sweep's own clean stop, inside its part's limit
SW="python3 -m kvlab sweep --no-progress"
nvidia-smi --query-gpu=name,uuid,driver_version,power.limit --format=csv,noheader
part adakv "$(lim adakv 60)" python3 benchmarks/adakv_fast.py --parts kernel --ctx 16384 --batch 4 --keep 0.25 \
  --json-out "$out/adakv-kernel.json"
part m16 "$(lim m16 450)" $SW params/h200-methods.yaml -o "$out/methods-b16" --set time_budget_s="$(budget m16 450)" \
  --set "batch=[16]" --set "keep=[0.1]" --set repeats=2 --set prefill_rows=2 \
  --set 'methods=[full, snapkv, expected_attention, kvzip, {method: adakv, scorer: snapkv}, {method: adakv, scorer: expected_attention}, {method: adakv, scorer: snapkv, keep: 0.25}]'
part reads "$(lim reads 400)" $SW params/h200-reads.yaml -o "$out/reads-16k" --set time_budget_s="$(budget reads 400)" \
  --set "ctx=[16384]"
part m1 "$(lim m1 150)" $SW params/h200-methods.yaml -o "$out/methods-b1" --set time_budget_s="$(budget m1 150)" \
  --set "batch=[1]" --set repeats=2
part mhf "$(lim mhf 120)" $SW params/h200-methods-hf.yaml -o "$out/methods-hf" --set time_budget_s="$(budget mhf 120)" \
  --set "batch=[1]" --set repeats=2
part kernels "$(lim kernels 60)" python3 benchmarks/quant_attention.py --skip correctness write --variants $VARIANTS \
  --out "$out/quant_attention.json"
part engines "$(lim engines 170)" python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 64 --repeats 1 \
  --max-decoders 1 --methods full quanto4 fp8 --engines fast --compare-steps 0 --kernel-variant "${VARIANTS%% *}" \
  --out "$out/engines-b16-fast.json"
part kvzip "$(lim kvzip 120)" python3 benchmarks/kvzip_cost.py --model llama-3.1-8b --weights synthetic --device cuda \
  --dtype bfloat16 --ctx 16384 --batch 2 --rows 2 --sdpa-backend flash --warmup 1 --json-out "$out/kvzip-cost.json"
part minimal "$(lim minimal 130)" python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 5 --steps 200 \
  --out "$out/minimal_step.json"
tar czf "${OUT:-/tmp/out}/h200i.tgz" "$out"
