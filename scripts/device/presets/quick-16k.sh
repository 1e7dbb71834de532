# One call's first look at 16k (about 7 minutes): eviction methods, the dense and int4 stores, the
# reads and the minimal step, one repeat each (no intervals).
#   methods  params/h200-methods.yaml: full, SnapKV, Expected Attention, KVzip at keep 0.1 on the fast
#            engine, 16k, batch 16 then 1
#   engines  benchmarks/engines.py at 16k, batch 16 on fast: full and int4-g64 fused: peak memory,
#            x_floor, kernel_bw
#   reads    params/h200-reads.yaml at 16k, batch 16: full, KIVI k2v2 and k4v2, Quest 2048
#   minimal  benchmarks/minimal_step.py: the gpt-fast-style step beside kvlab's fast step
DEFAULT_PARTS="methods engines reads minimal"
sweep_part methods 160 h200-methods methods
part engines 100 python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 32 --repeats 1 --max-decoders 1 \
  --methods full quanto4 --engines fast --compare-steps 0 --out "$out/engines-b16-fast.json"
sweep_part reads 100 h200-reads reads --set "ctx=[16384]" --set "batch=[16]" --set repeats=1 \
  --set "methods=[full, {method: kivi}, {method: kivi, key_bits: 4}, {method: quest, budget: 2048}]"
part minimal 45 python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 2 --steps 100 \
  --out "$out/minimal_step.json"
