"""`kvlab report DIR`: render a records folder's report to one offline HTML file (+ index.html)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from kvlab.errors import StorageError, UserError
from kvlab.preflight import check_out_dir
from kvlab.records import RECORDS_FILE, read_manifest, read_records, record_files
from kvlab.reporting.notebook_params import baseline_problem as records_baseline_problem
from kvlab.reporting.render import index_folder, render_report


def register(sub) -> None:
    p = sub.add_parser("report", help="execute the report notebook over a records folder and export HTML")
    p.add_argument("dir", help="records folder written by `kvlab sweep` (records.jsonl + manifest.json)")
    p.add_argument("-o", "--out", help="output .html (default: DIR/report.html)")
    p.add_argument("--ctx", type=int, default=None, help="context of the study table (default 16384, "
                   "or the nearest measured)")
    p.add_argument("--baseline", default=None, help="method the ratios compare against (default: full)")
    p.add_argument("--parity", default=None, help="parity.json written by benchmarks/kvpress_parity.py for the "
                   "methods table (default: DIR/parity.json or one below DIR)")
    p.add_argument("--notebook", default=None, help="report notebook to execute (default: notebooks/report.ipynb)")
    p.add_argument("--no-index", action="store_true", help="do not (re)write the folder's index.html")
    p.add_argument("--timeout", type=int, default=1800, help="per-cell execution timeout in seconds")
    p.set_defaults(func=run)


def check_records_dir(folder: str | Path) -> Path:
    """A folder holding at least one readable record (a sweep folder or a folder of sweeps): an
    empty or unrelated folder is refused before a report of "0 runs" is written into it."""
    path = Path(folder)
    if not path.is_dir():
        what = "is a file" if path.exists() else "does not exist"
        raise UserError(f"records folder {path} {what}: pass a folder written by `kvlab sweep` or `kvlab quality`")
    for f in path.rglob(RECORDS_FILE):
        if not f.is_file():
            raise UserError(f"{f} is a folder, not the records file kvlab sweep writes: move it away, or pass the "
                            f"sweep folder that holds the real one")
    files = record_files(path)  # plain or archived (records.jsonl.xz)
    if not files:
        raise UserError(f"no {RECORDS_FILE} in {path} or its subfolders: pass a folder written by `kvlab sweep` "
                        f"(e.g. outputs/smoke) or `kvlab quality`")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the report's own load warns about each damaged line
        if not any(read_records(f) for f in files):
            raise UserError(f"{', '.join(map(str, files[:3]))}: no readable record (every line is empty or damaged)")
    for f in files:  # a half-written manifest.json: the line kvlab sweep gives, not a JSONDecodeError in the notebook
        read_manifest(f.parent)
    return path


def baseline_problem(folder: Path, baseline: str) -> str | None:
    """Why ``--baseline`` names no method (or label) of the folder's records, or None."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        records = [r for f in record_files(folder) for r in read_records(f)]
    return records_baseline_problem(records, baseline, str(folder))


def check_writable(folder: Path, what: str, fix: str) -> None:
    """A folder the report writes into takes a new file, or one line saying what and the fix."""
    try:
        check_out_dir(folder, flag=what)
    except UserError as err:
        raise UserError(f"{err}".replace("; pass a writable folder", f"; {fix}")) from None


def check_args(args) -> None:
    check_records_dir(args.dir)
    if args.out is not None:
        out = Path(args.out)
        if out.suffix != ".html":
            raise UserError(f"-o {out} must end in .html")
        check_out_dir(out.parent, flag=f"-o {out}: its folder")
    else:
        out = Path(args.dir) / "report.html"
        check_writable(out.parent, "the report's folder", "pass -o a writable path, e.g. -o /tmp/report.html")
    if not args.no_index and index_folder(out) != out.parent:
        check_writable(index_folder(out), "the index's folder", "pass --no-index (or -o a writable path)")
    if args.notebook is not None and not Path(args.notebook).is_file():
        raise UserError(f"--notebook {args.notebook} does not exist: pass a .ipynb file (or leave it out)")
    if args.parity is not None and not Path(args.parity).is_file():
        raise UserError(f"--parity {args.parity} does not exist: pass the parity.json that "
                        f"benchmarks/kvpress_parity.py wrote (or leave it out)")
    if args.ctx is not None and args.ctx < 1:
        raise UserError(f"--ctx must be >= 1, got {args.ctx}")
    if args.timeout < 1:
        raise UserError(f"--timeout must be >= 1 second, got {args.timeout}")
    if args.baseline is not None:
        problem = baseline_problem(Path(args.dir), args.baseline)
        if problem:
            raise UserError(problem)


def run(args) -> int:
    check_args(args)
    params = {k: v for k, v in (("ctx", args.ctx), ("baseline", args.baseline)) if v is not None}
    if args.parity is not None:  # the notebook runs in DIR: a relative path keeps the machine's paths out of it
        params["parity"] = os.path.relpath(Path(args.parity).resolve(), Path(args.dir).resolve())
    try:
        html = render_report(args.dir, out=args.out, notebook=args.notebook, index=not args.no_index,
                             parameters=params, timeout=args.timeout)
    except OSError as err:  # the folder filled up (or turned read-only) while the notebook ran
        raise StorageError.from_os(err, err.filename or args.out or args.dir, after="rerun kvlab report") from None
    print(f"report: {html} ({html.stat().st_size / 1e6:.1f} MB, draws offline)")
    if not args.no_index:
        print(f"index:  {index_folder(html) / 'index.html'}")
    return 0
