"""Sweep parameters: a pydantic model that a params YAML maps onto key for key, the method variants
it expands to, and loading (YAML, ``--set`` overrides) with one readable :class:`ParamsError`.
The checks against models, policies and this machine are :mod:`kvlab.sweep.checks`.

List-valued knobs (``models``, ``ctx``, ``batch``, ``keep``, ``bits``, ``methods``) also accept a
scalar, so ``papermill -p ctx 16384`` and ``kvlab sweep ... --set ctx=16384`` work.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from kvlab.errors import UserError
from kvlab.preflight import read_text_file
from kvlab.quality import TaskSpec
from kvlab.records import canonical_json
from kvlab.schema import BOOL_PROBLEM, StrictModel, has_bool
from kvlab.serve.traffic import TrafficError, TrafficSpec, parse_traffic
from kvlab.workload import CtxDistribution, WorkloadError, parse_distribution
from kvlab.yamlfile import load_yaml

SDPA_BACKENDS = ("auto", "cudnn", "flash", "efficient", "math")
DTYPES = ("bfloat16", "float16", "float32")
# Where a sweep's runs execute, by name: the class behind each (``module:Class``, imported by
# :func:`kvlab.runner.make_executor` when one is made). The params Literal and the CLI's
# ``--executor`` choices read these names.
EXECUTORS = {"local": "kvlab.runner.local:LocalExecutor", "process": "kvlab.runner.process:ProcessExecutor",
             "ray": "kvlab.runner.ray_cluster:RayExecutor"}
EXECUTOR_NAMES = tuple(EXECUTORS)


class ParamsError(UserError):
    """Invalid sweep parameters; each line names the key and the fix."""


def _as_list(value):
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, tuple):
        return list(value)
    return [value]


class MethodEntry(StrictModel):
    """One method with its own axis values and knobs, e.g. ``{method: snapkv, keep: [0.5, 0.1],
    window_size: 32}``. Keys other than ``method``/``keep``/``bits`` go to ``make_policy``."""

    model_config = ConfigDict(extra="allow")

    method: str
    keep: list[float] | None = None
    bits: list[int] | None = None

    _as_list_keep = field_validator("keep", "bits", mode="before")(_as_list)

    def knobs(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class SweepParams(StrictModel):
    """Everything one sweep varies and fixes. The YAML keys are these field names."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(None, description="sweep name (default: the params file's stem)")
    models: list[str] = Field(description="preset names or local model folders")
    weights: Literal["real", "synthetic"] | None = Field(
        None, description="real (embedded/local) or synthetic (seeded random) weights")
    device: str = "cpu"
    dtype: str | None = Field(None, description="bfloat16 | float16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    attn_implementation: str = "sdpa"
    threads: int | None = Field(None, ge=1, description="torch CPU threads (torch.set_num_threads); default: torch's")
    sdpa_backend: Literal["auto", "cudnn", "flash", "efficient", "math"] = Field(
        "auto", description="pin torch's SDPA kernel (torch.nn.attention.sdpa_kernel); auto lets torch choose")
    methods: list[str | MethodEntry]
    keep: list[float] | None = Field(None, description="kept fraction for eviction methods listed by name")
    bits: list[int] | None = Field(None, description="bit widths for quantized methods listed by name")
    engine: list[Literal["hf", "fast"]] = Field(
        ["hf"], description="decode engines: hf (transformers per step) and/or fast (static KV, CUDA graph)")
    ctx: list[int] | CtxDistribution = Field(
        description="prompt lengths in tokens, or a distribution: {dist: lognormal, median, sigma, samples} "
                    "or {file: lengths.txt} (kvlab.workload)")
    prefill_chunk: list[int | None] = Field(
        [None], description="prefill chunk sizes in tokens, each run for every method (null: one-shot prefill)")
    batch: list[int] = [1]
    prefill_rows: int | None = Field(
        None, description="fast engine: prefill this many sequences at a time into the static KV buffers, "
                          "freeing each group's prefill cache before the next (a batch's peak holds one "
                          "group's); null or >= batch: the whole batch at once")
    new_tokens: int = Field(128, ge=1, description="exactly this many new tokens per sequence (EOS ignored)")
    prompts: int = Field(1, ge=1, description="prompt ids 0..prompts-1 (seeded, exact length)")
    repeats: int = Field(1, ge=1)
    seed: int = 0
    warmup_runs: int = Field(1, ge=0, description="unrecorded runs of the exact shape per config")
    idle_s: float = Field(0.0, ge=0, description="idle-power baseline length after each model load (GPU)")
    energy_interval_ms: float = Field(15.0, ge=1, le=1000, description="power polling period")
    jitter_ms: float = Field(0.0, ge=0, le=1000, description="random pause before each run (de-aliasing)")
    max_runs: int | None = Field(None, ge=1, description="stop cleanly after this many measured runs")
    time_budget_s: float | None = Field(None, gt=0, description="stop cleanly before this many seconds")
    retry_failed: bool = Field(True, description="rerun runs recorded as failed (false: keep their failure)")
    timelines: bool = Field(True, description="write power timelines to timelines.jsonl")
    executor: Literal[EXECUTOR_NAMES] = Field(  # type: ignore[valid-type]
        "local", description="where runs execute: local (this process), process (a child process per "
                             "group of runs), ray (a Ray task per GPU); see kvlab.runner")
    ray_address: str | None = Field(
        None, description="Ray cluster to join with executor: ray (e.g. auto, ray://head:10001); "
                          "default: RAY_ADDRESS, else a local cluster")
    weights_quant: list[Literal["none", "int8", "int4"]] = Field(
        ["none"], description="weight quantization stacked under every cache policy: none, int8, int4 "
                              "(optimum-quanto; engine hf only; kvlab.weights_quant)")
    budget_gb: float | Literal["gpu"] | None = Field(
        None, description="memory-budgeted concurrency: admit as many sequences per method as fit in "
                          "this many GB (or the whole free GPU) from the measured peaks (kvlab.sweep.admission)")
    budget_max_batch: int | None = Field(
        None, ge=1, description="with budget_gb: admit at most this many sequences (a command's time limit)")
    quality: dict[str, Any] | None = Field(
        None, description="a quality pass after the performance runs: kvlab.quality.TaskSpec keys "
                          "(tasks, lengths, depths, samples, ...); needs real weights")
    perf: bool = Field(True, description="run the performance grid; false: the quality pass alone (ctx then "
                                         "defaults to quality's lengths)")

    @model_validator(mode="before")
    @classmethod
    def _quality_alone_ctx(cls, data):
        """With ``perf: false`` no run reads ``ctx``: it defaults to the quality pass's lengths, which
        the checks then hold against each model's window and memory."""
        if isinstance(data, dict) and data.get("perf") is False and data.get("ctx") is None:
            quality = data.get("quality")
            lengths = quality.get("lengths") if isinstance(quality, dict) else None
            data = {**data, "ctx": lengths or TaskSpec.model_fields["lengths"].default_factory()}
        return data

    traffic: TrafficSpec | None = Field(
        None, description="serving under traffic: arrivals, rates, lengths, server, slo (kvlab.serve.traffic); "
                          "run with benchmarks/serve_rates.py, not kvlab sweep")

    _lists = field_validator("models", "batch", "keep", "bits", "methods", "engine", "weights_quant",
                             mode="before")(_as_list)

    @field_validator("ctx", mode="before")
    @classmethod
    def _ctx(cls, value):
        """A mapping is a distribution (its own one-line errors); anything else a list of lengths."""
        if has_bool(value):  # this validator runs before StrictModel's: refuse here what it would
            raise ValueError(BOOL_PROBLEM)
        if isinstance(value, dict):
            try:
                return parse_distribution(value, key=None)
            except WorkloadError as err:
                raise ValueError(str(err)) from None
        try:  # validated here, so a bad list gets one line (not one per member of the union)
            return TypeAdapter(list[int]).validate_python(_as_list(value))
        except ValidationError as err:
            raise ValueError(f"{err.errors()[0]['msg']}; give lengths in tokens, e.g. [4096, 16384], or a "
                             f"distribution such as {{dist: lognormal, median: 4096, sigma: 0.6}}") from None

    @field_validator("traffic", mode="before")
    @classmethod
    def _traffic(cls, value):
        if value is None:
            return None
        try:
            return parse_traffic(value)
        except TrafficError as err:
            raise ValueError(str(err)) from None

    @field_validator("prefill_chunk", mode="before")
    @classmethod
    def _chunk_list(cls, value):
        return [None] if value is None else _as_list(value)

    @field_validator("prefill_chunk")
    @classmethod
    def _chunk_sizes(cls, values: list[int | None]) -> list[int | None]:
        for v in values:
            if v is not None and v < 1:
                raise ValueError(f"{v}: a chunk is at least 1 token (null: one-shot prefill)")
        return values

    @field_validator("prefill_rows", mode="before")
    @classmethod
    def _rows(cls, value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError("give a whole number of sequences >= 1 per prefill group (null: the whole batch)")
        return value

    @field_validator("ctx", "batch")
    @classmethod
    def _positive(cls, values):
        if isinstance(values, CtxDistribution):
            return values
        for v in values:
            if v < 1:
                raise ValueError(f"{v} must be at least 1")
        return values


@dataclass(frozen=True)
class MethodVariant:
    """One point on the method axis: a policy name and the exact kwargs for ``make_policy``."""

    method: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def keep(self) -> float | None:
        return self.kwargs.get("keep")

    @property
    def prefill_chunk(self) -> int | None:
        return self.kwargs.get("prefill_chunk")

    @property
    def bits(self) -> int | None:
        if "nbits" in self.kwargs:
            return self.kwargs["nbits"]
        quant = self.kwargs.get("quant")
        return quant.get("nbits") if isinstance(quant, dict) else None

    def key(self) -> tuple:
        return (self.method, canonical_json(self.kwargs))


def method_axis(method: str) -> str | None:
    """``"keep"`` for methods with a ``keep`` parameter (eviction), ``"bits"`` for those with
    ``nbits`` (quantized), None for the rest (``full``, ``fp8``); read from the policy registry."""
    from kvlab.policies import POLICIES  # torch: a params file is read and parsed without it

    cls = POLICIES.get(method)
    if cls is None:  # check_params reports the unknown method
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    return "keep" if "keep" in names else "bits" if "nbits" in names else None


def method_variants(params: SweepParams) -> list[tuple[str, MethodVariant]]:
    """Expand ``methods`` x (keep | bits) into variants, each with the params key its values came
    from (``methods[i]``, or ``keep`` / ``bits`` for the top-level lists) for error messages."""
    out = []
    for i, entry in enumerate(params.methods):
        if isinstance(entry, str):
            entry = MethodEntry(method=entry)
        axis = method_axis(entry.method)
        where = f"methods[{i}]"
        base = entry.knobs()
        if entry.keep is not None:
            out += [(where, MethodVariant(entry.method, {**base, "keep": k})) for k in entry.keep]
        elif entry.bits is not None:
            out += [(where, MethodVariant(entry.method, {**base, "nbits": b})) for b in entry.bits]
        elif axis == "keep" and params.keep is not None:
            out += [("keep", MethodVariant(entry.method, {**base, "keep": k})) for k in params.keep]
        elif axis == "bits" and params.bits is not None:
            out += [("bits", MethodVariant(entry.method, {**base, "nbits": b})) for b in params.bits]
        else:
            out.append((where, MethodVariant(entry.method, base)))
    return [(where, chunked) for where, v in out for chunked in _chunk_variants(v, params.prefill_chunk)]


def _chunk_variants(v: MethodVariant, chunks: list[int | None]) -> list[MethodVariant]:
    """``v`` at each prefill chunk (a method entry's own ``prefill_chunk`` knob wins; null there means
    one shot only, with the run id of a one-shot run)."""
    if "prefill_chunk" in v.kwargs:
        if v.kwargs["prefill_chunk"] is None:
            return [MethodVariant(v.method, {k: x for k, x in v.kwargs.items() if k != "prefill_chunk"})]
        return [v]
    return [v if c is None else MethodVariant(v.method, {**v.kwargs, "prefill_chunk": c}) for c in chunks]


# --------------------------------------------------------------------------------------------
# Loading and validation
# --------------------------------------------------------------------------------------------


def pydantic_lines(err: ValidationError, known: list[str] | None = None, prefix: str = "") -> list[str]:
    known = known or list(SweepParams.model_fields)
    lines = []
    errors = err.errors()
    locs = [tuple(str(p) for p in e["loc"] if not str(p).startswith(("str", "MethodEntry"))) for e in errors]
    # a union's other branch (methods[0] is no string) says nothing when a deeper error names the key
    errors = [e for e, loc in zip(errors, locs, strict=True)
              if not any(other[:len(loc)] == loc and len(other) > len(loc) for other in locs)]
    for e in errors:
        loc = prefix + ".".join(str(p) for p in e["loc"] if not str(p).startswith(("str", "MethodEntry")))
        if e["type"] == "extra_forbidden":
            key = str(e["loc"][-1])
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(known)}"
            lines.append(f"unknown key {loc!r}: {hint}")
        elif e["type"] == "missing":
            lines.append(f"{loc}: required; add `{loc}:` to the params file or --set {loc}=...")
        else:
            lines.append(f"{loc}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    return list(dict.fromkeys(lines))


def params_error(problems: list[str]) -> ParamsError:
    """One problem on one line; several as an indented list."""
    problems = list(dict.fromkeys(problems))
    if len(problems) == 1:
        return ParamsError(f"invalid sweep params: {problems[0]}")
    return ParamsError("invalid sweep params:\n  " + "\n  ".join(problems))


def parse_params(data: dict[str, Any]) -> SweepParams:
    """Pydantic validation with one readable :class:`ParamsError` instead of a pydantic dump."""
    if not isinstance(data, dict):
        raise ParamsError(f"params must be a mapping of keys to values, got {type(data).__name__}")
    try:
        return SweepParams.model_validate(data)
    except ValidationError as err:
        raise params_error(pydantic_lines(err)) from None


def _yaml_value(text: str, where: str):
    return load_yaml(text, where, ParamsError)


def apply_overrides(data: dict[str, Any], sets: Iterable[str]) -> dict[str, Any]:
    """``key=value`` overrides (value parsed as YAML; dotted keys reach into mappings)."""
    data = dict(data)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ParamsError(f"--set {item!r}: write key=value, e.g. --set ctx=16384")
        value = _yaml_value(raw, f"--set {item!r}: the value") if raw.strip() else None
        parts = key.strip().split(".")
        target = data
        for p in parts[:-1]:
            target = target.setdefault(p, {})
            if not isinstance(target, dict):
                raise ParamsError(f"--set {item!r}: {p!r} is not a mapping")
        target[parts[-1]] = value
    return data


def load_params(path: str | Path, sets: Iterable[str] = ()) -> SweepParams:
    """Read a params YAML, apply ``--set`` overrides and validate types (not yet against models)."""
    path = Path(path)
    if not path.is_file():  # its own words: a missing params file is the commonest first mistake
        raise ParamsError(f"params file {path} not found: pass a YAML file such as params/smoke.yaml")
    text = read_text_file(path, f"params file {path}", "pass a YAML file", ParamsError)
    data = _yaml_value(text, f"params file {path}")
    if data is None:
        raise ParamsError(f"params file {path} is empty: give at least models, methods and ctx "
                          f"(see params/smoke.yaml)")
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of keys to values at the top level")
    data = apply_overrides(data, sets)
    data.setdefault("name", path.stem)
    return parse_params(data)
