"""Decode-time compression on a long continuation: fidelity to the full cache, position by position.

SmolLM2-135M (real weights, CPU): a context window of text that ships with Python, then a long
continuation teacher-forced one token at a time (as decoding sees it) through each ``decoding``
cache (every ``--interval`` tokens evict back to ``--target``) and through the full cache. Prints
per policy KL(full || compressed), top-1 agreement, gold NLL, the cache it ended with and the KL
per quarter of the continuation; every row goes to ``--out``. E.g. (about 3-6 min on 2 CPU cores):

    python benchmarks/long_continuation.py --context 512 --continuation 1024 --target 256 --interval 64 \\
        --out outputs/long_continuation.json
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=1024)
    ap.add_argument("--scores", nargs="+", default=["snapkv", "tova", "knorm", "streamingllm"])
    ap.add_argument("--target", type=int, default=256)
    ap.add_argument("--interval", type=int, default=64)
    ap.add_argument("--window", type=int, default=32, help="snapkv's window_size (queries scoring each eviction)")
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--step", type=int, default=1, help="continuation tokens per forward (1: as decoding)")
    ap.add_argument("--out", default="long_continuation.json")
    args = ap.parse_args(argv)

    from kvlab.card import device_card
    from kvlab.long_continuation import continuation_fidelity
    from kvlab.models import load_model
    from kvlab.policies import make_policy
    from kvlab.quality.continuation import continuation_items
    from kvlab.tasks import Encoder

    started = time.time()
    loaded = load_model(args.model, device=args.device)
    enc = Encoder(loaded.tokenizer)
    policies = [make_policy("decoding", score=s, target=args.target, interval=args.interval,
                            score_params={"window_size": args.window} if s == "snapkv" else None)
                for s in args.scores]
    items = continuation_items(enc, [args.context], args.samples, args.continuation)
    result = {"args": vars(args), "card": device_card(args.device), "rows": []}
    for item in items:
        rows = continuation_fidelity(loaded, policies, item.context_ids, item.continuation_ids, args.step)
        for row in rows:
            row.update(sample=item.sample, source=item.source, offset=item.offset)
            result["rows"].append(row)
            print(f"{row['label']:32s} KL {row['kl']:.4f}  top-1 {row['top1_agree']:.3f}  NLL {row['gold_nll']:.3f} "
                  f"(full {row['ref_gold_nll']:.3f})  kept {row['final_physical_tokens']} rows, "
                  f"{row['compressions']} compressions  KL by quarter "
                  f"{' '.join(f'{k:.4f}' for k in row['kl_by_stretch'])}", flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    result["seconds"] = time.time() - started
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
