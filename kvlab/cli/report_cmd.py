"""`kvlab report DIR`: render a records folder's report to one offline HTML file (+ index.html)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("report", help="execute the report notebook over a records folder and export HTML")
    p.add_argument("dir", help="records folder written by `kvlab sweep` (records.jsonl + manifest.json)")
    p.add_argument("-o", "--out", help="output .html (default: DIR/report.html)")
    p.add_argument("--ctx", type=int, default=None, help="context of the study table (default 16384, "
                   "or the nearest measured)")
    p.add_argument("--baseline", default=None, help="method the ratios compare against (default: full)")
    p.add_argument("--notebook", default=None, help="report notebook to execute (default: notebooks/report.ipynb)")
    p.add_argument("--no-index", action="store_true", help="do not (re)write the folder's index.html")
    p.add_argument("--timeout", type=int, default=1800, help="per-cell execution timeout in seconds")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvlab.report import index_folder, render_report

    params = {k: v for k, v in (("ctx", args.ctx), ("baseline", args.baseline)) if v is not None}
    html = render_report(args.dir, out=args.out, notebook=args.notebook, index=not args.no_index,
                         parameters=params, timeout=args.timeout)
    print(f"report: {html} ({html.stat().st_size / 1e6:.1f} MB, draws offline)")
    if not args.no_index:
        print(f"index:  {index_folder(html) / 'index.html'}")
    return 0
