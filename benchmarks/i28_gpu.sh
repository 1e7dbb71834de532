#!/usr/bin/env bash
# Issue #28's H200 measurements in one device call (< 10 min), each part under its own time limit,
# in order of priority; every part writes its JSON and log under $OUT (default ./out-i28):
#   quality   SmolLM2 gold NLL, hf vs fast (and hf1, the noise yardstick), full/kvq-int4/kvq-fp8 at 1k/2k/4k
#   engines   Llama-3.1-8B shape, 16k, batch 16: fast (full, quanto4 = int4-g64 fused, fp8); engines_hf: hf (full):
#             ms/step, x_floor, peak memory (fast prefills into its store now), kernel_bw rows
#             (one step's attention kernels as a fraction of a copy of the same bytes)
#   minimal   the gpt-fast-style step beside kvlab's fast step, batch 1 and 16: ms/step, J/token,
#             kernel tables (minimal_step.json)
#   kernels   benchmarks/quant_attention.py performance section: of_copy_same_bytes, x_floor per format/batch
# PARTS="quality minimal" picks parts. Usage: bash benchmarks/i28_gpu.sh
set -u
OUT=${OUT:-out-i28}
mkdir -p "$OUT"
PY=${PY:-python}
PARTS=${PARTS:-"quality engines engines_hf minimal kernels"}
run() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  case " $PARTS " in *" $name "*) ;; *) return;; esac
  echo "=== $name (limit ${limit}s) $(date -u +%T)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? $(date -u +%T)"
  grep -v -i "warn" "$OUT/$name.log" | tail -n 45
}
run quality 150 $PY benchmarks/quality_engines.py --device cuda --lengths 1024 2048 4096 --depths 0.1 0.5 0.9 \
  --samples 1 --out "$OUT/quality_engines.json"
run engines 160 $PY benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 32 --repeats 1 --max-decoders 1 \
  --methods full quanto4 fp8 --engines fast --compare-steps 0 --out "$OUT/engines-b16-fast.json"
run engines_hf 75 $PY benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 32 --repeats 1 \
  --methods full --engines hf --compare-steps 0 --no-kernel-bw --out "$OUT/engines-b16-hf.json"
run minimal 130 $PY benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 5 --steps 200 \
  --out "$OUT/minimal_step.json"
run kernels 55 $PY benchmarks/quant_attention.py --skip correctness write --variants fold_asm \
  --out "$OUT/quant_attention.json"
