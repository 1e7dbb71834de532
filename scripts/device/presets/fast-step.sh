# The fast step's own work at 16k (about 2.5 minutes).
#   attn     benchmarks/fast_attention.py: flash (head-major) vs the [B, C, Hkv, D] call (bit for bit,
#            and its copy kernels), flash with 8 splits, masked SDPA, cuDNN; µs, kernels, W per call
#   zeros    the same for flash and cuDNN at batch 16 over zero K/V (does the data move the power?)
#   minimal  benchmarks/minimal_step.py: kvlab's step beside the minimal step over the same random K/V,
#            3 s windows x 2 rounds alternating, work table and difference, kvlab with attention=cudnn
DEFAULT_PARTS="attn zeros minimal"
part attn 70 python3 benchmarks/fast_attention.py --ctx 16384 --batch 1 16 --splits 8 --seconds 1.5 \
  --out "$out/fast_attention.json"
part zeros 25 python3 benchmarks/fast_attention.py --ctx 16384 --batch 16 --fills zeros \
  --only flash cudnn --seconds 1.5 --out "$out/fast_attention_zeros.json"
part minimal 150 python3 benchmarks/minimal_step.py --batch 1 16 --ctx 16384 --seconds 3 --repeats 2 \
  --kv-fill random --variants attention=cudnn --out "$out/minimal_step.json"
