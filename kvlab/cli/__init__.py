"""The `kvlab` command: one small module per subcommand, registered in COMMANDS."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys

from kvlab.errors import UserError

# Exit statuses a script can branch on; STATUS_EXIT maps a sweep's (or quality pass's) status.
EXIT_OK = 0
EXIT_USAGE = 2  # argparse's own status for bad arguments
EXIT_FAILED_RUNS = 3  # every planned run recorded, some failed: fix the cause and rerun to retry them
EXIT_INCOMPLETE = 4  # stopped early (run or time budget): rerun the same command to continue
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report SIGINT
EXIT_TERMINATED = 143  # SIGTERM (kill, systemd, Slurm, Kubernetes), as shells report it
STATUS_EXIT = {"complete": EXIT_OK, "failed_runs": EXIT_FAILED_RUNS, "incomplete": EXIT_INCOMPLETE}

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
    "serve": "kvlab.cli.serve_cmd",
    "loadgen": "kvlab.cli.loadgen_cmd",
}


class OneLineParser(argparse.ArgumentParser):
    """argparse with its errors as one ``kvlab CMD: error: ...`` line (no usage block above it),
    like every other user mistake; ``kvlab CMD --help`` still prints the usage."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``command`` only when it names one (only its module loads, with what that
    module imports: ``kvlab budget`` stays pure arithmetic), else of every command (``--help``)."""
    parser = OneLineParser(
        prog="kvlab", description="Measure what KV-cache compression does to memory, time, energy and quality.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        if command not in COMMANDS or name == command:
            importlib.import_module(module).register(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so a sweep unwinds as from Ctrl-C: records kept,
    manifest written ``incomplete``, workers stopped."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While a command runs, SIGTERM raises :class:`Terminated` once (a second one during the
    clean-up is ignored, so the clean-up finishes); the previous handler comes back after."""
    if sys.platform == "win32" or not _main_thread():
        yield
        return

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; see the EXIT_* statuses. A user mistake is one ``kvlab CMD: error: ...``
    line with status 2 and nothing loaded; a traceback (status 1) is a bug in kvlab."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    try:
        with sigterm_as_interrupt():
            return int(args.func(args) or 0)
    except UserError as err:  # user mistakes carry the fix in their message
        print(f"kvlab {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader left (kvlab policies | head): nothing more to say, and no traceback
        sys.stderr.close()  # Python's own flush at exit would raise again
        return EXIT_OK
    except KeyboardInterrupt as err:
        what = "terminated (SIGTERM)" if isinstance(err, Terminated) else "interrupted"
        print(f"kvlab {args.command}: {what}; every record written so far is kept (rerun to continue)",
              file=sys.stderr)
        return EXIT_TERMINATED if isinstance(err, Terminated) else EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
