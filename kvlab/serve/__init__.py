"""Serving under traffic: continuous batching over paged KV blocks, request traces, per-request
records and the serving metrics (TTFT, TPOT, ITL, E2E, goodput) computed from them."""
