"""ShareGPT V3's (prompt, output) token lengths after vLLM's filter, as a trace CSV that a model
without a tokenizer (synthetic weights) can serve: ``lengths: {kind: trace, path: ...}``.

    python scripts/sharegpt_lengths.py --model smollm2-135m -n 1000 -o data/sharegpt-smollm2-1000.csv

The counts are the named model's tokenizer's (say which in the report: Llama-3's counts differ by a
few percent); arrival times are 0 (give the traffic block its own arrivals).
"""

from __future__ import annotations

import argparse
import csv
import statistics

from kvlab.models import load_model
from kvlab.serve import sharegpt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model with a tokenizer (real weights)")
    ap.add_argument("-n", type=int, default=1000, help="conversations to keep (vLLM's --num-prompts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", required=True)
    args = ap.parse_args(argv)
    tokenizer = load_model(args.model).tokenizer
    samples, counts = sharegpt.sample(tokenizer, args.n, args.seed)
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arrival_s", "input_tokens", "output_tokens"])
        writer.writerows([0.0, len(s.prompt_ids), s.output_len] for s in samples)
    ins, outs = [len(s.prompt_ids) for s in samples], [s.output_len for s in samples]
    print(f"{counts}; input median {statistics.median(ins)}, output median {statistics.median(outs)} -> {args.out}")


if __name__ == "__main__":
    main()
