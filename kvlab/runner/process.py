"""The ``process`` executor: each group of runs in a fresh child process (multiprocessing spawn).

Isolation without Ray, as optimum-benchmark's process launcher does it: the child loads the
model, measures, and sends each message through a pipe as it happens (a synchronous write, so
nothing sent before a crash is lost); the driver writes them. A child that segfaults, calls
``os._exit`` or is killed by the OOM killer leaves its run recorded as failed with the cause.
Groups run one at a time, on the params' device.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator

from kvlab.runner.drive import WorkerDied, drive, shape_groups
from kvlab.runner.worker import GroupJob, run_job

JOIN_TIMEOUT_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h

_live: set = set()  # this driver's children now running (ProcessExecutor.run stops them when it unwinds)
_live_lock = threading.Lock()


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


def die_with_parent(parent_pid: int) -> None:
    """Tie this child to the driver: SIGKILL when the driver dies however it dies (Linux; strictly, when
    the driver's thread that started it ends: the transport's, which waits for the child), and
    Ctrl-C and SIGTERM sent to the whole process group left to the driver (it records what it
    has, then stops its children), so no worker outlives the sweep or dies before the driver knows."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the driver died before the tie was made
        os._exit(1)


def _child(conn, job: GroupJob, parent_pid: int | None = None) -> None:
    """The child's main: measure the group; a Python error escaping it is sent as ``fatal``. With
    the driver gone (its end of the pipe closed) the child leaves quietly: nobody is reading."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    try:
        run_job(job, conn.send, executor="process")
        conn.send(("end",))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        os._exit(1)
    except BaseException as err:  # noqa: BLE001 (reported to the driver, then exit 1)
        try:
            conn.send(("fatal", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
            conn.close()
        except OSError:
            os._exit(1)
        raise SystemExit(1) from None
    conn.close()


def stop_children() -> None:
    """Kill and reap every child this driver has running (the driver is unwinding: Ctrl-C, SIGTERM)."""
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)


def spawn_transport(job: GroupJob) -> Iterator[tuple]:
    """Start a spawned child for ``job`` and yield its messages; :class:`WorkerDied` if it died."""
    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, job, os.getpid()), name="kvlab-sweep-worker", daemon=True)
    proc.start()
    with _live_lock:
        _live.add(proc)
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
        with _live_lock:
            _live.discard(proc)
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
        try:
            drive(shape_groups(pending), self.transport, slots=1, params=params, sink=sink, budget=budget,
                  sweep_name=sweep_name, loader=loader, sampler_factory=sampler_factory)
        finally:  # a clean end has none left; an interrupted one must not leave a child measuring
            stop_children()
