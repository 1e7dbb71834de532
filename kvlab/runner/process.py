"""The ``process`` executor: each group of runs in a fresh child process (multiprocessing spawn).

Isolation without Ray, as optimum-benchmark's process launcher does it: the child loads the
model, measures, and sends each message through a pipe as it happens (a synchronous write, so
nothing sent before a crash is lost); the driver writes them. A child that segfaults, calls
``os._exit`` or is killed by the OOM killer leaves its run recorded as failed with the cause.
Groups run one at a time, on the params' device.
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import traceback
from collections.abc import Callable, Iterator

from kvlab.runner.drive import WorkerDied, drive, shape_groups
from kvlab.runner.worker import GroupJob, run_job

JOIN_TIMEOUT_S = 30.0


def exit_cause(exitcode: int | None) -> str:
    """A child's exit status in words (a negative code is the signal that ended it)."""
    if exitcode is None:
        return "the worker process did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = {"SIGKILL": " (the kernel's out-of-memory killer, or kill -9)",
                "SIGSEGV": " (a segmentation fault)", "SIGABRT": " (an abort, e.g. a failed CUDA assert)"}
        return f"the worker process was killed by {name}{hint.get(name, '')}"
    return f"the worker process exited with status {exitcode}"


def _child(conn, job: GroupJob) -> None:
    """The child's main: measure the group; a Python error escaping it is sent as ``fatal``."""
    try:
        run_job(job, conn.send, executor="process")
        conn.send(("end",))
    except BaseException as err:  # noqa: BLE001 (reported to the driver, then exit 1)
        try:
            conn.send(("fatal", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        finally:
            conn.close()
        raise SystemExit(1) from None
    conn.close()


def spawn_transport(job: GroupJob) -> Iterator[tuple]:
    """Start a spawned child for ``job`` and yield its messages; :class:`WorkerDied` if it died."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, job), name="kvlab-sweep-worker", daemon=True)
    proc.start()
    sender.close()  # the child holds the only writing end: EOF means it is gone
    fatal = None
    ended = eof = False
    try:
        while True:
            try:
                msg = receiver.recv()
            except EOFError:
                eof = True
                break
            if msg[0] == "end":
                ended = True
            elif msg[0] == "fatal":
                fatal = msg[1]
            else:
                yield msg
    finally:
        if not eof:  # the driver stopped listening (e.g. Ctrl-C): do not leave the child running
            proc.kill()
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        receiver.close()
    if fatal is not None:
        raise WorkerDied(fatal)
    if not ended or proc.exitcode != 0:
        raise WorkerDied(exit_cause(proc.exitcode))


class ProcessExecutor:
    name = "process"

    @classmethod
    def from_options(cls, *, ray_address: str | None = None, log=print):
        """The executor :func:`kvlab.runner.make_executor` makes from a sweep's options."""
        return cls(log=log)

    def __init__(self, log: Callable[[str], None] = print, transport=spawn_transport):
        self.log = log
        self.transport = transport

    def check(self, *, loader, sampler_factory) -> None:
        """Children get the loader and sampler factory pickled: refuse a lambda before anything runs."""
        for what, fn in (("loader", loader), ("sampler_factory", sampler_factory)):
            try:
                pickle.dumps(fn)
            except Exception as err:
                raise ValueError(f"executor: process sends {what} {fn!r} to child processes, which needs a "
                                 f"module-level function (not a lambda or closure) ({err})") from None

    def run(self, params, pending, sink, budget, *, sweep_name, loader, sampler_factory) -> None:
        drive(shape_groups(pending), self.transport, slots=1, params=params, sink=sink, budget=budget,
              sweep_name=sweep_name, loader=loader, sampler_factory=sampler_factory)
