"""A serving sweep's rows (in-process or against a URL): each finished run appended to
``serve_runs.jsonl`` as it ends, a failed one with its error (light: no torch)."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path


def failure(err: Exception) -> dict:
    """A failed run's fields: status, the error in one line, a short traceback."""
    return {"status": "failed", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(limit=5)}


def append_row(out: Path, rows: list, row: dict, log) -> None:
    """Stamp ``row``'s finish time, keep it in ``rows`` and append it to ``serve_runs.jsonl`` at once
    (a sweep killed later keeps every run it finished)."""
    row["finished_at"] = time.time()
    rows.append(row)
    with open(out / "serve_runs.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    log(f"{row['run']}: {row['status']}")
