"""One sweep per folder: an exclusive ``flock`` on ``<folder>/sweep.lock``; a lock left by a dead
process is detected and replaced, and the file is removed when the sweep ends."""

from __future__ import annotations

import fcntl
import json
import os
import socket
from pathlib import Path
from typing import Any

from kvlab.records import utc_now

LOCK_FILE = "sweep.lock"


class SweepLocked(RuntimeError):
    """Another live sweep is writing this folder."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SweepLock:
    """An exclusive ``flock`` on ``<folder>/sweep.lock`` holding the owner's pid and host.

    The kernel drops a flock when its process dies, so a lock left by ``kill -9`` is free to take;
    ``stale`` then says whose it was. On release the file is deleted while still locked; a process
    that was waiting on the deleted file's lock sees that its inode is no longer the path's and
    opens the path again, so two sweeps never hold two different files.
    """

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / LOCK_FILE
        self.stale: dict[str, Any] | None = None
        self._fd: int | None = None

    def _read(self, fd: int) -> dict[str, Any] | None:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, 4096).decode(errors="replace").strip()
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return {"raw": raw}

    def _open_locked(self) -> int:
        """A descriptor of the path's current file, exclusively locked (or :class:`SweepLocked`)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return self._refuse(fd)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)  # the holder deleted it as we locked it: lock the path's new file

    def _refuse(self, fd: int) -> int:
        holder = self._read(fd) or {}
        os.close(fd)
        who = f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started_at')}"
        raise SweepLocked(f"{self.path.parent} is being written by another sweep ({who}); wait for it to finish, "
                          f"or write to another folder with -o")

    def acquire(self) -> SweepLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = self._open_locked()
        previous = self._read(fd)
        if previous and previous.get("pid"):
            same_host = previous.get("host") == socket.gethostname()
            if not (same_host and _pid_alive(int(previous["pid"])) and int(previous["pid"]) != os.getpid()):
                self.stale = previous
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                 "started_at": utc_now()}).encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> SweepLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
