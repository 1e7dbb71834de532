#!/usr/bin/env bash
# The third 2026-12-05 session's H200 calls: what #27, #28 and #29 still lacked on the H200, as parts
# picked by PARTS (LIMIT_<part> overrides each limit), all under outputs/h200j, packed into
# $OUT/h200j.tgz. The sweeps resume from their records on a warm machine.
#   reads16   params/h200-reads.yaml at 16k, batch 1 and 16, 2 repeats: full, fp8, int4, KIVI k2v2/k4v2
#             (warp_asm, now the default), Quest 2048 (#29's engine step; #28's int4/fp8 vs bf16)
#   kernels   benchmarks/quant_attention.py's performance section, fold_asm and warp_asm (#28 on the H200)
#   anatomy   kvlab anatomy --engine fast at 16k, batch 1: full, Quest, KIVI, op by op (#29)
#   kvzip     benchmarks/kvzip_cost.py at 16k, batch 4 then 16, 2 rows a time (#27: the batch-16
#             warm-up's 192 s, by phase)
#   engines   benchmarks/engines.py, fast, batch 16: full, quanto4 and fp8 with warp_asm (#28)
#   reads32   params/h200-reads.yaml at 32k, batch 16: full, int4, KIVI k2v2, Quest (#29's 32k)
# Usage on the lent H200 (carry .whl and .whl-tf on a fresh machine):
#   . scripts/device/setup.sh && PARTS="reads16 kernels anatomy" bash scripts/device/call-2026-12-05b.sh
set -u
out=outputs/h200j
mkdir -p "$out" "${OUT:-/tmp/out}"
PARTS=${PARTS:-"reads16 kernels anatomy"}
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
part reads16 "$(lim reads16 400)" $SW params/h200-reads.yaml -o "$out/reads-16k" \
  --set time_budget_s="$(budget reads16 400)" --set "ctx=[16384]"
part kernels "$(lim kernels 60)" python3 benchmarks/quant_attention.py --skip correctness write \
  --variants fold_asm warp_asm --out "$out/quant_attention.json"
part anatomy "$(lim anatomy 90)" sh -c "python3 -m kvlab anatomy --model llama-3.1-8b --weights synthetic \
  --device cuda --ctx 16384 --engine fast --methods full quest kivi --json > $out/anatomy-fast-16k.json"
part kvzip "$(lim kvzip 300)" python3 benchmarks/kvzip_cost.py --model llama-3.1-8b --weights synthetic --device cuda \
  --dtype bfloat16 --ctx 16384 --batch 4 16 --rows 2 --sdpa-backend flash --warmup 1 --json-out "$out/kvzip-cost-b16.json"
part engines "$(lim engines 170)" python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 64 --repeats 1 \
  --max-decoders 1 --methods full quanto4 fp8 --engines fast --compare-steps 0 --kernel-variant warp_asm \
  --out "$out/engines-b16-fast.json"
part reads32 "$(lim reads32 500)" $SW params/h200-reads.yaml -o "$out/reads-32k" \
  --set time_budget_s="$(budget reads32 500)" --set "ctx=[32768]" --set "batch=[16]" \
  --set 'methods=[full, kvq-int4, {method: kivi}, {method: quest, budget: 2048}]'
tar czf "${OUT:-/tmp/out}/h200j.tgz" "$out"
