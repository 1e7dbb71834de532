"""The ``traffic:`` block: when requests arrive and how long they are. Validated before any model loads.

Arrivals (``arrival``): ``poisson``; ``gamma`` with ``burstiness`` b (gaps Gamma(shape=b,
scale=1/(rate*b)), vLLM's ``vllm bench serve`` draw: b < 1 burstier, 1 Poisson); ``constant``;
``burst`` (all at once); ``closed`` (``users`` clients, each sending its next request when its
last one finishes); ``trace`` (the lengths file's own timestamps, scaled by ``rate_scale``).
``rate`` (requests/s) is one rate or a list of rates (a sweep axis); ``requests`` or
``duration_s`` bounds a run; ``seed`` draws everything. As vLLM does, the open-loop gaps are
rescaled so that the last request arrives at exactly ``requests / rate``.

Lengths (``lengths``): ``{kind: fixed, input, output}``, ``{kind: lognormal, input_median,
input_sigma, output_median, output_sigma}``, ``{kind: trace, path}`` (CSV or JSONL: arrival time,
input tokens, output tokens), ``{kind: sharegpt}`` (:mod:`kvlab.serve.sharegpt`) or
``{kind: mooncake}`` (:data:`MOONCAKE`). ``max_input`` / ``max_output`` clip drawn lengths (a
small model's context).

``server`` sets the engine (pool size, block size, scheduler limits); ``slo`` (``ttft``, ``tpot``,
``e2el`` in seconds) defines goodput. ``target`` (a URL) sends the traffic to a running
OpenAI-compatible server (``kvlab serve``, vLLM, ...) through kvlab's load generator.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import Field, ValidationError, field_validator, model_validator

from kvlab.errors import UserError
from kvlab.schema import StrictModel


class TrafficError(UserError):
    """A bad ``traffic:`` value; the message names the key and the fix."""


# Mooncake's conversation trace (kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl;
# the README gives average input 12,035 and output 343 tokens; median 6,909 and p99 85,400 input,
# p99 1,119 output were computed from the stored file, shared/reference/serving.md 2.2). A lognormal
# through the mean and p99 of each: mean = exp(mu + s^2/2), p99 = exp(mu + 2.326 s). Its median input
# is then 6,540 (the trace's: 6,909), a check the fit was not tuned to.
MOONCAKE = {"input_mean": 12035, "input_p99": 85400, "input_max": 126195,
            "output_mean": 343, "output_p99": 1119}
Z99 = 2.3263478740408408


def lognormal_from_mean_p99(mean: float, p99: float) -> tuple[float, float]:
    """``(mu, sigma)`` of the lognormal with this mean and 99th percentile (the smaller sigma root)."""
    gap = math.log(p99) - math.log(mean)  # = Z99*s - s^2/2
    disc = Z99 ** 2 - 2 * gap
    if gap <= 0 or disc < 0:
        raise TrafficError(f"no lognormal has mean {mean} and p99 {p99}: the p99 must exceed the mean by less "
                           f"than a factor {math.exp(Z99 ** 2 / 2):.0f}")
    sigma = Z99 - math.sqrt(disc)
    return math.log(mean) - sigma ** 2 / 2, sigma


class Lengths(StrictModel):
    kind: Literal["fixed", "lognormal", "trace", "sharegpt", "mooncake"]
    input: int | None = Field(None, ge=1)
    output: int | None = Field(None, ge=1)
    input_median: float | None = Field(None, gt=0)
    input_sigma: float | None = Field(None, ge=0)
    output_median: float | None = Field(None, gt=0)
    output_sigma: float | None = Field(None, ge=0)
    path: str | None = None
    max_input: int | None = Field(None, ge=4)
    max_output: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _needs(self):
        needs = {"fixed": ("input", "output"), "trace": ("path",),
                 "lognormal": ("input_median", "input_sigma", "output_median", "output_sigma")}
        missing = [k for k in needs.get(self.kind, ()) if getattr(self, k) is None]
        if missing:
            raise ValueError(f"lengths kind {self.kind} needs {', '.join(missing)}")
        if self.kind == "trace" and not Path(self.path).is_file():
            raise ValueError(f"lengths path {self.path!r} is not a file: give a CSV or JSONL trace "
                             f"(arrival time, input tokens, output tokens)")
        return self


class Server(StrictModel):
    """The serving engine's settings for a traffic run (``make_serving_engine``'s keywords)."""

    pool_gb: float | None = Field(None, gt=0, description="GB of KV blocks (default on CUDA: free memory - 2 GB)")
    num_blocks: int | None = Field(None, ge=1, description="the pool's block count (instead of pool_gb)")
    block_size: int = Field(16, ge=1, description="tokens per block")
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step (prefill chunks + decodes)")


class SLO(StrictModel):
    """Goodput's service levels, seconds; a request is good if it meets every one given."""

    ttft: float | None = Field(None, gt=0)
    tpot: float | None = Field(None, gt=0)
    e2el: float | None = Field(None, gt=0)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.model_dump().items() if v is not None}


class TrafficSpec(StrictModel):
    """The ``traffic:`` block of sweep params, key for key."""

    arrival: Literal["poisson", "gamma", "constant", "burst", "closed", "trace"] = "poisson"
    rate: list[float] | None = Field(None, description="requests per second (open-loop arrivals)")
    burstiness: float = Field(1.0, gt=0, description="gamma shape: < 1 burstier, 1 Poisson")
    users: int | None = Field(None, ge=1, description="closed loop: concurrent clients")
    requests: int | None = Field(None, ge=1)
    duration_s: float | None = Field(None, gt=0)
    rate_scale: float = Field(1.0, gt=0, description="trace arrivals: divide the trace's times by this")
    seed: int = 0
    lengths: Lengths
    server: Server = Field(default_factory=Server)
    slo: SLO | None = None
    target: str | None = Field(None, description="an OpenAI-compatible server's URL: kvlab's load generator "
                                                 "replays the traffic there (kvlab.loadgen) instead of in-process")

    @field_validator("target")
    @classmethod
    def _url(cls, value):
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"target {value!r}: a server's base URL, e.g. http://127.0.0.1:8000")
        return value

    @field_validator("rate", mode="before")
    @classmethod
    def _rates(cls, value):
        if value is None or isinstance(value, list):
            return value
        return [value]

    @field_validator("rate")
    @classmethod
    def _positive(cls, value):
        if value is not None and (not value or any(r <= 0 for r in value)):
            raise ValueError("rate must be > 0 requests per second (one rate or a list)")
        return value

    @model_validator(mode="after")
    def _consistent(self):
        open_loop = self.arrival in ("poisson", "gamma", "constant")
        if open_loop and not self.rate:
            raise ValueError(f"arrival {self.arrival} needs rate (requests per second, or a list of rates)")
        if self.arrival == "closed" and not self.users:
            raise ValueError("arrival closed needs users (how many clients send back to back)")
        if self.arrival == "trace" and self.lengths.kind != "trace":
            raise ValueError("arrival trace replays a trace file's timestamps: set lengths: {kind: trace, path: ...}")
        if self.requests is None and self.duration_s is None and self.arrival != "trace":
            raise ValueError("give requests (how many) or duration_s (seconds of arrivals)")
        if self.duration_s is not None and self.arrival in ("burst", "closed"):
            raise ValueError(f"arrival {self.arrival} needs requests, not duration_s")
        return self

    def rates(self) -> list[float | None]:
        return list(self.rate) if self.rate else [None]


def parse_traffic(value) -> TrafficSpec:
    """``traffic:`` as a spec, or one :class:`TrafficError` naming each bad key."""
    if isinstance(value, TrafficSpec):
        return value
    if not isinstance(value, dict):
        raise TrafficError(f"traffic: expected a mapping such as {{arrival: poisson, rate: 2, requests: 24, "
                           f"lengths: {{kind: fixed, input: 128, output: 32}}}}, got {value!r}")
    try:
        return TrafficSpec.model_validate(value)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"traffic.{where}: {msg}" if where else f"traffic: {msg}")
        raise TrafficError("; ".join(lines)) from None


def arrival_times(spec: TrafficSpec, rate: float | None) -> list[float] | None:
    """Seconds after the run's start at which each request arrives (None: closed loop)."""
    if spec.arrival == "closed":
        return None
    if spec.arrival == "burst":
        return [0.0] * spec.requests
    rng = np.random.default_rng(spec.seed)
    n = spec.requests or max(1, math.ceil(spec.duration_s * rate * 1.5) + 10)
    if spec.arrival == "constant":
        gaps = np.full(n, 1.0 / rate)
    else:
        shape = 1.0 if spec.arrival == "poisson" else spec.burstiness
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    times = np.cumsum(gaps)
    if spec.requests and times[-1] > 0:
        times *= (n / rate) / times[-1]  # vLLM: the last request leaves at exactly N / rate
    if spec.duration_s is not None:
        times = times[times < spec.duration_s]
    return times.tolist()


def traffic_sets(rate=None, lengths=None, trace=None, replay: bool = False) -> list[str]:
    """``--set`` lines for the serving notebook's parameters: ``rate`` (one or a list), ``lengths`` (a
    ``traffic.lengths`` mapping) or ``trace`` (a CSV or JSONL file: its lengths; with ``replay`` its
    own arrival times too, in place of the params' arrival process)."""
    if trace is not None and lengths is not None:
        raise TrafficError("give trace (a file's lengths) or lengths, not both")
    if replay and trace is None:
        raise TrafficError("replay replays a trace file's arrival times: give trace too")
    sets = [f"traffic.rate={json.dumps(rate)}"] if rate is not None else []
    if trace is not None:
        lengths = {"kind": "trace", "path": str(trace)}
    if lengths is not None:
        sets.append(f"traffic.lengths={json.dumps(lengths)}")
    if replay:
        sets.append("traffic.arrival=trace")
    return sets
