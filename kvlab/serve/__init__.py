"""Serving under traffic: continuous batching over paged KV blocks, request traces, per-request
records and the serving metrics (TTFT, TPOT, ITL, E2E, goodput) computed from them."""

SERVED = ("full", "snapkv", "kvq-fp8", "kvq-int4", "kvq-int2")  # the methods the serving engine runs
