"""Anatomy of a decode step: where its time goes, per cache method, from torch.profiler.

The study measured that a 4-bit cache made decoding slower; this says why. A few decode steps are
profiled after warm-up, and every op's time is put in one category: weight GEMMs, attention,
cache update/concat, quantize, dequantize, other ops. What the device did not spend in ops is the
CPU/launch gap (wall time minus busy time): Python, dispatch and kernel-launch overhead, which is
what many small quantize/dequantize kernels add at batch 1.

How ops are classified: while profiling, :func:`kvlab.engine.anatomy.instrument` opens ``kvlab::`` profiler scopes
around each attention module's forward, the cache's ``update`` and the cache layers'
``_quantize``/``_dequantize`` (instance attributes only, removed afterwards). An op belongs to the
first match walking from the op out through its parent scopes, so ``aten::cat`` inside
``kvlab::cache_update`` is a cache op, ``aten::mm`` under ``aten::linear`` is a weight GEMM (even
inside the attention module) and the rest of the attention module (RoPE, SDPA) is attention.

On CUDA an op's time is its kernels' device time; on CPU it is the op's self CPU time (so the CI
can run this on the tiny model). CPU numbers include the profiler's per-op overhead: compare
methods with each other, not with an unprofiled wall clock.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kvlab.errors import UserError

GAP = "CPU/launch gap"
CATEGORIES = ("weight GEMMs", "attention", "page selection", "cache update/concat", "quantize", "dequantize",
              "other ops", GAP)

SCOPE_ATTENTION = "kvlab::attention"
SCOPE_CACHE = "kvlab::cache_update"
SCOPE_QUANTIZE = "kvlab::quantize"
SCOPE_DEQUANTIZE = "kvlab::dequantize"
SCOPE_SELECT = "kvlab::quest_select"  # a sparse read's page selection (kvlab.storage)

# Checked in order against each name of an op's chain (the op first, then its parents).
RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^kvlab::quest_select$"), "page selection"),
    (re.compile(r"^kvlab::dequantize$|dequant|unpack", re.I), "dequantize"),
    (re.compile(r"^kvlab::quantize$|quantize", re.I), "quantize"),
    (re.compile(r"^kvlab::cache_update$"), "cache update/concat"),
    (re.compile(r"^aten::linear$"), "weight GEMMs"),
    (re.compile(r"^kvlab::attention$|scaled_dot_product|flash_attn|attention", re.I), "attention"),
)


class AnatomyError(UserError):
    """Bad profiling settings; the message names the fix."""


def classify(chain: list[str]) -> str:
    """Category of an op from its name chain, innermost first (see the module docstring)."""
    for name in chain:
        for pattern, category in RULES:
            if pattern.search(name):
                return category
    return "other ops"


# ---------------------------------------------------------------------------------------------
# profiling a run of steps


@dataclass
class OpTime:
    """One profiled op, flattened: its name, its chain of parent names and its time in us."""

    name: str
    chain: list[str]
    us: float


@dataclass
class Anatomy:
    """Per-step milliseconds by category for one method, plus the ops behind them."""

    label: str
    method: str
    device: str
    steps: int
    wall_ms: float
    busy_ms: float
    by_category: dict[str, float]
    ops: pd.DataFrame = field(repr=False, default_factory=pd.DataFrame)

    def rows(self) -> list[dict]:
        return [{"label": self.label, "method": self.method, "device": self.device, "category": c,
                 "ms": self.by_category.get(c, 0.0), "wall_ms": self.wall_ms, "busy_ms": self.busy_ms,
                 "steps": self.steps} for c in CATEGORIES]

    def top_ops(self, n: int = 12) -> pd.DataFrame:
        return self.ops.sort_values("ms", ascending=False).head(n).reset_index(drop=True)


def breakdown(ops: list[OpTime], wall_s: float, steps: int) -> tuple[dict[str, float], float, pd.DataFrame]:
    """Op times -> (ms per step by category incl. the gap, busy ms per step, per-op table)."""
    if steps <= 0:
        raise AnatomyError(f"steps must be positive, got {steps}")
    by = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[tuple[str, str], list[float]] = {}
    for op in ops:
        cat = classify([op.name, *op.chain])
        by[cat] += op.us
        per_op.setdefault((op.name, cat), []).append(op.us)
    busy_ms = sum(by.values()) / 1e3 / steps
    out = {c: v / 1e3 / steps for c, v in by.items()}
    out[GAP] = max(0.0, wall_s * 1e3 / steps - busy_ms)
    table = pd.DataFrame([{"op": name, "category": cat, "calls_per_step": len(v) / steps,
                           "ms": sum(v) / 1e3 / steps} for (name, cat), v in per_op.items()],
                         columns=["op", "category", "calls_per_step", "ms"])
    return out, busy_ms, table


def _chain(evt) -> list[str]:
    names, p = [], evt.cpu_parent
    while p is not None:
        names.append(p.name)
        p = p.cpu_parent
    return names


def op_times(events, on_device: bool) -> list[OpTime]:
    """Flatten profiler events: kernel time per op on CUDA, self CPU time per op otherwise."""
    from torch.autograd import DeviceType

    out = []
    for evt in events:
        if evt.device_type != DeviceType.CPU or evt.is_async or getattr(evt, "is_user_annotation", False):
            continue
        if evt.name.startswith(("kvlab::", "ProfilerStep")):
            continue
        us = sum(k.duration for k in evt.kernels) if on_device else evt.self_cpu_time_total
        if us > 0:
            out.append(OpTime(evt.name, _chain(evt), float(us)))
    return out


class StepProfiler:
    """Profiles steps ``warmup+1 .. warmup+steps`` of a loop that calls :meth:`on_step` after each step."""

    def __init__(self, device: str = "cpu", steps: int = 8, warmup: int = 2):
        import torch
        from torch.profiler import ProfilerActivity, profile

        if steps < 1 or warmup < 1:
            raise AnatomyError(f"need steps >= 1 and warmup >= 1 (got steps={steps}, warmup={warmup}): "
                               f"the first decode steps include one-off allocations")
        self.on_device = str(device).startswith("cuda")
        if self.on_device and not torch.cuda.is_available():
            raise AnatomyError(f"device {device!r} requested but CUDA is not available: use device='cpu'")
        self.device, self.steps, self.warmup = str(device), steps, warmup
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_device else [])
        # one cycle: acc_events=True keeps torch 2.11 (H200) from warning "Profiler clears events at the end
        # of each cycle" on every profile (pytorch #180387); it changes nothing for a single cycle
        self.profiler = profile(activities=activities, acc_events=True)
        self.count, self.t0, self.t1 = 0, None, None

    def _sync(self):
        if self.on_device:
            import torch

            torch.cuda.synchronize()

    def on_step(self, *_):
        self._sync()
        self.count += 1
        if self.count == self.warmup:
            self.profiler.start()
            self.t0 = time.perf_counter()
        elif self.count == self.warmup + self.steps:
            self.t1 = time.perf_counter()
            self.profiler.stop()

    def close(self) -> None:
        """Stop the profiler if a failed loop left it running (it would time everything after)."""
        if self.t0 is not None and self.t1 is None:
            self.t1 = time.perf_counter()
            self.profiler.stop()

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    def result(self, label: str, method: str | None = None) -> Anatomy:
        if self.t1 is None:
            raise AnatomyError(f"the loop ran {self.count} steps; the profiler needs {self.total_steps}")
        ops = op_times(self.profiler.events(), self.on_device)
        by, busy, table = breakdown(ops, self.t1 - self.t0, self.steps)
        return Anatomy(label, method or label, self.device, self.steps, (self.t1 - self.t0) * 1e3 / self.steps,
                       busy, by, table)


def profile_loop(step: Callable[[], Any], label: str, device: str = "cpu", steps: int = 8,
                 warmup: int = 2, method: str | None = None) -> Anatomy:
    """Profile any decode step function (called ``warmup + steps`` times)."""
    sp = StepProfiler(device, steps, warmup)
    try:
        for _ in range(sp.total_steps):
            step()
            sp.on_step()
    finally:
        sp.close()
    return sp.result(label, method)


# ---------------------------------------------------------------------------------------------
# prompts and tables (the engines profile their own steps: :mod:`kvlab.engine.anatomy`)


def synthetic_prompt(vocab_size: int, ctx: int, batch: int = 1, seed: int = 0, device: str = "cpu"):
    """Seeded random token ids of exact length (what the speed sweeps feed synthetic models)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, ctx), generator=g).to(device)


def anatomy_table(results: list[Anatomy]) -> pd.DataFrame:
    return pd.DataFrame([row for a in results for row in a.rows()])


def category_table(table: pd.DataFrame) -> pd.DataFrame:
    """Methods x categories in ms per step, with wall and busy time: the numbers behind the bars."""
    wide = table.pivot_table(index="label", columns="category", values="ms", sort=False)
    wide = wide[[c for c in CATEGORIES if c in wide.columns]]
    extra = table.groupby("label", sort=False)[["wall_ms", "busy_ms"]].first()
    return wide.join(extra).round(3)


def top_ops_table(results: list[Anatomy], n: int = 8) -> pd.DataFrame:
    """The ``n`` most expensive ops of each method, one table (what to read when a bar is tall)."""
    parts = [a.top_ops(n).assign(label=a.label) for a in results]
    if not parts:
        return pd.DataFrame(columns=["label", "op", "category", "calls_per_step", "ms"])
    out = pd.concat(parts, ignore_index=True)
    return out[["label", "op", "category", "calls_per_step", "ms"]].round(4)
