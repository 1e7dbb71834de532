# The serving sweeps (benchmarks/serve_rates.py over a params file's traffic: block). A sweep needs
# more than one 10-minute call: rerun its part (carrying outputs/serve back) and it resumes, measuring
# only the runs not complete in its folder.
#   smoke     params/serve-cpu.yaml's trace on the GPU (SmolLM2, one rate): the engine runs there
#   sharegpt  params/h100-serve-sharegpt.yaml (Llama-3.1-8B shape, ShareGPT lengths, 5 rates x 3)
#   small     the same with a 4 GB pool (memory binds)
#   mooncake  params/h100-serve-mooncake.yaml (long context, 5 rates x 3)
#   http-pair full and kvq-int4, three rates, in-process beside HTTP (`kvlab serve`), 3 repeats
#             (benchmarks/serve_http_overhead.py; arrivals alone span 4.2 min: 2 methods x 2 sides x 3 repeats x 64/rate s; server starts, warm-ups and drains not counted)
#   . scripts/device/setup.sh && bash scripts/device/campaign.sh serve smoke sharegpt
DEFAULT_PARTS="smoke sharegpt"
part smoke 120 python3 benchmarks/serve_rates.py params/serve-cpu.yaml -o "$out/smoke" \
  --set device=cuda --set threads=null --set "traffic.rate=[40]"
part sharegpt 580 python3 benchmarks/serve_rates.py params/h100-serve-sharegpt.yaml -o "$out/sharegpt"
part small 580 python3 benchmarks/serve_rates.py params/h100-serve-sharegpt.yaml -o "$out/small" \
  --set traffic.server.pool_gb=4
part mooncake 580 python3 benchmarks/serve_rates.py params/h100-serve-mooncake.yaml -o "$out/mooncake"
part http-pair 560 python3 benchmarks/serve_http_overhead.py --model llama-3.1-8b --weights synthetic --device cuda \
  --methods full kvq-int4 --rate 4 16 64 --requests 64 --input-tokens 1024 --output-tokens 128 --pool-gb 20 \
  --repeats 3 --out "$out/http-pair"
