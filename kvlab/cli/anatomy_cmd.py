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
    p.add_argument("--json", action="store_true", help="print the long table as JSON records")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlab import anatomy
    from kvlab.measure import sdpa_context
    from kvlab.models import load_model

    try:
        policy_params = json.loads(args.params)
    except json.JSONDecodeError as err:
        raise anatomy.AnatomyError(f"--params is not JSON ({err}); e.g. --params '{{\"quanto\": {{\"nbits\": 4}}}}'") from None
    loaded = load_model(args.model, weights=args.weights, device=args.device)
    with sdpa_context(args.sdpa_backend):
        table, _ = anatomy.compare_methods(loaded, args.methods, args.ctx, policy_params, steps=args.steps,
                                           warmup=args.warmup)
    if args.json:
        print(table.to_json(orient="records"))
    else:
        print(f"{args.model} on {args.device}, ctx {args.ctx}: ms per decode step")
        print(anatomy.category_table(table).to_string())
    return 0
