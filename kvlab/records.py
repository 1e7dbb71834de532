"""Append-only run records (JSONL, fsync per line), stable run ids, sweep manifests, DataFrames.

A sweep folder holds ``records.jsonl`` (one JSON object per run, appended with flush + fsync so a
``kill -9`` loses at most the run in flight), ``manifest.json`` (params and provenance) and, when
written, ``records.parquet``. Reports read records only through :func:`load_records`.

Archived folders (reports/) may store bulky files compressed: ``timelines.jsonl.xz``,
``warmup.jsonl.gz``. Every reader here opens a file or, when it is absent, its compressed twin
(:func:`open_text`), so code and scripts name the plain file either way.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import math
import os
import warnings
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvlab.errors import StorageError, UserError

SCHEMA_VERSION = 1
RECORDS_FILE = "records.jsonl"
MANIFEST_FILE = "manifest.json"
PARQUET_FILE = "records.parquet"
# Compressed twins a reader accepts in place of a plain file, by suffix (stdlib codecs only).
COMPRESSED = {".xz": lzma.open, ".gz": gzip.open}

# The columns reports read (ARCHITECTURE.md, "Records"); records may carry more.
PERF_COLUMNS = (
    "run_id", "sweep", "kind", "created_at", "status", "error", "model", "weights", "device", "card", "gpu_name",
    "gpu_uuid", "driver", "power_limit_w", "sm_clock_max_mhz", "mem_clock_max_mhz", "dtype", "attn_implementation", "sdpa_backend", "method", "label", "policy_params", "keep", "bits",
    "ctx", "batch", "new_tokens", "prompt_id", "repeat", "seed", "ttft_s", "prefill_s", "decode_s",
    "itl_ms", "itl_mean_ms", "itl_median_ms", "itl_p90_ms", "itl_max_ms", "gpu_busy_ms", "tokens_per_s",
    "peak_mem_bytes", "peak_mem_nvml_bytes", "cache_bytes", "cache_logical_tokens",
    "cache_physical_tokens", "energy_source", "energy_j", "prefill_j", "decode_j", "idle_w",
    "net_energy_j", "j_per_token", "net_j_per_token", "energy_10hz_j", "j_per_token_10hz",
)


class RecordsError(UserError):
    """A records folder or file that cannot be used as given; the message names the file."""


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _jsonable(obj: Any) -> Any:
    """Plain JSON values: non-finite floats become null, tuples lists, numpy/torch scalars numbers."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, str | bool | int):
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        return _jsonable(obj.item())
    return str(obj)


def canonical_json(obj: Any) -> str:
    """One spelling per value: sorted keys, no spaces; the basis of run ids."""
    return json.dumps(_jsonable(obj), sort_keys=True, separators=(",", ":"))


def make_run_id(params: Mapping[str, Any], repeat: int) -> str:
    """Stable id of one run: a hash of its canonical parameters and its repeat index."""
    text = canonical_json({"params": dict(params), "repeat": int(repeat)})
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RecordWriter:
    """Appends one JSON line per record and fsyncs it before returning.

    A line torn by a crash mid-write is terminated on the next open, so it stays a single
    unparseable line that readers skip; no later record is glued to it.

    A write that fails (a full disk, ``ulimit -f``, a read-only folder) raises one
    :class:`~kvlab.errors.StorageError` naming the file and the fix; what it left half-written is
    such a torn line.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        twin = stored_path(self.path)
        if twin is not None and twin != self.path:
            raise RecordsError(f"{twin} is an archived (compressed) file; appending would hide it from "
                               f"readers: decompress it first (xz -dk / gunzip -k) or write elsewhere")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            torn = self.path.exists() and self.path.stat().st_size > 0 and not self._ends_with_newline()
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        except OSError as err:
            raise StorageError.from_os(err, self.path) from None
        if torn:
            self._write("\n")

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _write(self, text: str) -> None:
        try:
            self._file.write(text)
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as err:
            raise StorageError.from_os(err, self.path) from None

    def append(self, record: Mapping[str, Any]) -> None:
        self._write(json.dumps(_jsonable(record), separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Close; a failed write already raised, so what its buffer still holds is dropped quietly."""
        try:
            self._file.close()
        except OSError:
            pass

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def stored_path(path: str | Path) -> Path | None:
    """``path`` if it exists, else its first existing compressed twin (``path.xz``, ``path.gz``),
    else None."""
    path = Path(path)
    if path.exists():
        return path
    return next((twin for suffix in COMPRESSED if (twin := path.with_name(path.name + suffix)).exists()), None)


def open_text(path: str | Path, mode: str = "rt"):
    """``path`` (or its compressed twin) opened for reading, decompressed by suffix; ``mode`` "rt" or
    "rb". A missing file raises ``FileNotFoundError`` naming the plain path."""
    found = stored_path(path)
    if found is None:
        raise FileNotFoundError(f"{path} (nor a compressed {path}.xz / .gz)")
    opener = COMPRESSED.get(found.suffix)
    if opener is None:
        return open(found, mode, **({"encoding": "utf-8"} if "t" in mode else {}))  # noqa: SIM115
    return opener(found, mode, **({"encoding": "utf-8"} if "t" in mode else {}))


def read_json(path: str | Path) -> Any:
    """One JSON file (or its compressed twin)."""
    with open_text(path) as f:
        return json.load(f)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All JSON objects of one file, in order. A torn, invalid, non-UTF-8 or non-object line (``123``,
    ``null``, ``[1, 2]``) is skipped with a warning naming the file and line: a damaged line must not
    stop a resume or a report, and must not pass for a record."""
    path = Path(path)
    if stored_path(path) is None:
        return []
    if path.is_dir():
        raise RecordsError(f"{path} is a folder, not a records file: move it away (kvlab writes that name as a file)")
    out = []
    with open_text(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                warnings.warn(f"{path}:{n}: skipped a line that is not UTF-8", stacklevel=2)
                continue
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{n}: skipped a torn or invalid line", stacklevel=2)
                continue
            if not isinstance(obj, dict):
                warnings.warn(f"{path}:{n}: skipped a line that is not a JSON object "
                              f"({type(obj).__name__})", stacklevel=2)
                continue
            out.append(obj)
    return out


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of one ``records.jsonl``: objects whose ``run_id`` is a string (others are skipped
    with a warning naming the file: a damaged record has no identity to resume or report by)."""
    out = []
    for r in read_jsonl(path):
        if not isinstance(r.get("run_id"), str):
            warnings.warn(f"{path}: skipped a record whose run_id is {r.get('run_id')!r}, not a string",
                          stacklevel=2)
            continue
        out.append(r)
    return out


def latest_status(records: Iterable[Mapping[str, Any]]) -> dict[str, str | None]:
    """Run id -> its status once retries are counted: ``"ok"`` if any record of it is ok, else the
    last one's (the rule :func:`load_records` applies with ``latest``)."""
    out: dict[str, str | None] = {}
    for r in records:
        if out.get(r["run_id"]) != "ok":
            out[r["run_id"]] = r.get("status")
    return out


def recorded_run_ids(folder: str | Path, statuses: Iterable[str] | None = None) -> set[str]:
    """Run ids already in ``folder/records.jsonl`` (only those whose latest status is one of
    ``statuses`` if given)."""
    wanted = set(statuses) if statuses is not None else None
    latest = latest_status(read_records(Path(folder) / RECORDS_FILE))
    return {run_id for run_id, status in latest.items() if wanted is None or status in wanted}


def write_manifest(folder: str | Path, manifest: Mapping[str, Any]) -> Path:
    """Write ``manifest.json`` atomically (temp file + rename)."""
    path = Path(folder) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(_jsonable(manifest), f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise StorageError.from_os(err, path) from None
    return path


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The folder's manifest, or None if it has none; a damaged one is a :class:`RecordsError`."""
    path = Path(folder) / MANIFEST_FILE
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecordsError(f"{path} is damaged ({err}); move it aside (the records stay valid) and rerun") from None
    if not isinstance(manifest, dict):
        raise RecordsError(f"{path} holds a {type(manifest).__name__}, not a JSON object; move it aside and rerun")
    return manifest


def record_files(path: Path) -> list[Path]:
    """Each ``records.jsonl`` under ``path`` (one stored compressed is named by its plain path)."""
    if path.is_file():
        return [path.with_suffix("") if path.suffix in COMPRESSED else path]
    if not path.exists():
        raise FileNotFoundError(f"no records at {path}: pass a sweep folder or a records.jsonl file")
    found = {p.parent / RECORDS_FILE for pattern in [RECORDS_FILE, *(RECORDS_FILE + s for s in COMPRESSED)]
             for p in path.rglob(pattern)}
    return sorted(found)


def _latest_per_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (folder, run id): the last ok one, else the last one (a retried failure)."""
    chosen: dict[tuple, int] = {}
    for i, r in enumerate(records):
        key = (r.get("_folder"), r.get("run_id"), r.get("kind"))
        prev = chosen.get(key)
        if prev is None or r.get("status") == "ok" or records[prev].get("status") != "ok":
            chosen[key] = i
    return [records[i] for i in sorted(chosen.values())]


def load_records(path: str | Path, kind: str | None = None, latest: bool = True):
    """All records under ``path`` (a sweep folder, a folder of sweeps, or one JSONL) as a DataFrame.

    The known columns come first in their documented order; ``folder`` names the sweep folder each
    row came from. With ``latest`` a run recorded twice (a failure retried) keeps one row.
    """
    import pandas as pd

    path = Path(path)
    rows: list[dict[str, Any]] = []
    for file in record_files(path):
        for r in read_records(file):
            r["_folder"] = str(file.parent)
            rows.append(r)
    if kind is not None:
        rows = [r for r in rows if r.get("kind") == kind]
    if latest:
        rows = _latest_per_run(rows)
    for r in rows:
        r["folder"] = r.pop("_folder")
    df = pd.DataFrame.from_records(rows)
    if df.empty:
        return pd.DataFrame(columns=list(PERF_COLUMNS))
    first = [c for c in PERF_COLUMNS if c in df.columns]
    return df[first + [c for c in df.columns if c not in first]]


def to_parquet(df, path: str | Path) -> Path:
    """Write a records DataFrame to Parquet; dict columns (``policy_params``) become JSON text so
    rows with different keys share one schema."""
    path = Path(path)
    out = df.copy()
    for col in out.columns:
        if out[col].map(lambda v: isinstance(v, dict)).any():
            out[col] = out[col].map(lambda v: canonical_json(v) if isinstance(v, dict) else v)
    out.to_parquet(path, index=False)
    return path


def write_parquet(folder: str | Path, path: str | Path | None = None) -> Path:
    """``load_records(folder)`` written to ``folder/records.parquet`` (or ``path``)."""
    folder = Path(folder)
    return to_parquet(load_records(folder), path or folder / PARQUET_FILE)
