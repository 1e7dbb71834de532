"""`kvlab loadgen`: replay a trace against any OpenAI-compatible URL (kvlab serve, vLLM, ...) and
write per-request records, the run's summary (TTFT/TPOT/ITL/E2E percentiles, throughput) and, over
the steady state, the local GPU's energy or the server's CPU time per request and per token."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("loadgen", help="replay a trace against an OpenAI-compatible server and time every token")
    p.add_argument("--target", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--out", help="folder for requests.jsonl, records.jsonl and manifest.json")
    p.add_argument("--model", help="model name to send (default: the first /v1/models lists)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions sends token-id prompts of exact length; chat sends text")
    p.add_argument("--requests", type=int, default=100, help="requests in the trace")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=32000, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (client side)")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid: its CPU time (with its children) over the steady state")
    p.add_argument("--gpu", default=None, help="a local CUDA device whose NVML energy counter to read, e.g. cuda:0")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlab.cli.loadgen_run import loadgen  # loads aiohttp and kvlab.serve: after argparse

    return loadgen(args)
