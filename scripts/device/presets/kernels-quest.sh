# The decode kernels' variants and geometries, Quest's page selection and the reads at 16k.
#   kernels   benchmarks/quant_attention.py, correctness and timing at LaunchConfig's default geometry:
#             warp_asm beside warp2_asm
#   kgeom     the same timings at each format's own geometry (TUNED_CONFIGS: what the engines run)
#   kgeom2    correctness and timing at each format's own geometry: warp_asm beside warp2_asm
#   engines2  if kgeom2's warp2_asm error at batch 16 and 32 is within 2x warp_asm's: benchmarks/engines.py,
#             fast, batch 16, 16k, full beside kvlab's int4 cache on warp2_asm, 2 repeats
#   qsel      benchmarks/quest_select.py: torch's page selection against the scoring and top-pages
#             kernels, the top kernel's radix widths, the bounds' append
#   kq        benchmarks/kivi_quest.py at 16k, batch 1 and 16: Quest 2048 with 16, 32 and 64 tokens
#             gathered per iteration, KIVI's warp_asm beside flash
#   anatomy   kvlab anatomy --engine fast at 16k, batch 1: full, Quest, KIVI, op by op
#   reads16q  params/h200-reads.yaml at 16k, batch 1 and 16, 2 repeats: full and Quest 2048
DEFAULT_PARTS="kernels qsel kq anatomy"
part kernels 150 python3 benchmarks/quant_attention.py --skip write --geometry default \
  --variants warp_asm warp2_asm --out "$out/quant_attention.json"
part kgeom 90 python3 benchmarks/quant_attention.py --skip correctness write --geometry format \
  --variants warp_asm warp2_asm --out "$out/quant_attention_format.json"
part kgeom2 150 python3 benchmarks/quant_attention.py --skip write --geometry format \
  --variants warp_asm warp2_asm --out "$out/quant_attention_warp2.json"
warp2_ok() {  # warp2_asm's error at batch 16 and 32 (int4-g64, 16k) within 2x warp_asm's
  python3 - "$out/quant_attention_warp2.json" <<'PY'
import sys
from kvlab.records import read_json
rows = [r for r in read_json(sys.argv[1]).get("performance", [])
        if r.get("label") == "int4-g64" and r.get("batch") in (16, 32) and r.get("capacity") == 16384]
err = {(r["variant"], r["batch"]): r["rel_err"] for r in rows}
ok = all(err.get(("warp2_asm", b), 1) <= 2 * err.get(("warp_asm", b), 0) for b in (16, 32))
print("warp2_asm error", err, "ok" if ok else "too large: engines2 skipped")
sys.exit(0 if ok else 1)
PY
}
if selected engines2 && warp2_ok; then
  part engines2 220 python3 benchmarks/engines.py --batch 16 --ctx 16384 --new-tokens 64 --repeats 2 \
    --max-decoders 1 --methods full quanto4 --engines fast --compare-steps 0 --prefill-rows 4 \
    --kernel-variant warp2_asm --out "$out/engines-b16-warp2.json"
fi
part qsel 100 python3 benchmarks/quest_select.py --out "$out/quest_select.json"
part kq 150 python3 benchmarks/kivi_quest.py --lengths 16384 --batches 1 16 --skip fused \
  --kivi-variants warp_asm --budgets 2048 --quest-tokens-per-iter 16 32 64 --out "$out/kivi_quest.json"
part anatomy 120 sh -c "python3 -m kvlab anatomy --model llama-3.1-8b --weights synthetic \
  --device cuda --ctx 16384 --engine fast --methods full quest kivi --json > $out/anatomy-fast-16k.json"
sweep_part reads16q 420 h200-reads reads-16k --set "ctx=[16384]" --set 'methods=[full, {method: quest, budget: 2048}]'
