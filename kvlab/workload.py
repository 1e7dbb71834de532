"""Context-length distributions: a sweep's ``ctx`` as a workload instead of one synthetic length.

Why: a verdict measured at one context can flip at another (a quantized cache costs energy at 16k
and nothing at 4k), so a lab should answer at the context lengths its users actually send. A sweep
key ``ctx`` may therefore be a distribution::

    ctx: {dist: lognormal, median: 4096, sigma: 0.6, samples: 8, max: 16384}
    ctx: {file: lengths.txt, samples: 8}                     # one integer per line
    ctx: {file: requests.jsonl, field: prompt_tokens, samples: 8}

``samples`` lengths are drawn with the sweep's ``seed`` (the same seed draws the same lengths; more
samples keep the first ones), then clipped to ``[min, max]`` and to the model's window minus the new
tokens (a file's lengths above that window are refused unless ``max`` is given: clipping them
changes the workload). Each draw is one point of the sweep (its run ids carry the draw's index and the
distribution's name, so a rerun resumes it); every point is equally likely, so aggregates over a
distribution weight each run by the tokens it generated.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from kvlab.errors import UserError
from kvlab.models import get_spec
from kvlab.preflight import read_text_file
from kvlab.schema import StrictModel

BUDGET_POINTS = 1000  # quantiles a byte budget averages over for a named shape (exact enough, no seed)


class WorkloadError(UserError):
    """A context-length distribution that cannot be used; the message names the key or file."""


class CtxDistribution(StrictModel):
    """A distribution of prompt lengths; exactly one of ``dist`` (a named shape) or ``file``."""

    model_config = ConfigDict(extra="forbid")

    dist: Literal["lognormal"] | None = Field(None, description="a named shape: lognormal")
    median: float | None = Field(None, gt=0, description="lognormal: median length in tokens")
    sigma: float | None = Field(None, ge=0, description="lognormal: spread (std of the log length)")
    file: str | None = Field(None, description="observed prompt lengths: one integer per line, or JSONL")
    field: str | None = Field(None, description="JSONL: the key holding each request's prompt length")
    samples: int = Field(8, ge=1, description="lengths drawn for a sweep (each is one sweep point)")
    min: int = Field(1, ge=1, description="lengths below are raised to this")
    max: int | None = Field(None, ge=1, description="lengths above are lowered to this (and to the model's window)")
    name: str | None = Field(None, description="the name records carry (default: from the shape or file)")

    @model_validator(mode="after")
    def _one_source(self) -> CtxDistribution:
        if (self.dist is None) == (self.file is None):
            raise ValueError("give either dist: lognormal (with median and sigma) or file: PATH, not both")
        if self.dist == "lognormal" and (self.median is None or self.sigma is None):
            raise ValueError("dist: lognormal needs median (tokens) and sigma, e.g. {dist: lognormal, "
                             "median: 4096, sigma: 0.6}")
        if self.dist is not None and self.field is not None:
            raise ValueError("field: only applies to a JSONL file")
        if self.max is not None and self.max < self.min:
            raise ValueError(f"max {self.max} is below min {self.min}")
        return self

    @property
    def label(self) -> str:
        """What records carry in ``ctx_dist``: stable for the same shape or file."""
        if self.name:
            return self.name
        if self.dist == "lognormal":
            return f"lognormal(median={self.median:g},sigma={self.sigma:g})"
        return f"file:{Path(self.file).name}" + (f"[{self.field}]" if self.field else "")

    def cap(self, window: int | None) -> int:
        """The largest length a sample may take: ``max`` and the model's window (minus new tokens)."""
        caps = [c for c in (self.max, window) if c is not None]
        return min(caps) if caps else 2**62

    def clip(self, n: float, window: int | None = None) -> int:
        return int(min(max(round(n), self.min), self.cap(window)))

    def window_problem(self, window: int, why: str, key: str = "ctx") -> str | None:
        """Why a file's lengths cannot run as observed: some are above ``window`` (the model's
        longest prompt; ``why`` says how it comes about) and no ``max`` says to clip them; None otherwise. A
        named shape's tail is clipped as documented; a file's lengths are the workload itself."""
        if self.file is None or self.max is not None:
            return None
        observed = observed_lengths(self.file, self.field)
        over = [n for n in observed if n > window]
        if not over:
            return None
        return (f"{key}.file {self.file}: {len(over)} of {len(observed)} lengths (up to {max(over)}) are above "
                f"{window} ({why}); add max: {window} to {key} to clip them, or remove them from the file")

    def clip_note(self, lengths: list[float], window: int, why: str, key: str = "ctx") -> str | None:
        """A named shape's ``lengths`` (draws or quantiles) above the model's ``window`` run at the
        window: a sentence saying so, unless ``max`` already says it; None when none is clipped."""
        if self.dist is None or (self.max is not None and self.max <= window):
            return None
        over = [x for x in lengths if round(x) > window]
        if not over:
            return None
        return (f"{key}: {len(over)} of {len(lengths)} {self.dist} lengths (up to {round(max(over)):,}) are above "
                f"{window} ({why}) and run at {window}; add max: {window} to {key} to say so, or lower median or sigma")

    def raw_draws(self, seed: int, n: int) -> list[float]:
        """``n`` unclipped lengths drawn with ``seed``; a prefix of a longer draw with the same seed."""
        rng = random.Random(json.dumps([seed, "ctx", self.label]))
        if self.dist == "lognormal":
            return [rng.lognormvariate(math.log(self.median), self.sigma) for _ in range(n)]
        observed = observed_lengths(self.file, self.field)
        return [float(observed[rng.randrange(len(observed))]) for _ in range(n)]

    def draw(self, seed: int, window: int | None = None) -> list[int]:
        """The sweep's ``samples`` lengths, clipped, in draw order."""
        return [self.clip(x, window) for x in self.raw_draws(seed, self.samples)]

    def population(self, window: int | None = None) -> list[int]:
        """Lengths a byte budget averages over: every observed length of a file, else evenly spaced
        quantiles of the shape (deterministic, no seed)."""
        if self.file is not None:
            return [self.clip(x, window) for x in observed_lengths(self.file, self.field)]
        normal = statistics.NormalDist()
        qs = [(i + 0.5) / BUDGET_POINTS for i in range(BUDGET_POINTS)]
        return [self.clip(self.median * math.exp(self.sigma * normal.inv_cdf(q)), window) for q in qs]


def observed_lengths(path: str | Path, field: str | None = None) -> list[int]:
    """Positive integer lengths from a text file (one per line; blank lines and ``#`` comments are
    skipped) or, with ``field``, from each JSON line's ``field``."""
    path = Path(path)
    if not path.is_file():
        raise WorkloadError(f"ctx.file: {path} not found; give a file of prompt lengths, one integer per line "
                            f"(relative paths start from the current folder)")
    text = read_text_file(path, f"ctx.file {path}", "give a text file of prompt lengths", WorkloadError)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if field is not None:
            try:
                value = json.loads(line)[field]
            except (json.JSONDecodeError, TypeError, KeyError):
                raise WorkloadError(f"ctx.file {path} line {n}: not a JSON object with the key {field!r}; "
                                    f"fix the line or the field name") from None
        else:
            value = line
        try:
            length = int(value)
        except (TypeError, ValueError):
            hint = " (a JSONL file needs field: KEY)" if line.startswith("{") and field is None else ""
            raise WorkloadError(f"ctx.file {path} line {n}: {line[:40]!r} is not an integer length{hint}") from None
        if length < 1:
            raise WorkloadError(f"ctx.file {path} line {n}: length {length} must be at least 1")
        out.append(length)
    if not out:
        raise WorkloadError(f"ctx.file {path} holds no lengths; write one integer per line")
    return out


def parse_distribution(data: dict, key: str | None = "ctx") -> CtxDistribution:
    """A mapping (a params ``ctx`` or ``kvlab budget --ctx-dist``) as a distribution, or one
    :class:`WorkloadError` naming the keys (under ``key``; None: the bare keys)."""
    from pydantic import ValidationError

    try:
        return CtxDistribution.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            loc = ".".join(str(p) for p in e["loc"])
            msg = e["msg"].removeprefix("Value error, ")
            where = ".".join(k for k in (key, loc) if k)
            lines.append(f"{where}: {msg}" if where else msg)
        raise WorkloadError("; ".join(dict.fromkeys(lines))) from None


# --------------------------------------------------------------------------------------------
# Sweep points
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CtxPoint:
    """One context of a sweep: a listed length, or draw ``sample`` of distribution ``dist``."""

    ctx: int
    dist: str | None = None
    sample: int | None = None

    def block_key(self, weights_quant: str = "none") -> tuple:
        """What a sweep's block order adds to (model, ctx, batch, repeat, prompt) for this point: the
        draw and the weights format when set (nothing for listed lengths: their order stands)."""
        return ((self.sample,) if self.dist else ()) + ((weights_quant,) if weights_quant != "none" else ())


def context_points(ctx: list[int] | CtxDistribution, seed: int, window: int | None = None) -> list[CtxPoint]:
    """The contexts a sweep runs for one model: listed lengths as given; a distribution's draws in
    ascending length (draws of equal length stay separate points: each is one request)."""
    if not isinstance(ctx, CtxDistribution):
        return [CtxPoint(c) for c in ctx]
    draws = ctx.draw(seed, window)
    return sorted((CtxPoint(c, ctx.label, i) for i, c in enumerate(draws)), key=lambda p: (p.ctx, p.sample))


def workload_points(params, model: str) -> list[tuple[str, CtxPoint]]:
    """(weights format, context point) pairs of a sweep for one model, in run order: one model load
    per weights format, then the contexts (kvlab.sweep.expand)."""
    points = context_points(params.ctx, params.seed, model_window(model, params.new_tokens))
    return [(wq, p) for wq in params.weights_quant for p in points]


def model_window(model: str, new_tokens: int) -> int | None:
    """The longest prompt a model takes with ``new_tokens`` more (None: model unknown)."""
    try:
        return get_spec(model).max_context - new_tokens
    except UserError:
        return None
