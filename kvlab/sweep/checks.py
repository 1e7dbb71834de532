"""Every check of a sweep's params, before any model loads: an unknown method, a context above the
model's maximum, ``keep: 0``, an unsupported bit width or a device without the memory each give one
line that names the key and the fix, all gathered into one :class:`~kvlab.sweep.params.ParamsError`.
"""

from __future__ import annotations

import importlib.util

from pydantic import ValidationError

from kvlab import preflight
from kvlab.budget import context_problem
from kvlab.engine import check_model_type
from kvlab.errors import UserError
from kvlab.models import ModelError, get_spec
from kvlab.preflight import (
    compressions,
    device_problem,
    outlier_keys_warnings,
    shape_problems,
    weights_problem,
)
from kvlab.quality import TaskSpec
from kvlab.sweep.params import (
    DTYPES,
    MethodVariant,
    SweepParams,
    method_variants,
    params_error,
    pydantic_lines,
)
from kvlab.sweep.ray_address import address_problem
from kvlab.weights_quant import weights_quant_problems
from kvlab.workload import CtxDistribution, context_points

# transformers' attention implementations kvlab can load a model with (kvlab.storage.attention
# wraps each); the flash ones need their package
ATTN_IMPLEMENTATIONS = {"sdpa": None, "eager": None, "flex_attention": None,
                        "flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def attn_problem(name: str) -> str | None:
    """Why transformers cannot load a model with attention ``name`` here, or None."""
    if name not in ATTN_IMPLEMENTATIONS:
        return f"attn_implementation: {name!r} is not one of {', '.join(ATTN_IMPLEMENTATIONS)} (sdpa: the default)"
    package = ATTN_IMPLEMENTATIONS[name]
    if package and importlib.util.find_spec(package) is None:
        return f"attn_implementation: {name} needs the {package} package, not installed here; use sdpa"
    return None


def budget_problems(params: SweepParams, check_device: bool = True) -> list[str]:
    """Why a sweep's ``budget_gb`` (:mod:`kvlab.sweep.admission`) cannot run (one line each); with
    ``check_device``, a budget above the memory the device has available now (admission would
    otherwise fit billions of sequences into it and fail allocating them)."""
    budget = params.budget_gb
    if budget is None:
        return [] if params.budget_max_batch is None else [
            "budget_max_batch: only used with budget_gb; add budget_gb: 40 (or gpu), or drop it"]
    problems = []
    if budget == "gpu" and not str(params.device).startswith("cuda"):
        problems.append("budget_gb: gpu needs device: cuda; on a CPU give a number of GB")
    if budget != "gpu" and not budget > 0:
        problems.append(f"budget_gb: {budget} must be positive (GB), or gpu for the whole free GPU")
    elif budget != "gpu" and check_device:
        available = preflight.available_memory_bytes(params.device)
        if available is not None and budget * 1e9 > available:
            problems.append(f"budget_gb: {budget:,.10g} GB is above the {available / 1e9:,.1f} GB {params.device} has "
                            f"available now; give at most {int(available / 1e9)}"
                            + (" (or gpu for the whole free GPU)" if params.device.startswith("cuda") else ""))
    if 1 not in params.batch or len(set(params.batch)) < 2:
        problems.append(f"batch: {params.batch} with budget_gb: list 1 (the single-stream view) and at least one "
                        f"more batch to fit the peak per sequence, e.g. batch: [1, 2]")
    return problems


def prefill_rows_problems(params: SweepParams) -> list[str]:
    """Why ``prefill_rows`` cannot run with the rest of the plan (one line each)."""
    if params.prefill_rows is None:
        return []
    problems = []
    if "hf" in params.engine:
        problems.append("prefill_rows: needs engine: fast only (transformers' decode cache cannot be put together "
                        "from row groups without holding the whole batch's cache); set engine: fast, or drop "
                        "prefill_rows for the hf runs (another sweep)")
    if params.budget_gb is not None:
        problems.append("prefill_rows: not with budget_gb (admission fits peaks that grow with the batch's "
                        "whole prefill); drop one of them")
    return problems


MAX_PLAN_RUNS = 100_000  # a day of runs at a second each; a larger grid is several sweeps


def plan_size(params: SweepParams, n_variants: int) -> int:
    """How many measured runs the params plan, from the axes' lengths alone (no expansion)."""
    n_ctx = params.ctx.samples if isinstance(params.ctx, CtxDistribution) else len(params.ctx)
    return (len(params.models) * len(params.weights_quant) * n_ctx * len(params.batch) * params.repeats
            * params.prompts * n_variants * len(params.engine))


def plan_size_problem(params: SweepParams, n_variants: int) -> str | None:
    """A plan past :data:`MAX_PLAN_RUNS`, refused before anything walks it."""
    n = plan_size(params, n_variants)
    if n <= MAX_PLAN_RUNS:
        return None
    return (f"the plan has {n:,} runs (models x weights_quant x ctx x batch x repeats x prompts x method variants "
            f"x engine); a sweep plans at most {MAX_PLAN_RUNS:,}: list fewer values, or split it into sweeps "
            f"with their own -o")


def duplicate_variant_problems(variants: list[tuple[str, MethodVariant]]) -> list[str]:
    """Two method entries that expand to the same variant would record one run id twice."""
    first: dict[tuple, str] = {}
    problems = []
    for where, v in variants:
        if v.key() in first and first[v.key()] != where:
            args = ", ".join(f"{k}={val!r}" for k, val in v.kwargs.items())
            problems.append(f"{where} repeats {first[v.key()]} ({v.method}{': ' + args if args else ''}): "
                            f"list each method variant once")
        first.setdefault(v.key(), where)
    return problems


def params_notes(params: SweepParams) -> list[str]:
    """What valid params run as other than written (one sentence each, printed as notes): a
    context distribution's draws clipped to a model's window."""
    notes = []
    if isinstance(params.ctx, CtxDistribution) and params.ctx.dist is not None:
        draws = params.ctx.raw_draws(params.seed, params.ctx.samples)
        for name in params.models:
            try:
                spec = get_spec(name)
            except ModelError:
                continue  # check_params says why
            note = params.ctx.clip_note(draws, spec.max_context - params.new_tokens,
                                        f"{name}'s window {spec.max_context} minus new_tokens {params.new_tokens}")
            if note:
                notes.append(note)
    return notes


def outlier_keys_lines(params: SweepParams, join: bool = True) -> dict[str, list[str]]:
    """Model -> the preflight's outlier-key warnings for every method variant that quantizes keys per
    token without a key offset (:func:`kvlab.preflight.outlier_keys_warnings`)."""
    from kvlab.policies import make_policy  # torch: a params file is read and parsed without it

    policies = []
    for _, v in method_variants(params):
        try:
            policies.append(make_policy(v.method, **v.kwargs))
        except ValueError:
            pass  # check_params reports it
    return {name: outlier_keys_warnings(name, params.weights, policies, join) for name in params.models}


def check_params(params: SweepParams, check_device: bool = True,
                 own_loader: bool = False, serving: bool = False) -> list[tuple[int, MethodVariant]]:
    """Validate against models, policies and (with ``check_device``) this machine's device and its
    memory, without loading weights; returns the method variants. ``own_loader``: the caller loads
    models itself (a test's loader may give synthetic weights a tokenizer; kvlab's never does).

    Raises one :class:`ParamsError` listing every problem.
    """
    from kvlab.policies import SERVED, make_policy  # torch: a params file is read and parsed without it

    size_problem = plan_size_problem(params, len(method_variants(params)))
    if size_problem:  # before any check walks the plan
        raise params_error([size_problem])
    problems: list[str] = []
    # device and dtype
    device_bad = device_problem(params.device, key="device", check_available=check_device,
                                fix="use --set device=cpu")
    if device_bad:
        problems.append(device_bad)
    if params.dtype is not None and params.dtype not in DTYPES:
        problems.append(f"dtype: {params.dtype!r} is not one of {', '.join(DTYPES)}")
    dev = params.device
    if params.executor == "ray":
        if importlib.util.find_spec("ray") is None:
            problems.append("executor: ray needs the ray package; install it with pip install 'kvlab[ray]'")
        elif check_device:
            problem = address_problem(params.ray_address)
            if problem:
                problems.append(problem)
        if dev.startswith("cuda:") and dev != "cuda:0":
            problems.append(f"device: {dev!r} with executor: ray; use device: cuda (Ray gives each worker "
                            f"its GPU as cuda)")
    elif params.ray_address is not None:
        problems.append("ray_address: only used with executor: ray; add --executor ray (or drop ray_address)")
    problems += [p for p in (attn_problem(params.attn_implementation),) if p]
    if params.sdpa_backend != "auto" and params.attn_implementation != "sdpa":
        problems.append(f"sdpa_backend: {params.sdpa_backend!r} only applies with attn_implementation: sdpa")
    if not params.methods:
        problems.append("methods: empty; list at least one method, e.g. [full]")
    if params.traffic is not None and not serving:
        problems.append("traffic: kvlab sweep runs static batches; a traffic block runs with "
                        "python benchmarks/serve_rates.py PARAMS -o OUT (or drop traffic)")
    problems += weights_quant_problems(params.weights_quant, params.engine)
    problems += budget_problems(params, check_device)
    problems += prefill_rows_problems(params)

    # models, weights, context limits and memory (for the most compressed method that builds)
    built = []
    for _, v in method_variants(params):
        try:
            built.append(make_policy(v.method, **v.kwargs))
        except ValueError:
            pass  # reported below
    specs = []
    shortest = 0  # the plan's shortest prompt, for policy.shape_problem
    for i, name in enumerate(params.models):
        try:
            spec = get_spec(name)
        except ModelError as err:
            problems.append(f"models[{i}]: {err}")
            continue
        specs.append(spec)
        problem = weights_problem(name, params.weights, key=f"models[{i}]", fix="set weights: synthetic",
                                  check_files=check_device)
        if problem:
            problems.append(problem)
        if "fast" in params.engine:
            try:
                check_model_type(spec.model_type)
            except ValueError as err:
                problems.append(f"engine: fast with models[{i}] {name}: {err}")
        try:
            if isinstance(params.ctx, CtxDistribution):
                problem = params.ctx.window_problem(spec.max_context - params.new_tokens,
                                                    f"{name}'s window {spec.max_context} minus new_tokens {params.new_tokens}")
                if problem:
                    problems.append(problem)
            contexts = sorted({p.ctx for p in context_points(params.ctx, params.seed,
                                                             spec.max_context - params.new_tokens)})
        except UserError as err:
            problems.append(str(err))
            contexts = []
        shortest = min((c for c in (shortest, *contexts) if c), default=0)
        for ctx in contexts:
            problems += shape_problems(spec, params.device, params.dtype, ctx, max(params.batch),
                                       params.new_tokens, check_memory=check_device and not device_bad,
                                       compressions=compressions(built))

    # the quality pass: its own keys
    if not params.perf and params.quality is None:
        problems.append("perf: false runs the quality pass alone, and there is no quality block: add "
                        "quality: {tasks: [...], lengths: [...]} or drop perf: false")
    if not params.perf and params.budget_gb is not None:
        problems.append("budget_gb: admits sequences by the performance runs' peaks, and perf: false runs none: "
                        "drop budget_gb or perf: false")
    if params.quality is not None and params.weights == "synthetic" and not own_loader:
        problems.append("quality: needs a tokenizer, and synthetic weights come without one (the tasks are "
                        "text); set weights: real (or drop quality, or run kvlab quality on a real model)")
    if params.quality is not None:
        try:
            task_spec = TaskSpec(**params.quality)
        except ValidationError as err:
            problems += pydantic_lines(err, list(TaskSpec.model_fields), prefix="quality.")
        else:
            for spec in specs:
                for length in task_spec.lengths:
                    problem = context_problem(spec, length, task_spec.max_new_tokens or 0, key="quality.lengths",
                                              new_key="quality.max_new_tokens")
                    if problem:
                        problems.append(problem)

    # methods: every variant must build, once
    variants = method_variants(params)
    problems += duplicate_variant_problems(variants)

    failures: dict[tuple[str, str], list[str]] = {}
    for where, v in variants:
        try:
            policy = make_policy(v.method, **v.kwargs)
            if "fast" in params.engine:
                policy.storage()
            for spec in specs:  # e.g. a q_group_size that does not divide the model's head dim
                policy.check(spec)
            problem = policy.shape_problem(shortest) if shortest else None
            if serving and params.traffic is not None and not problem:
                problem = policy.storage().block_size_problem(params.traffic.server.block_size)
            if problem:
                raise ValueError(problem)
        except ValueError as err:
            args = ", ".join(f"{k}={val!r}" for k, val in v.kwargs.items())
            failures.setdefault((where, str(err)), []).append(
                v.method + (f": {args}" if where not in ("keep", "bits") and args else ""))
    for (where, err), methods in failures.items():
        problems.append(f"{where} ({', '.join(dict.fromkeys(methods))}): {err}")
    unserved = [v.method for _, v in variants if v.method not in SERVED]
    if serving and unserved:
        problems.append(f"methods: {', '.join(dict.fromkeys(unserved))} not served yet; the serving engine runs "
                        f"{', '.join(SERVED)}")
    if problems:
        raise params_error(problems)
    return variants
