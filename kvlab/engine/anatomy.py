"""Anatomy of the fast engine's decode step: profiler over graph replays, kernels by category.

Beside :mod:`kvlab.anatomy` (the ``hf`` step, classified by the ops that launched each kernel):
a replayed CUDA graph launches its kernels from one ``cudaGraphLaunch``, so no op owns them, and
they are classified by kernel name instead (:func:`classify_kernel`). On CPU the step runs
eagerly and its ops are classified by op name. The categories are :data:`kvlab.anatomy.CATEGORIES`;
what the device did not spend in kernels is the launch gap (wall minus busy time), which the graph
is there to remove.
"""

from __future__ import annotations

import re

from kvlab.anatomy import CATEGORIES, GAP, SCOPE_ATTENTION, Anatomy, StepProfiler

KERNEL_RULES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"quantize_write|index_copy|scatter|_put_slots", re.I), "cache update/concat"),
    (re.compile(r"dequant|unpack", re.I), "dequantize"),
    (re.compile(r"flash|fmha|attention|_decode_(split|fold|reduce)_kernel|scaled_dot_product", re.I), "attention"),
    (re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|^aten::(linear|mm|addmm|bmm|matmul)$", re.I),
     "weight GEMMs"),
)


def classify_kernel(name: str, chain: tuple[str, ...] = ()) -> str:
    """Category of a kernel by its name (on CPU: of an op by its name, then its parents' names,
    so matmuls inside the store's attention scope count as attention)."""
    if SCOPE_ATTENTION in chain:
        return "attention"
    for what in (name, *chain):
        for pattern, category in KERNEL_RULES:
            if pattern.search(what):
                return category
    return "other ops"


def kernel_table(kernels: list[tuple], steps: int):
    """Per kernel (or op) name: category, launches and ms per step, largest first."""
    import pandas as pd

    rows: dict[str, list] = {}
    for name, us, *chain in kernels:
        row = rows.setdefault(name, [classify_kernel(name, tuple(chain[0]) if chain else ()), 0, 0.0])
        row[1] += 1
        row[2] += us / 1e3
    table = pd.DataFrame([{"op": n, "category": c, "calls": k / steps, "ms": ms / steps}
                          for n, (c, k, ms) in rows.items()], columns=["op", "category", "calls", "ms"])
    return table.sort_values("ms", ascending=False).reset_index(drop=True)


def step_breakdown(kernels: list[tuple], wall_s: float, steps: int) -> tuple[dict[str, float], float]:
    """``(name, us[, parent names])`` over ``steps`` steps -> (ms per step by category incl. the gap,
    busy ms)."""
    by = dict.fromkeys(CATEGORIES, 0.0)
    for name, us, *chain in kernels:
        by[classify_kernel(name, tuple(chain[0]) if chain else ())] += us / 1e3 / steps
    busy = sum(by.values())
    by[GAP] = max(0.0, wall_s * 1e3 / steps - busy)
    return by, busy


def _kernels(profiler, on_device: bool) -> list[tuple]:
    from torch.autograd import DeviceType

    from kvlab.anatomy import op_times

    if not on_device:  # eager ops with their parents (the attention scope)
        return [(op.name, op.us, op.chain) for op in op_times(profiler.events(), on_device=False)]
    return [(evt.name, float(getattr(evt, "device_time_total", None) or evt.cuda_time_total))
            for evt in profiler.events() if evt.device_type == DeviceType.CUDA]


def fast_anatomy(loaded, policy, ctx: int, batch: int = 1, steps: int = 8, warmup: int = 2, engine=None,
                 seed: int = 0) -> Anatomy:
    """Prefill ``ctx`` tokens under ``policy``, then profile ``steps`` decode steps of the fast
    engine (graph replays on CUDA) after ``warmup`` unprofiled ones."""
    import torch

    from kvlab.anatomy import synthetic_prompt
    from kvlab.decode import prefill
    from kvlab.engine.fast import FastEngine

    engine = engine or FastEngine(loaded)
    profiler = StepProfiler(loaded.device, steps, warmup)
    n_new = profiler.total_steps + 1
    with policy.attach(loaded), torch.inference_mode():
        decoder = engine.decoder(policy, batch, ctx, n_new)
        cache = decoder.prefill_cache()
        ids = synthetic_prompt(loaded.spec.vocab_size, ctx, batch, seed, loaded.device)
        first = prefill(loaded.model, ids, cache)[:, -1].argmax(dim=-1)
        decoder.load(cache)
        del cache
        if not decoder.replays:  # eager: name attention's ops (a replayed graph has no ops)
            decoder.store.profile_scope = SCOPE_ATTENTION
        try:
            decoder.decode(first, n_new, ctx, on_step=profiler.on_step)
        finally:
            decoder.store.profile_scope = None
    if profiler.t1 is None:
        raise RuntimeError(f"the profiler saw {profiler.count} of {profiler.total_steps} steps")
    kernels = _kernels(profiler.profiler, profiler.on_device)
    by, busy = step_breakdown(kernels, profiler.t1 - profiler.t0, steps)
    wall_ms = (profiler.t1 - profiler.t0) * 1e3 / steps
    how = [s for s in (("graph" if decoder.replays else ""),
                       ("" if engine.step.compile == "none" else f"compile {engine.step.compile}")) if s]
    label = f"{policy.label} (fast{''.join(', ' + h for h in how)})"
    return Anatomy(label, policy.name, str(loaded.device), steps, wall_ms, busy, by, kernel_table(kernels, steps))
