"""Trace rows for a replay: :class:`~kvlab.loadgen.client.TimedRequest` s with token-id prompts of
exact lengths (any server then sees the same input lengths without a shared tokenizer)."""

from __future__ import annotations

import numpy as np

from kvlab.loadgen.client import TimedRequest


def poisson_trace(n: int, rate: float | None, input_tokens: int, output_tokens: int, *, seed: int = 0,
                  vocab_size: int = 32000) -> list[TimedRequest]:
    """``n`` requests of fixed lengths, Poisson arrivals at ``rate`` per second (None: all at t = 0),
    prompts of seeded random token ids in ``[100, vocab_size - 100)``."""
    if n < 1 or input_tokens < 1 or output_tokens < 1:
        raise ValueError("n, input_tokens and output_tokens must be >= 1")
    if rate is not None and rate <= 0:
        raise ValueError(f"rate={rate}: a positive rate, or None for all at once")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, n) if rate else np.zeros(n)
    arrivals = np.cumsum(gaps) - gaps[0]
    prompts = rng.integers(100, max(101, vocab_size - 100), size=(n, input_tokens))
    return [TimedRequest(f"r{i}", float(arrivals[i]), [int(t) for t in prompts[i]], output_tokens)
            for i in range(n)]


def from_rows(rows, *, seed: int = 0, vocab_size: int = 32000) -> list[TimedRequest]:
    """A trace from ``(arrival_s, input_tokens, output_tokens)`` rows (a CSV/JSONL trace, or the
    serving engine's traffic), prompts of seeded random token ids."""
    rng = np.random.default_rng(seed)
    return [TimedRequest(f"r{i}", float(t), [int(x) for x in rng.integers(100, max(101, vocab_size - 100), int(n_in))],
                         int(n_out)) for i, (t, n_in, n_out) in enumerate(rows)]
