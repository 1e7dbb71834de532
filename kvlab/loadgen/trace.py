"""A serving workload (:mod:`kvlab.serve.workload`, built from a ``traffic:`` block) as the load
generator's rows: each request's send time and token-id prompt (token ids give every server the
same input lengths without a shared tokenizer)."""

from __future__ import annotations

from kvlab.errors import UserError
from kvlab.loadgen.client import TimedRequest
from kvlab.serve.traffic import parse_traffic
from kvlab.serve.workload import Workload, build_workload


def items_from_workload(workload: Workload) -> list[TimedRequest]:
    """Open-loop rows in arrival order; a closed-loop workload is refused (the client sends on a clock)."""
    if any(item.arrival_s is None for item in workload.items):
        raise UserError("the load generator replays open-loop arrivals (poisson, gamma, constant, burst, trace); "
                        "closed loop (users) runs in-process only")
    return [TimedRequest(f"r{k}", float(item.arrival_s), list(item.prompt_ids), int(item.output_len))
            for k, item in enumerate(workload.items)]


def fixed_items(requests: int, rate: float | None, input_tokens: int, output_tokens: int, *, seed: int = 0,
                vocab_size: int = 32000, tokenizer=None) -> list[TimedRequest]:
    """``requests`` of fixed lengths, Poisson at ``rate`` per second (None: all at once): the
    ``traffic:`` block ``{arrival: poisson, rate, requests, seed, lengths: {kind: fixed, ...}}``."""
    spec = parse_traffic({"arrival": "poisson" if rate else "burst", "rate": rate, "requests": requests,
                          "seed": seed, "lengths": {"kind": "fixed", "input": input_tokens, "output": output_tokens}})
    return items_from_workload(build_workload(spec, rate, tokenizer, vocab_size))
