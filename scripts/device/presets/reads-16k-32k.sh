# The reads at 16k and 32k, their kernels, the fast step's anatomy and KVzip's prefill by phase.
#   reads16  params/h200-reads.yaml at 16k, batch 1 and 16, 2 repeats: full, fp8, int4, KIVI k2v2/k4v2,
#            Quest 2048
#   kernels  benchmarks/quant_attention.py's performance section, fold_asm and warp_asm
#   anatomy  kvlab anatomy --engine fast at 16k, batch 1: full, Quest, KIVI, op by op
#   kvzip    benchmarks/kvzip_cost.py at 16k, batch 4 then 16, 2 rows a time (the batch-16 warm-up, by
#            phase)
#   engines  benchmarks/engines.py, fast, batch 16: full, quanto4 and fp8 with warp_asm
#   reads32  params/h200-reads.yaml at 32k, batch 16: full, int4, KIVI k2v2, Quest
DEFAULT_PARTS="reads16 kernels anatomy"
sweep_part reads16 400 h200-reads reads-16k --set "ctx=[16384]"
part kernels 60 python3 benchmarks/quant_attention.py --skip correctness write \
  --variants fold_asm warp_asm --out "$out/quant_attention.json"
part anatomy 90 sh -c "python3 -m kvlab anatomy --model llama-3.1-8b --weights synthetic \
  --device cuda --ctx 16384 --engine fast --methods full quest kivi --json > $out/anatomy-fast-16k.json"
part kvzip 300 python3 benchmarks/kvzip_cost.py --model llama-3.1-8b --weights synthetic --device cuda \
  --dtype bfloat16 --ctx 16384 --batch 4 16 --rows 2 --sdpa-backend flash --warmup 1 --json-out "$out/kvzip-cost-b16.json"
part engines 170 python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 64 --repeats 1 \
  --max-decoders 1 --methods full quanto4 fp8 --engines fast --compare-steps 0 --kernel-variant warp_asm \
  --out "$out/engines-b16-fast.json"
sweep_part reads32 500 h200-reads reads-32k --set "ctx=[32768]" --set "batch=[16]" \
  --set 'methods=[full, kvq-int4, {method: kivi}, {method: quest, budget: 2048}]'
