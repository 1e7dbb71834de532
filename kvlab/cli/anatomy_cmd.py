"""`kvlab anatomy`: where one decode step's time goes, per cache method (torch.profiler)."""

from __future__ import annotations


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


def run(args) -> int:
    from kvlab.cli.anatomy_run import anatomy  # loads torch: after argparse, before any check

    return anatomy(args)
