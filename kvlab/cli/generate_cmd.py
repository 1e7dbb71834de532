"""`kvlab generate`: one greedy generation under a cache policy; prints the answer and what the
cache held (logical and physical tokens, bytes) after the prefill and at the end."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("generate", help="greedy generation under a cache policy, with the cache's size")
    p.add_argument("--model", required=True, help="preset name or local model folder")
    p.add_argument("--weights", choices=["real", "synthetic"], default=None,
                   help="synthetic: seeded random weights (needs --prompt-tokens)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: by device)")
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic weights and prompt tokens")
    p.add_argument("--method", default="full", help="cache policy (see `kvlab policies`)")
    g = p.add_argument_group("eviction")
    g.add_argument("--keep", type=float, help="fraction of prompt positions kept, in (0, 1]")
    g.add_argument("--window-size", type=int, help="snapkv/pyramidkv: last prompt queries that score")
    g.add_argument("--kernel-size", type=int, help="snapkv/pyramidkv: pooling kernel")
    g.add_argument("--n-sink", type=int, help="streamingllm: sink positions")
    g.add_argument("--beta", type=int, help="pyramidkv: pyramid steepness")
    g.add_argument("--policy-seed", type=int, help="random: eviction seed")
    q = p.add_argument_group("quantization (a quantized method, or an eviction method: evict then quantize)")
    q.add_argument("--bits", type=int, help="bits per stored element")
    q.add_argument("--backend", help="quantization backend with an eviction method (default quanto; "
                                      "`kvlab policies` lists them)")
    q.add_argument("--group-size", type=int, help="elements per scale/zero point (default 64)")
    q.add_argument("--residual", type=int, help="recent tokens kept at full precision (default 128)")
    q.add_argument("--axis-key", type=int)
    q.add_argument("--axis-value", type=int)
    q.add_argument("--key-offset", help="kvq: per-channel key offset subtracted before quantizing, prompt-mean "
                                        "(default) or none (the per-token layout without it)")
    d = p.add_argument_group("decode-time compression (--method decoding)")
    d.add_argument("--target", type=int, help="rows per layer and KV head kept at each compression (default 2048)")
    d.add_argument("--interval", type=int, help="tokens appended after the prompt between compressions (default 512)")
    d.add_argument("--score", help="what ranks the rows: a scoring method (decoding's score in `kvlab policies`; default snapkv)")
    r = p.add_argument_group("KIVI and Quest reads (--method kivi: also --bits, --group-size, --residual)")
    r.add_argument("--key-bits", type=int, help="kivi: bits per stored key, 2 or 4 (default: --bits)")
    r.add_argument("--value-group", type=int, help="kivi: head_dim elements per value scale (default 32)")
    r.add_argument("--page", type=int, help="quest: tokens per page (default 16)")
    r.add_argument("--token-budget", type=int, help="quest: tokens read per decode step (default 2048)")
    r.add_argument("--group-reduce", help="quest: how a KV head's query heads rank pages, max or sum (default max)")
    r.add_argument("--dense-layers", type=int, help="quest: leading layers read densely (default 2)")
    a = p.add_argument_group("head-adaptive budgets (--method adakv)")
    a.add_argument("--scorer", help="adakv: the method whose scores rank positions (default snapkv; "
                                    "`kvlab policies` lists them)")
    a.add_argument("--alpha-safeguard", type=float,
                   help="adakv: each head keeps at least this fraction of the layer's per-head budget (default 0.2)")
    a.add_argument("--scope", help="adakv: layer (one budget per layer) or model (kvzip scorer only)")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="any policy parameter without a flag of its own, value parsed as YAML (repeatable), "
                        "e.g. --param epsilon=0.01 or --param 'scorer_params={epsilon: 0.01}'")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-file", help="text file holding the prompt")
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-tokens", type=int, help="seeded random prompt of exactly N token ids")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=16, help="exactly this many tokens (EOS ignored)")
    p.add_argument("--engine", choices=["hf", "fast"], default="hf",
                   help="decode loop: hf (transformers forward per step) or fast (static KV, CUDA graph)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill the prompt this many tokens at a time, compressing as it streams in")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-fidelity-check", action="store_true",
                   help="skip the check that a compressed cache still answers (the reply teacher-forced through "
                        "the full cache and this one: two more prefills)")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlab.cli.generate_run import generate  # loads torch: after argparse, before any check

    return generate(args)
