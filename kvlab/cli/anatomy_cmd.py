"""`kvlab anatomy`: where one decode step's time goes, per cache method (torch.profiler)."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("anatomy", help="profile decode steps per method: GEMMs, attention, cache, "
                       "(de)quantize, launch gap")
    p.add_argument("--model", default="smollm2-135m", help="preset name or local model folder")
    p.add_argument("--weights", choices=["real", "synthetic"], default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ctx", type=int, default=1024, help="prompt length before the profiled steps")
    p.add_argument("--methods", nargs="+", default=["full", "quanto"], help="policy names")
    p.add_argument("--params", default="{}", help='JSON: per-method policy params, e.g. \'{"quanto": {"nbits": 4}}\'')
    p.add_argument("--steps", type=int, default=8, help="profiled decode steps")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled decode steps first")
    p.add_argument("--sdpa-backend", default="auto", help="pin torch's SDPA kernel: auto, cudnn, flash, efficient, math")
    p.add_argument("--engine", choices=["hf", "fast"], default="hf",
                   help="profile transformers' decode step (hf) or the fast engine's graph replays (fast)")
    p.add_argument("--json", action="store_true", help="print the long table as JSON records")
    p.set_defaults(func=run)


def check_args(args) -> dict[str, dict]:
    """Every check that needs no weights; returns the per-method policy params."""
    from kvlab import anatomy
    from kvlab.models import get_spec
    from kvlab.policies import make_policy
    from kvlab.preflight import compressions, device_problem, require, shape_problems, weights_problem
    from kvlab.sweep.params import SDPA_BACKENDS

    try:
        policy_params = json.loads(args.params)
    except json.JSONDecodeError as err:
        raise anatomy.AnatomyError(f"--params is not JSON ({err}); e.g. --params '{{\"quanto\": {{\"nbits\": 4}}}}'") from None
    if not isinstance(policy_params, dict) or not all(isinstance(v, dict) for v in policy_params.values()):
        raise anatomy.AnatomyError("--params must map method names to objects, e.g. '{\"quanto\": {\"nbits\": 4}}'")
    unknown = sorted(set(policy_params) - set(args.methods))
    if unknown:
        raise anatomy.AnatomyError(f"--params names {', '.join(unknown)}, not among --methods {' '.join(args.methods)}")
    if args.sdpa_backend not in SDPA_BACKENDS:
        raise anatomy.AnatomyError(f"--sdpa-backend {args.sdpa_backend!r}: use one of {', '.join(SDPA_BACKENDS)}")
    if args.steps < 1 or args.warmup < 1:
        raise anatomy.AnatomyError(f"--steps and --warmup must be >= 1 (got {args.steps} and {args.warmup})")
    require(device_problem(args.device))
    spec = get_spec(args.model)
    require(weights_problem(args.model, args.weights))
    policies = [make_policy(method, **policy_params.get(method, {})) for method in args.methods]
    for policy in policies:
        policy.check(spec)
        if args.engine == "fast":
            policy.fast_storage()
    if args.engine == "fast":
        from kvlab.engine.llama import check_model_type

        check_model_type(spec.model_type)
    require(*shape_problems(spec, args.device, None, args.ctx, 1, args.warmup + args.steps + 1,
                            ctx_key="--ctx", new_key="decode steps (--warmup + --steps + 1)",
                            compressions=compressions(policies)))
    return policy_params


def run(args) -> int:
    from kvlab import anatomy
    from kvlab.measure import sdpa_context
    from kvlab.models import load_model

    policy_params = check_args(args)  # before the model loads
    loaded = load_model(args.model, weights=args.weights, device=args.device)
    with sdpa_context(args.sdpa_backend):
        if args.engine == "fast":
            from kvlab.engine.anatomy import fast_anatomy
            from kvlab.engine.fast import FastEngine
            from kvlab.policies import make_policy

            engine = FastEngine(loaded, max_decoders=1)
            table = anatomy.anatomy_table([
                fast_anatomy(loaded, make_policy(m, **policy_params.get(m, {})), args.ctx, steps=args.steps,
                             warmup=args.warmup, engine=engine) for m in args.methods])
        else:
            table, _ = anatomy.compare_methods(loaded, args.methods, args.ctx, policy_params, steps=args.steps,
                                               warmup=args.warmup)
    if args.json:
        print(table.to_json(orient="records"))
    else:
        print(f"{args.model} on {args.device}, ctx {args.ctx}, engine {args.engine}: ms per decode step")
        print(anatomy.category_table(table).to_string())
    return 0
