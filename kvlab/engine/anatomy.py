"""Anatomy of each engine's decode step: profiler scopes, steps profiled after warm-up, time by category.

``hf`` (:func:`hf_anatomy`): transformers' step, classified by the ops that launched each kernel
(:mod:`kvlab.anatomy`), with ``kvlab::`` scopes opened by :func:`instrument`. ``fast``
(:func:`fast_anatomy`): a replayed CUDA graph launches its kernels from one ``cudaGraphLaunch``, so
no op owns them, and they are classified by kernel name instead (:func:`classify_kernel`). On CPU the
step runs eagerly and its ops are classified by op name. The categories are
:data:`kvlab.anatomy.CATEGORIES`; what the device did not spend in kernels is the launch gap (wall
minus busy time), which the graph is there to remove. Each engine's ``anatomy`` method runs one of
these; :func:`compare_methods` runs it per method.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import record_function

from kvlab.anatomy import (
    CATEGORIES,
    GAP,
    SCOPE_ATTENTION,
    SCOPE_CACHE,
    SCOPE_DEQUANTIZE,
    SCOPE_QUANTIZE,
    SCOPE_SELECT,
    Anatomy,
    StepProfiler,
    anatomy_table,
    op_times,
    synthetic_prompt,
)
from kvlab.engine.generation import prefill
from kvlab.policies import make_policy
from kvlab.policies.cache import profiler_scopes

KERNEL_RULES: tuple[tuple[re.Pattern, str], ...] = (
    # the greedy token and the step's bookkeeping (kvlab.engine.llama.record_token): one compiled kernel
    # whose name may also name its index_copy into the output row
    (re.compile(r"argmax", re.I), "other ops"),
    # a graph replay has no scopes: a sparse read's page selection is known by its kernels' names (torch's
    # path: only topk's; its bound products are batched GEMMs, counted as weight GEMMs there)
    (re.compile(r"quest_select|gatherTopK|radixSort|bitonicSort", re.I), "page selection"),
    (re.compile(r"quantize_write|_kivi_append|quest_bounds_append|index_copy|scatter|_put_slots", re.I),
     "cache update/concat"),
    (re.compile(r"dequant|unpack", re.I), "dequantize"),
    # kvlab's decode kernels by their function names (tests/test_kivi_quest_wiring.py reads them off
    # the kernel modules: a renamed kernel would otherwise be filed under other ops)
    (re.compile(r"flash|fmha|attention|decode_((split|fold|warp|reduce)_)?kernel|kivi_decode_kernel|"
                r"quest_split_kernel|merge_partials|scaled_dot_product|_sdpa_|lean_reduction", re.I), "attention"),
    (re.compile(r"gemm|gemv|cutlass|xmma|nvjet|cublas|^aten::(linear|mm|addmm|bmm|matmul)$", re.I),
     "weight GEMMs"),
)


def classify_kernel(name: str, chain: tuple[str, ...] = ()) -> str:
    """Category of a kernel by its name (on CPU: of an op by its name, then its parents' names,
    so matmuls inside the store's attention scope count as attention)."""
    if SCOPE_SELECT in chain:
        return "page selection"
    if SCOPE_ATTENTION in chain:
        return "attention"
    for what in (name, *chain):
        for pattern, category in KERNEL_RULES:
            if pattern.search(what):
                return category
    return "other ops"


def kernel_table(kernels: list[tuple], steps: int):
    """Per kernel (or op) name: category, launches and ms per step, largest first."""
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
    if not on_device:  # eager ops with their parents (the attention scope)
        return [(op.name, op.us, op.chain) for op in op_times(profiler.events(), on_device=False)]
    return [(evt.name, float(getattr(evt, "device_time_total", None) or evt.cuda_time_total))
            for evt in profiler.events() if evt.device_type == DeviceType.CUDA]


def attention_modules(model) -> list:
    """The self-attention modules of a transformers decoder (by class name: *Attention)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention")]


@contextmanager
def instrument(model, cache) -> Iterator[None]:
    """Profiler scopes around attention forwards (module hooks), ``cache.update`` and layer
    (de)quantization (the cache hook :func:`kvlab.policies.cache.profiler_scopes`)."""
    handles, open_scopes = [], []

    def pre(module, args, kwargs=None):
        rf = record_function(SCOPE_ATTENTION)
        rf.__enter__()
        open_scopes.append(rf)

    def post(module, args, output):
        if open_scopes:
            open_scopes.pop().__exit__(None, None, None)

    for m in attention_modules(model):
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        with profiler_scopes(cache, SCOPE_CACHE, SCOPE_QUANTIZE, SCOPE_DEQUANTIZE):
            yield
    finally:
        for h in handles:
            h.remove()
        while open_scopes:
            open_scopes.pop().__exit__(None, None, None)



def hf_anatomy(engine, policy, ctx: int, batch: int = 1, steps: int = 8, warmup: int = 2, seed: int = 0) -> Anatomy:
    """Prefill ``ctx`` tokens with a fresh cache of ``policy`` and profile ``steps`` transformers decode
    steps after ``warmup`` unprofiled ones (``engine``: a :class:`~kvlab.engine.hf.HFEngine`)."""
    loaded, model = engine.loaded, engine.model
    ids = synthetic_prompt(loaded.spec.vocab_size, ctx, batch, seed, loaded.device)
    sp = StepProfiler(loaded.device, steps, warmup)
    try:
        with policy.attach(model), torch.inference_mode():
            decoder = engine.decoder(policy, batch, ctx, sp.total_steps + 1)
            first = prefill(model, ids, decoder.cache)[:, -1].argmax(dim=-1, keepdim=True)
            with instrument(model, decoder.cache):
                # n_new counts the first token too: total_steps decode steps follow it
                decoder.decode(first, sp.total_steps + 1, start_position=ctx, on_step=sp.on_step)
    finally:
        sp.close()
    return sp.result(policy.label, policy.name)


def fast_anatomy(engine, policy, ctx: int, batch: int = 1, steps: int = 8, warmup: int = 2, seed: int = 0) -> Anatomy:
    """Prefill ``ctx`` tokens under ``policy``, then profile ``steps`` decode steps of the fast
    engine (graph replays on CUDA) after ``warmup`` unprofiled ones."""
    loaded = engine.loaded
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


def compare_methods(engine, methods: list[str], ctx: int, policy_params: dict[str, dict] | None = None,
                    steps: int = 8, warmup: int = 2, batch: int = 1) -> tuple[pd.DataFrame, list[Anatomy]]:
    """Anatomy of each method at one context on ``engine`` (:func:`kvlab.engine.engines.make_engine`):
    the long table the stacked-bar plot reads, and the per-method results."""
    policy_params = policy_params or {}
    results = [engine.anatomy(make_policy(m, **policy_params.get(m, {})), ctx, batch, steps, warmup)
               for m in methods]
    return anatomy_table(results), results
