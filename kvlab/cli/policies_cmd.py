"""`kvlab policies`: the cache policies kvlab can run, with their typed parameters and defaults."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("policies", help="list cache policies (methods) and their parameters")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def describe() -> dict[str, dict]:
    from kvlab.policies import POLICIES

    return {name: {"summary": cls.summary, "params": cls.describe()} for name, cls in POLICIES.items()}


def run(args) -> int:
    table = describe()
    if args.json:
        print(json.dumps(table))
        return 0
    width = max(map(len, table))
    for name, info in table.items():
        print(f"{name:<{width}}  {info['summary']}")
        for row in info["params"]:
            default = json.dumps(row["default"])
            print(f"    {row['name']:<16} {row['type']:<18} = {default:<6} {row['help']}")
    from kvlab.policies.quantized import BACKENDS

    backends = "|".join(repr(name) for name in BACKENDS)
    print(f"\nEviction methods take quant={{'backend': {backends}, 'nbits': ...}} to evict then "
          "quantize\n(CLI: kvlab generate --method snapkv --keep 0.25 --bits 4 --backend quanto).")
    return 0
