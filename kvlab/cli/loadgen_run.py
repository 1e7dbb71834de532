"""`kvlab loadgen`'s work: every flag checked before a request is sent, then the replay and its
metrics (the run's files with --out)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil

from kvlab.errors import UserError
from kvlab.loadgen.meter import nvml_reader
from kvlab.loadgen.run import pick_counter, run_load
from kvlab.loadgen.trace import fixed_items


def check_args(args) -> None:
    """Every flag's problem, before a request is sent."""
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
        if not psutil.pid_exists(args.server_pid):
            raise UserError(f"--server-pid {args.server_pid}: no such process (the server's pid, for its CPU time)")
    if args.gpu is not None:
        if not args.gpu.startswith("cuda") or nvml_reader(args.gpu) is None:
            raise UserError(f"--gpu {args.gpu}: no NVML energy counter readable there; give a local CUDA device "
                            f"(cuda:N) or leave it out")


def loadgen(args) -> int:
    """``kvlab loadgen``: checks, the replay, its metrics printed (exit 3 if a request got no answer)."""
    check_args(args)
    items = fixed_items(args.requests, args.rate, args.input_tokens, args.output_tokens, seed=args.seed,
                        vocab_size=args.vocab_size)
    result = run_load(args.target, items, args.out, model=args.model, endpoint=args.endpoint,
                      counter=pick_counter(args.server_pid, args.gpu), max_concurrency=args.max_concurrency)
    print(json.dumps(result.metrics, indent=1))
    return 0 if result.metrics["completed"] == result.metrics["requests"] else 3
