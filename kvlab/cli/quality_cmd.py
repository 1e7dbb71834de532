"""`kvlab quality`: the offline quality pass (generated retrieval tasks, LongBench files, continuation
fidelity) for one model and a set of cache policies; records go to DIR/records.jsonl.

    kvlab quality --model smollm2-135m --tasks niah_single --lengths 1024 2048 \\
        --methods full streamingllm snapkv quanto --keep 0.25 --bits 4 -o runs/quality

Any policy parameter a sweep takes: `--param KEY=VALUE` gives it to every listed method that takes it
(`kvlab policies` lists them), and a method may be a sweep's `methods:` entry in YAML:

    kvlab quality --methods full snapkv tova --param window_size=32 --keep 0.25 -o runs/q
    kvlab quality --methods full '{method: snapkv, keep: [0.25, 0.5], window_size: 32}' -o runs/q

Rerunning into the same folder resumes: items recorded ok are not run again. Exit status: 0 when
every record is ok, 3 when some failed (their errors are in the records), 2 for bad input.
"""

from __future__ import annotations

import argparse

import yaml
from pydantic import ValidationError

from kvlab.errors import UserError
from kvlab.quality import TaskSpec

# TaskSpec fields whose flag is not --field-name
FLAGS = {"no_signal_threshold": "--threshold", "text_files": "--text"}


def register(subparsers) -> None:
    p = subparsers.add_parser("quality", help="score cache policies on offline tasks and against the full cache",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="preset name or local model folder (needs a tokenizer)")
    p.add_argument("--weights", choices=("real", "synthetic"), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: bf16 on cuda, fp32 on cpu)")
    p.add_argument("--tasks", nargs="*", default=["niah_single"],
                   help="niah_single niah_multikey niah_multivalue variable_tracking (vt) continuation")
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048], help="prompt tokens per item")
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.5, 0.9], help="needle depths in [0, 1]")
    p.add_argument("--samples", type=int, default=2, help="items per (task, length, depth)")
    p.add_argument("--methods", nargs="+", type=method_arg, default=["full"],
                   help="policy names (see `kvlab policies`), or a sweep's method entry in YAML, "
                        "e.g. '{method: snapkv, keep: 0.25}'")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a policy parameter (value parsed as YAML) for every listed method that takes it; repeatable")
    p.add_argument("--keep", nargs="+", type=float, default=None, help="kept fractions for eviction methods")
    p.add_argument("--bits", nargs="+", type=int, default=None, help="bit widths for quantized methods")
    p.add_argument("--query-aware", action="store_true", help="compress the question with the context")
    p.add_argument("--threshold", type=float, default=0.7,
                   help="full-cache score below which a (task, length) cell is marked no_signal")
    p.add_argument("--max-new-tokens", type=int, default=None, help="override the tasks' generation budgets")
    p.add_argument("--longbench", default=None, help="a LongBench jsonl file or folder you already have")
    p.add_argument("--longbench-datasets", nargs="+", default=None, help="only these LongBench datasets")
    p.add_argument("--text", nargs="+", default=[], help="text files for the continuation task "
                   "(default: text that ships with Python)")
    p.add_argument("--continuation-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", choices=["hf", "fast"], default="hf",
                   help="decode loop of the greedy replies: hf (transformers) or fast (static KV, CUDA graph)")
    p.add_argument("--weights-quant", choices=["none", "int8", "int4"], default="none",
                   help="quantize the model's weights first (optimum-quanto; engine hf): does the stack still answer?")
    p.add_argument("--prefill-chunk", nargs="+", type=chunk_arg, default=[None], metavar="N|none",
                   help="prefill chunk sizes in tokens, each run for every method (none: one shot)")
    p.add_argument("-o", "--out", required=True, help="output folder (records.jsonl, manifest.json, summary)")
    p.set_defaults(func=run)


def method_arg(text: str) -> str | dict:
    """A policy name, or (text starting with ``{``) a sweep ``methods:`` entry as YAML."""
    if not text.lstrip().startswith("{"):
        return text
    try:
        entry = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(entry, dict) or "method" not in entry:
        raise argparse.ArgumentTypeError(f"{text!r}: write a method entry as {{method: NAME, KEY: VALUE, ...}}")
    return entry


def chunk_arg(text: str) -> int | None:
    """``none``/``null`` (a one-shot prefill) or a token count (checked by the policies)."""
    return None if text.lower() in ("none", "null") else int(text)


def task_spec_from_args(args) -> TaskSpec:
    """The flags as a :class:`~kvlab.quality.TaskSpec`; its validation errors named by flag."""
    try:
        return TaskSpec(tasks=args.tasks, lengths=args.lengths, depths=args.depths, samples=args.samples,
                        seed=args.seed, query_aware=args.query_aware, no_signal_threshold=args.threshold,
                        max_new_tokens=args.max_new_tokens, longbench=args.longbench,
                        longbench_datasets=args.longbench_datasets, text_files=args.text,
                        continuation_tokens=args.continuation_tokens)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            field = str(e["loc"][0]) if e["loc"] else ""
            flag = FLAGS.get(field, "--" + field.replace("_", "-")) if field else "quality"
            lines.append(f"{flag}: {e['msg'].removeprefix('Value error, ')}")
        raise UserError("; ".join(dict.fromkeys(lines))) from None


def run(args) -> int:
    spec = task_spec_from_args(args)  # before torch loads
    from kvlab.cli.quality_run import quality  # loads torch

    return quality(args, spec)
