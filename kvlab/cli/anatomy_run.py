"""`kvlab anatomy`'s work: checks before the load, then the profiled decode steps per method."""

from __future__ import annotations

import json

from kvlab import models
from kvlab.anatomy import AnatomyError, category_table
from kvlab.engine import check_model_type
from kvlab.engine.anatomy import compare_methods
from kvlab.engine.engines import EngineSet
from kvlab.measure import sdpa_context
from kvlab.policies import make_policy
from kvlab.preflight import compressions, device_problem, require, shape_problems, weights_problem
from kvlab.sweep.params import SDPA_BACKENDS


def check_args(args) -> dict[str, dict]:
    """Every check that needs no weights; returns the per-method policy params."""
    try:
        policy_params = json.loads(args.params)
    except json.JSONDecodeError as err:
        raise AnatomyError(f"--params is not JSON ({err}); e.g. --params '{{\"quanto\": {{\"nbits\": 4}}}}'") from None
    if not isinstance(policy_params, dict) or not all(isinstance(v, dict) for v in policy_params.values()):
        raise AnatomyError("--params must map method names to objects, e.g. '{\"quanto\": {\"nbits\": 4}}'")
    unknown = sorted(set(policy_params) - set(args.methods))
    if unknown:
        raise AnatomyError(f"--params names {', '.join(unknown)}, not among --methods {' '.join(args.methods)}")
    if args.sdpa_backend not in SDPA_BACKENDS:
        raise AnatomyError(f"--sdpa-backend {args.sdpa_backend!r}: use one of {', '.join(SDPA_BACKENDS)}")
    if args.steps < 1 or args.warmup < 1:
        raise AnatomyError(f"--steps and --warmup must be >= 1 (got {args.steps} and {args.warmup})")
    require(device_problem(args.device))
    spec = models.get_spec(args.model)
    require(weights_problem(args.model, args.weights))
    policies = [make_policy(method, **policy_params.get(method, {})) for method in args.methods]
    for policy in policies:
        policy.check(spec)
        if args.engine == "fast":
            policy.storage()
    if args.engine == "fast":
        check_model_type(spec.model_type)
    require(*shape_problems(spec, args.device, None, args.ctx, 1, args.warmup + args.steps + 1,
                            ctx_key="--ctx", new_key="decode steps (--warmup + --steps + 1)",
                            compressions=compressions(policies)))
    return policy_params


def anatomy(args) -> int:
    """``kvlab anatomy``: checks before the load, then each method's profiled decode steps."""
    policy_params = check_args(args)  # before the model loads
    loaded = models.load_model(args.model, weights=args.weights, device=args.device)
    engine = EngineSet(loaded).get(args.engine)  # fast: one decoder at a time
    with sdpa_context(args.sdpa_backend):
        table, _ = compare_methods(engine, args.methods, args.ctx, policy_params, steps=args.steps,
                                   warmup=args.warmup)
    if args.json:
        print(table.to_json(orient="records"))
    else:
        print(f"{args.model} on {args.device}, ctx {args.ctx}, engine {args.engine}: ms per decode step")
        print(category_table(table).to_string())
    return 0
