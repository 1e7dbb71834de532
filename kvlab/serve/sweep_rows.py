"""A serving sweep's rows (in-process or against a URL): each finished run appended to
``serve_runs.jsonl`` as it ends, a failed one with its error (light: no torch)."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path


def finished_rows(out: Path) -> list[dict]:
    """The rows of runs an earlier call of this sweep completed (a rerun skips them): the last row
    per run in ``serve_runs.jsonl``, where it says complete; a torn last line is skipped."""
    path = Path(out) / "serve_runs.jsonl"
    last: dict[str, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            last[row["run"]] = row
    return [row for row in last.values() if row.get("status") == "complete"]


def set_aside(run_dir: Path) -> None:
    """An unfinished run's folder, renamed before its rerun writes a new one (nothing measured is lost)."""
    if run_dir.exists():
        n = 1
        while run_dir.with_name(f"{run_dir.name}.unfinished-{n}").exists():
            n += 1
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.unfinished-{n}"))


def failure(err: Exception) -> dict:
    """A failed run's fields: status, the error in one line, a short traceback."""
    return {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=5)}


def append_row(out: Path, rows: list, row: dict, log) -> None:
    """Stamp ``row``'s finish time, keep it in ``rows`` and append it to ``serve_runs.jsonl`` at once
    (a sweep killed later keeps every run it finished)."""
    row["finished_at"] = time.time()
    rows.append(row)
    path = out / "serve_runs.jsonl"
    with open(path, "a+b") as f:
        torn = False
        if f.seek(0, 2) > 0:  # read the last byte only
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + json.dumps(row).encode() + b"\n")  # a torn last line stays on its own
    log(f"{row['run']}: {row['status']}")
