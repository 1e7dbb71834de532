"""The `kvlab` command: one small module per subcommand, registered in COMMANDS."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module exposing `register(subparsers)`; each module adds its own parser and sets
# `func(args) -> int` as the default.
COMMANDS = {
    "models": "kvlab.cli.models_cmd",
    "budget": "kvlab.cli.budget_cmd",
    "sweep": "kvlab.cli.sweep_cmd",
    "quality": "kvlab.cli.quality_cmd",
    "report": "kvlab.cli.report_cmd",
    "anatomy": "kvlab.cli.anatomy_cmd",
    "policies": "kvlab.cli.policies_cmd",
    "generate": "kvlab.cli.generate_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlab", description="Measure what KV-cache compression does to memory, time, energy and quality.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as err:  # validation errors carry the fix in their message
        print(f"kvlab {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
