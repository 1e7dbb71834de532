"""kvlab's load generator: replay a trace against any OpenAI-compatible URL, time every streamed
chunk, and charge the steady state's energy (local GPU) or CPU time (a server's pid) to requests.

``client`` (the asyncio replay, raw per-request timings), ``trace`` (trace rows with token-id
prompts), ``metrics`` (latencies, summary, steady-state window: pure), ``meter`` (the counter
sampled beside the replay), ``run`` (one run: replay, summary, records and manifest).
"""
