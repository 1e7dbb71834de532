"""`kvlab serve`: an OpenAI-compatible HTTP server over the serving engine, one cache method per
server (`kvlab serve --model smollm2-135m --method snapkv --keep 0.25 --port 8000`)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the serving engine")
    p.add_argument("--params", help="YAML file whose keys map onto the flags (model, method, policy, pool_gb, ...); "
                                    "flags given win")
    p.add_argument("--model", help="preset name or local model folder")
    p.add_argument("--weights", choices=["real", "synthetic"], default=None)
    p.add_argument("--device", default=None, help="cpu (default) or cuda[:N]")
    p.add_argument("--method", default=None, help="the cache method (see `kvlab policies`; default full)")
    p.add_argument("--keep", type=float, help="eviction methods: fraction of prompt positions kept, in (0, 1]")
    p.add_argument("--bits", type=int, help="quantized methods: bits per stored element")
    p.add_argument("--group-size", type=int, help="quantized methods: elements per scale")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any other policy parameter, value parsed as YAML (repeatable)")
    p.add_argument("--pool-gb", type=float, help="KV block pool size in GB (default: 1 on CPU, the GPU's free "
                                                  "memory after the weights on CUDA)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, help="requests in the running batch at most (default: the engine's)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens per scheduler step, prefill chunks included (default: the engine's)")
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000)")
    p.add_argument("--max-in-flight", type=int, help="requests held at once; more are refused with 503")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlab.cli.serve_run import serve  # loads torch and aiohttp: after argparse

    return serve(args)
