#!/usr/bin/env bash
# This session's H200 calls (2026-12-04): what issues #27, #28 and #29 still need measured, as parts
# picked by PARTS, each under its own time limit, all under outputs/h200h, packed into $OUT/h200h.tgz.
# The sweeps resume from their records, so a later call on the same warm machine continues them.
#   adakv       benchmarks/adakv_fast.py: ragged store's flash path vs its references, graph capture (#27)
#   methods16   params/h200-methods.yaml at batch 16 (fast; keep 0.1 and 0.25)                    (#27)
#   methods1    the same at batch 1, 3 repeats                                                       (#27)
#   methodshf   params/h200-methods-hf.yaml: the methods on hf, keep 0.1, batch 16 and 1           (#27)
#   reads16     params/h200-reads.yaml at 16k (full, fp8, int4, KIVI k2v2/k4v2, Quest 2048)         (#29)
#   reads32     the same at 32k                                                                      (#29)
#   minimal engines engines_hf kernels   benchmarks/i28_gpu.sh's parts                               (#28)
# Usage on the lent H200 (carry .whl and .whl-tf on a fresh machine):
#   . scripts/device/setup.sh && PARTS="adakv methods16" bash scripts/device/call-2026-12-04.sh
# Set KVLAB_GIT_SHA to the commit carried (the device copy of .git can be stale).
set -u
out=outputs/h200h
mkdir -p "$out" "${OUT:-/tmp/out}"
PARTS=${PARTS:-"adakv methods16"}
part() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return;; esac
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@" >> "$out/$name.log" 2>&1
  echo "=== $name rc=$? $(date -u +%T)"
  grep -v -i "warn" "$out/$name.log" | tail -n 25
}
lim() { local v="LIMIT_$1"; echo "${!v:-$2}"; }
SW="python3 -m kvlab sweep --no-progress"
part adakv "$(lim adakv 100)" python3 benchmarks/adakv_fast.py --ctx 16384 --batch 4 --keep 0.25 --new-tokens 64 \
  --json-out "$out/adakv-fast.json"
part methods16 "$(lim methods16 330)" $SW params/h200-methods.yaml -o "$out/methods-b16" --set time_budget_s=$(( $(lim methods16 330) - 25 )) --set "batch=[16]"
part methods1 "$(lim methods1 150)" $SW params/h200-methods.yaml -o "$out/methods-b1" --set time_budget_s=$(( $(lim methods1 150) - 25 )) --set "batch=[1]" --set repeats=3
part reads16 "$(lim reads16 330)" $SW params/h200-reads.yaml -o "$out/reads-16k" --set time_budget_s=$(( $(lim reads16 330) - 25 )) --set "ctx=[16384]"
part reads32 "$(lim reads32 300)" $SW params/h200-reads.yaml -o "$out/reads-32k" --set time_budget_s=$(( $(lim reads32 300) - 25 )) --set "ctx=[32768]"
part methodshf "$(lim methodshf 200)" $SW params/h200-methods-hf.yaml -o "$out/methods-hf" --set time_budget_s=$(( $(lim methodshf 200) - 25 ))
for p in minimal engines engines_hf kernels; do
  case " $PARTS " in *" $p "*) OUT=$out PARTS=$p PY=python3 bash benchmarks/i28_gpu.sh;; esac
done
tar czf "${OUT:-/tmp/out}/h200h.tgz" "$out"
