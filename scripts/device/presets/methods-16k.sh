# The eviction methods, the reads and the fast step at 16k, 2 repeats (the sweeps resume from their
# records, and each warms every variant of a shape before measuring any, so a part is sized to finish
# its shape inside one call). VARIANTS picks the kernel variants (default fold_asm).
#   adakv    benchmarks/adakv_fast.py --parts kernel: the ragged store's flash path against its SDPA
#            and float32 references at the model's shape (before any adakv run is trusted)
#   m16      params/h200-methods.yaml at batch 16, keep 0.1, plus AdaKV(SnapKV) at keep 0.25, prefilled
#            2 sequences at a time (an evicting prefill holds the whole batch's prompt K/V at its peak
#            unless the batch is prefilled a few rows at a time; this fits an 80 GB card too)
#   reads    params/h200-reads.yaml at 16k, batch 1 and 16: full, fp8, int4, KIVI k2v2/k4v2, Quest 2048
#   m1       params/h200-methods.yaml at batch 1, keep 0.1 and 0.25
#   mhf      params/h200-methods-hf.yaml: the methods on hf, keep 0.1, batch 1
#   kernels  benchmarks/quant_attention.py's performance section, $VARIANTS
#   engines  benchmarks/engines.py, fast, batch 16: full, int4 and fp8 with $VARIANTS' first
#   kvzip    benchmarks/kvzip_cost.py at 16k, batch 2, 2 rows: KVzip's prefill by phase, the SDPA backend
#            of each call (run before m16: its 16k warm-up is long)
#   minimal  benchmarks/minimal_step.py, batch 1 and 16, 5 s windows
DEFAULT_PARTS="adakv m16 kernels"
VARIANTS=${VARIANTS:-fold_asm}
part adakv 60 python3 benchmarks/adakv_fast.py --parts kernel --ctx 16384 --batch 4 --keep 0.25 \
  --json-out "$out/adakv-kernel.json"
sweep_part m16 450 h200-methods methods-b16 --set "batch=[16]" --set "keep=[0.1]" --set repeats=2 --set prefill_rows=2 \
  --set 'methods=[full, snapkv, expected_attention, kvzip, {method: adakv, scorer: snapkv}, {method: adakv, scorer: expected_attention}, {method: adakv, scorer: snapkv, keep: 0.25}]'
sweep_part reads 400 h200-reads reads-16k --set "ctx=[16384]"
sweep_part m1 150 h200-methods methods-b1 --set "batch=[1]" --set repeats=2
sweep_part mhf 120 h200-methods-hf methods-hf --set "batch=[1]" --set repeats=2
part kernels 60 python3 benchmarks/quant_attention.py --skip correctness write --variants $VARIANTS \
  --out "$out/quant_attention.json"
part engines 170 python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 64 --repeats 1 \
  --max-decoders 1 --methods full quanto4 fp8 --engines fast --compare-steps 0 --kernel-variant "${VARIANTS%% *}" \
  --out "$out/engines-b16-fast.json"
part kvzip 120 python3 benchmarks/kvzip_cost.py --model llama-3.1-8b --weights synthetic --device cuda \
  --dtype bfloat16 --ctx 16384 --batch 2 --rows 2 --sdpa-backend flash --warmup 1 --json-out "$out/kvzip-cost.json"
part minimal 130 python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 5 --steps 200 \
  --out "$out/minimal_step.json"
