"""A traffic spec turned into requests: arrival times, prompts of real text at the drawn lengths,
and output lengths (enforced: the engine ignores EOS and stops at exactly that many tokens)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from kvlab.serve import sharegpt
from kvlab.serve.traffic import MOONCAKE, TrafficError, TrafficSpec, arrival_times, lognormal_from_mean_p99

TRACE_COLUMNS = {  # accepted names for (arrival, input, output), as the public traces spell them
    "arrival": ("arrival_s", "timestamp", "TIMESTAMP", "time"),
    "input": ("input_tokens", "input_length", "ContextTokens", "prompt_tokens"),
    "output": ("output_tokens", "output_length", "GeneratedTokens", "completion_tokens"),
}


@dataclass
class WorkItem:
    prompt_ids: list[int]
    output_len: int
    arrival_s: float | None  # None: closed loop, sent when a user's previous request finishes


@dataclass
class Workload:
    items: list[WorkItem]
    users: int | None = None  # closed loop
    meta: dict = field(default_factory=dict)


def read_trace(path: str) -> list[tuple[float, int, int]]:
    """``(arrival seconds from the first, input tokens, output tokens)`` rows of a CSV or JSONL trace.
    Timestamps above 1e6 or named ``timestamp`` in a JSONL (Mooncake) are read as milliseconds."""
    text = Path(path).read_text()
    rows = ([json.loads(line) for line in text.splitlines() if line.strip()] if path.endswith(".jsonl")
            else list(csv.DictReader(text.splitlines())))
    if not rows:
        raise TrafficError(f"trace {path} holds no rows")
    cols = {}
    for role, names in TRACE_COLUMNS.items():
        found = [n for n in names if n in rows[0]]
        if not found:
            raise TrafficError(f"trace {path}: no {role} column; name it one of {', '.join(names)}")
        cols[role] = found[0]
    times = np.array([_seconds(r[cols["arrival"]]) for r in rows], dtype=float)
    if cols["arrival"] == "timestamp" and path.endswith(".jsonl"):
        times = times / 1000.0  # Mooncake's traces count milliseconds
    times -= times.min()
    return [(float(t), int(r[cols["input"]]), int(r[cols["output"]])) for t, r in zip(times, rows, strict=True)]


def _seconds(value) -> float:
    try:
        return float(value)
    except ValueError:  # Azure's traces: "2023-11-16 18:15:46.6805900"
        return np.datetime64(str(value).strip()[:26]).astype("datetime64[us]").astype(float) / 1e6


def draw_lengths(spec: TrafficSpec, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    lengths = spec.lengths
    if lengths.kind == "fixed":
        return [(lengths.input, lengths.output)] * n
    if lengths.kind == "lognormal":
        ins = rng.lognormal(np.log(lengths.input_median), lengths.input_sigma, n)
        outs = rng.lognormal(np.log(lengths.output_median), lengths.output_sigma, n)
    elif lengths.kind == "mooncake":
        ins = rng.lognormal(*lognormal_from_mean_p99(MOONCAKE["input_mean"], MOONCAKE["input_p99"]), n)
        ins = np.minimum(ins, MOONCAKE["input_max"])
        outs = rng.lognormal(*lognormal_from_mean_p99(MOONCAKE["output_mean"], MOONCAKE["output_p99"]), n)
    else:
        raise TrafficError(f"lengths kind {lengths.kind} has no drawn lengths")
    return [(max(4, round(i)), max(1, round(o))) for i, o in zip(ins, outs, strict=True)]


def clip(lengths: list[tuple[int, int]], spec: TrafficSpec) -> list[tuple[int, int]]:
    mi, mo = spec.lengths.max_input, spec.lengths.max_output
    return [(min(i, mi) if mi else i, min(o, mo) if mo else o) for i, o in lengths]


@lru_cache(maxsize=2)
def text_tokens(tokenizer, n_conversations: int = 400) -> tuple[int, ...]:
    """A stream of real text's tokens: ShareGPT conversations, first turns and answers, in file order."""
    pairs = sharegpt.conversations()[:n_conversations]
    return tuple(tokenizer("\n\n".join(a + "\n\n" + b for a, b in pairs)).input_ids)


def prompt_of(length: int, rng: np.random.Generator, tokenizer, vocab: int) -> list[int]:
    """``length`` tokens of real text from a seeded offset (cycling the stream); seeded random ids
    for a model without a tokenizer (synthetic weights)."""
    if tokenizer is None:
        return rng.integers(0, vocab, length).tolist()
    stream = text_tokens(tokenizer)
    start = int(rng.integers(0, len(stream)))
    reps = (start + length) // len(stream) + 1
    return list((stream * reps)[start:start + length])


def build_workload(spec: TrafficSpec, rate: float | None, tokenizer, vocab: int) -> Workload:
    rng = np.random.default_rng(spec.seed)
    meta: dict = {"arrival": spec.arrival, "rate": rate, "lengths": spec.lengths.kind, "seed": spec.seed}
    if spec.arrival == "trace" or spec.lengths.kind == "trace":
        rows = read_trace(spec.lengths.path)[: spec.requests or None]
        times = [t / spec.rate_scale for t, _, _ in rows] if spec.arrival == "trace" else None
        lengths = clip([(i, o) for _, i, o in rows], spec)
        if times is None:
            times = arrival_times(spec.model_copy(update={"requests": spec.requests or len(rows)}), rate)
        n = len(lengths) if times is None else min(len(lengths), len(times))
    else:
        times = arrival_times(spec, rate)
        n = spec.requests if times is None else len(times)
        lengths = None
    if spec.lengths.kind == "sharegpt":
        samples, counts = sharegpt.sample(tokenizer, n, spec.seed)
        meta.update(counts)
        prompts = [s.prompt_ids for s in samples]
        outputs = [s.output_len for s in samples]
        if spec.lengths.max_output:
            outputs = [min(o, spec.lengths.max_output) for o in outputs]
    else:
        lengths = lengths or clip(draw_lengths(spec, n, rng), spec)
        prompts = [prompt_of(i, rng, tokenizer, vocab) for i, _ in lengths[:n]]
        outputs = [o for _, o in lengths[:n]]
    items = [WorkItem(p, o, None if times is None else times[k])
             for k, (p, o) in enumerate(zip(prompts, outputs, strict=True))]
    return Workload(items, users=spec.users if spec.arrival == "closed" else None, meta=meta)
