"""Store a report folder's bulky files compressed, so the repository stays small and readable.

Kept plain (what a reader and ``kvlab report`` open first): READMEs and other text, ``manifest.json``,
``parity.json``, ``anatomy*.json``, ``records.jsonl`` under ``RECORDS_LIMIT`` bytes and every JSON under
``LIMIT`` bytes. Stored as ``NAME.xz`` (xz, stdlib ``lzma``): power timelines, warm-up records, logs,
larger records, JSON, JSONL and executed notebooks. ``records.parquet`` is removed: a sweep rewrites it from ``records.jsonl``
(``kvlab.records.write_parquet``). kvlab's readers open a file or its ``.xz`` twin
(``kvlab.records.open_text``), so nothing that names the plain file changes.

    python scripts/compress_reports.py reports/            # every folder under reports/
    python scripts/compress_reports.py --dry-run reports/h200-2026-12-02
"""

from __future__ import annotations

import argparse
import lzma
from pathlib import Path

LIMIT = 20_000
RECORDS_LIMIT = 30_000
ALWAYS = {"timelines.jsonl", "warmup.jsonl"}
NEVER = {"manifest.json", "parity.json"}
SIZED = {".json", ".jsonl", ".ipynb", ".log", ".txt"}
DERIVED = {"records.parquet"}


def action(path: Path) -> str | None:
    """"compress", "remove" or None (kept plain) for one file."""
    name = path.name
    if name in DERIVED:
        return "remove"
    if name in NEVER or name.startswith("anatomy") or path.suffix in (".xz", ".gz"):
        return None
    if name == "records.jsonl":
        return "compress" if path.stat().st_size > RECORDS_LIMIT else None
    if name in ALWAYS or path.suffix == ".log":
        return "compress"
    if path.suffix in SIZED and path.stat().st_size > LIMIT:
        return "compress"
    return None


def compress(path: Path) -> Path:
    """``path`` -> ``path.xz`` (checked to decompress to the same bytes), the plain file removed."""
    data = path.read_bytes()
    packed = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
    if lzma.decompress(packed) != data:
        raise RuntimeError(f"{path}: xz round trip differs")
    out = path.with_name(path.name + ".xz")
    out.write_bytes(packed)
    path.unlink()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="+", type=Path)
    ap.add_argument("--dry-run", action="store_true", help="list what would change")
    args = ap.parse_args()
    before = after = 0
    for folder in args.folders:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            todo = action(path)
            size = path.stat().st_size
            before += size
            if todo is None:
                after += size
                continue
            print(f"{todo:8} {path} ({size:,} B)")
            if args.dry_run:
                continue
            if todo == "remove":
                path.unlink()
            else:
                after += compress(path).stat().st_size
    print(f"{before:,} B -> {after:,} B" + (" (dry run)" if args.dry_run else ""))


if __name__ == "__main__":
    main()
