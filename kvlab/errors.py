"""The one error type for user mistakes: bad arguments, params, files, YAML, devices or shapes.

The CLI turns a :class:`UserError` into ``kvlab CMD: error: MESSAGE`` and exit status 2, with no
traceback; any other exception is a bug in kvlab and keeps its traceback. Each module's own error
(``ParamsError``, ``ModelError``, ``PolicyError``, ...) subclasses it, so library callers can still
catch the specific one. Raise it before any model loads wherever the input allows, with a message
that names the key or file and the fix.
"""

from __future__ import annotations


class UserError(ValueError):
    """A user mistake; the message names the key or file at fault and the fix."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of the traceback (a notebook's cell, papermill's error): the
        CLI's one line, so a bad ``-p`` value reads first, not after the frames that raised it."""
        return [f"kvlab: error: {self}"]


class PolicyError(UserError):
    """Bad policy or storage input (method, keep, nbits, backend, model); the message names the fix."""


class EngineError(UserError):
    """An engine (or the store it builds) cannot run this model or policy; the message names the fix."""


class StorageError(UserError):
    """A file kvlab must write cannot be written: a full disk, a file-size limit (``ulimit -f``), a
    read-only or unwritable folder. The message names the file, the cause and the fix."""

    @classmethod
    def from_os(cls, err: OSError, path, after: str = "rerun the same command to continue") -> StorageError:
        import errno
        from pathlib import Path

        path = Path(path)
        folder = path.parent if path.suffix else path
        fixes = {
            errno.ENOSPC: f"free space on the disk that holds {folder} (df -h {folder}), or write to another folder",
            errno.EDQUOT: f"free space under your disk quota for {folder}, or write to another folder",
            errno.EFBIG: "raise the file-size limit (ulimit -f unlimited), or write to another folder",
            errno.EROFS: f"{folder} is on a read-only file system; write to another folder",
            errno.EACCES: f"{folder} is not writable by you; write to another folder",
            errno.EPERM: f"{folder} is not writable by you; write to another folder",
            errno.EISDIR: f"{path} is a folder; move it away (or write to another folder)",
        }
        fix = fixes.get(err.errno, "write to another folder")
        return cls(f"cannot write {path}: {err.strerror or err}; {fix}, then {after}")
