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


def check_args(args) -> None:
    """Every flag's problem, before a request is sent."""
    from pathlib import Path

    from kvlab.errors import UserError

    for flag in ("requests", "input_tokens", "output_tokens"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.rate is not None and args.rate <= 0:
        raise UserError(f"--rate must be > 0 (leave it out to send all at once), got {args.rate}")
    if not args.target.startswith(("http://", "https://")):
        raise UserError(f"--target {args.target!r}: a base URL such as http://127.0.0.1:8000")
    if args.model is not None and not args.model.strip():
        raise UserError("--model is empty: name the served model, or leave it out to take the first /v1/models lists")
    if args.vocab_size < 2:
        raise UserError(f"--vocab-size {args.vocab_size}: the model's vocabulary size (prompt ids lie below it)")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise UserError(f"--max-concurrency must be >= 1 (leave it out for no limit), got {args.max_concurrency}")
    if args.out is not None and Path(args.out).is_file():
        raise UserError(f"--out {args.out} is a file: name a folder")
    if args.server_pid is not None:
        import psutil

        if not psutil.pid_exists(args.server_pid):
            raise UserError(f"--server-pid {args.server_pid}: no such process (the server's pid, for its CPU time)")
    if args.gpu is not None:
        from kvlab.loadgen.meter import nvml_reader

        if not args.gpu.startswith("cuda") or nvml_reader(args.gpu) is None:
            raise UserError(f"--gpu {args.gpu}: no NVML energy counter readable there; give a local CUDA device "
                            f"(cuda:N) or leave it out")


def run(args) -> int:
    import json

    from kvlab.loadgen.run import pick_counter, run_load
    from kvlab.loadgen.trace import fixed_items

    check_args(args)
    items = fixed_items(args.requests, args.rate, args.input_tokens, args.output_tokens, seed=args.seed,
                        vocab_size=args.vocab_size)
    result = run_load(args.target, items, args.out, model=args.model, endpoint=args.endpoint,
                      counter=pick_counter(args.server_pid, args.gpu), max_concurrency=args.max_concurrency)
    print(json.dumps(result.metrics, indent=1))
    return 0 if result.metrics["completed"] == result.metrics["requests"] else 3
