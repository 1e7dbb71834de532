"""Rendering: papermill + nbconvert to one offline HTML file (code hidden, plotly.js embedded by
:mod:`kvlab.viz`, every CDN script of nbconvert's template removed), plus a folder index."""

from __future__ import annotations

import html
from datetime import UTC, datetime
from pathlib import Path

from kvlab.reporting import ReportError

REPO_ROOT = Path(__file__).resolve().parents[2]
REPORT_NOTEBOOK = REPO_ROOT / "notebooks" / "report.ipynb"


# nbconvert's lab template, minus every script it would fetch from a CDN (require.js, MathJax,
# mermaid, the widget manager: widgets do not render in static HTML anyway). Report markdown
# uses no LaTeX; plotly.js is embedded by kvlab.viz.
OFFLINE_TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""


def ipc_kernel_manager():
    """jupyter_client's kernel manager over IPC (socket files in Jupyter's runtime folder) instead of
    TCP: the kernel then has no local TCP port to expose and ipykernel does not warn "Kernel is
    running over TCP without encryption" on every report (a quiet run prints results only).

    Each kernel gets socket paths of its own. jupyter_client's default IPC address is the relative
    ``kernel-ipc``, numbered by whichever ``kernel-ipc-N`` files do not exist yet in the kernel's
    working folder: kernels started at once in one folder (parallel tests, a sweep notebook beside a
    report) took the same sockets and read each other's messages ("Invalid Signature", "Kernel
    didn't respond")."""
    import uuid

    from jupyter_client import AsyncKernelManager
    from jupyter_core.paths import jupyter_runtime_dir

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            kwargs.setdefault("transport", "ipc")
            if "ip" not in kwargs:
                runtime = Path(jupyter_runtime_dir())
                runtime.mkdir(parents=True, exist_ok=True)
                kwargs["ip"] = str(runtime / f"kvlab-{uuid.uuid4().hex[:12]}-ipc")
            super().__init__(**kwargs)

    return IPCKernelManager


def execute_notebook(notebook: str | Path, output: str | Path, parameters: dict | None = None,
                     cwd: str | Path | None = None, kernel_name: str = "python3",
                     timeout: int | None = 1800, log_output: bool = False, start_timeout: int = 300):
    """Run a notebook with papermill; returns the executed notebook node.

    ``start_timeout`` is how long the kernel may take to answer: papermill's 60 s default was missed
    on a 2-core CI machine busy with parallel tests (stop 32), and a slow start is not a failure.

    Absolute paths papermill records in the notebook metadata are cut to file names, so a
    published notebook leaks nothing about the machine.
    """
    import nbformat
    import papermill as pm

    notebook, output = Path(notebook), Path(output)
    if not notebook.is_file():
        raise ReportError(f"notebook {notebook} not found: run from a kvlab checkout or pass --notebook")
    output.parent.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(str(notebook), str(output), parameters=parameters or {}, cwd=str(cwd) if cwd else None,
                        kernel_name=kernel_name, execution_timeout=timeout, log_output=log_output,
                        start_timeout=start_timeout, progress_bar=False, kernel_manager_class=ipc_kernel_manager())
    nb = nbformat.read(output, as_version=4)
    meta = nb.metadata.get("papermill", {})
    for key in ("input_path", "output_path"):
        if meta.get(key):
            meta[key] = Path(meta[key]).name
    nbformat.write(nb, output)
    return nb


def export_html(nb, html_path: str | Path, title: str | None = None) -> Path:
    """Notebook node -> one self-contained HTML file: code hidden, prompts hidden, no CDN scripts."""
    from nbconvert import HTMLExporter

    html_path = Path(html_path)
    if title:
        nb.metadata["title"] = title
    exporter = HTMLExporter(template_name="lab", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    exporter.raw_template = OFFLINE_TEMPLATE
    body, _ = exporter.from_notebook_node(nb)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(body, encoding="utf-8")
    return html_path


def render_notebook(notebook: str | Path, html_path: str | Path, parameters: dict | None = None,
                    cwd: str | Path | None = None, title: str | None = None, **execute_kwargs) -> Path:
    """Execute a notebook and export it; the executed ``.ipynb`` is kept next to the HTML."""
    html_path = Path(html_path)
    executed = html_path.with_suffix(".ipynb")
    nb = execute_notebook(notebook, executed, parameters, cwd=cwd, **execute_kwargs)
    return export_html(nb, html_path, title=title)


def render_report(records_dir: str | Path, out: str | Path | None = None, notebook: str | Path | None = None,
                  index: bool = True, parameters: dict | None = None, **execute_kwargs) -> Path:
    """``kvlab report``: the report notebook over one records folder -> HTML (+ the folder index).

    The notebook runs with the records folder as its working directory and ``records_dir="."``,
    so no absolute path enters the published notebook. Default output: ``DIR/report.html``; the
    index goes in the folder above the report's folder (where sweep folders sit side by side).
    """
    records_dir = Path(records_dir).resolve()
    if not records_dir.is_dir():
        raise ReportError(f"records folder {records_dir} does not exist: run `kvlab sweep PARAMS.yaml -o DIR` first")
    out = Path(out) if out else records_dir / "report.html"
    if out.suffix != ".html":
        raise ReportError(f"output {out} must end in .html")
    params = {"records_dir": ".", **(parameters or {})}
    html_path = render_notebook(notebook or REPORT_NOTEBOOK, out, params, cwd=records_dir,
                                title=f"kvlab report: {records_dir.name}", **execute_kwargs)
    if index:
        write_index(index_folder(html_path))
    return html_path


def index_folder(html_path: str | Path) -> Path:
    """Where ``kvlab report`` writes index.html: above ``DIR/report.html``, else next to the file."""
    html_path = Path(html_path).resolve()
    return html_path.parent.parent if html_path.name == "report.html" else html_path.parent


def find_reports(folder: str | Path) -> list[Path]:
    """HTML reports in a folder: ``*.html`` and ``*/report.html`` (never index.html)."""
    folder = Path(folder)
    found = [p for p in folder.glob("*.html") if p.name != "index.html"]
    found += list(folder.glob("*/*.html"))
    return sorted({p for p in found if p.name != "index.html"})


def _html_title(path: Path) -> str:
    with path.open(encoding="utf-8", errors="replace") as f:
        head = f.read(4096)
    start, end = head.find("<title>"), head.find("</title>")
    return html.unescape(head[start + 7:end]).strip() if 0 <= start < end else path.stem


def write_index(folder: str | Path) -> Path:
    """``index.html`` listing the reports in a folder, newest first, with relative links."""
    folder = Path(folder)
    reports = sorted(find_reports(folder), key=lambda p: p.stat().st_mtime, reverse=True)
    items = []
    for p in reports:
        rel = p.relative_to(folder).as_posix()
        when = datetime.fromtimestamp(p.stat().st_mtime, UTC).strftime("%Y-%m-%d %H:%M UTC")
        items.append(f'<li><a href="{html.escape(rel)}">{html.escape(_html_title(p))}</a> '
                     f'<span class="meta">{html.escape(rel)} · {when} · {p.stat().st_size / 1e6:.1f} MB</span></li>')
    body = "\n".join(items) or "<li>no reports yet: run <code>kvlab report DIR</code></li>"
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>kvlab reports</title>
<style>body{{font-family:system-ui,sans-serif;max-width:50em;margin:2em auto}}
li{{margin:.4em 0}} .meta{{color:#777;font-size:.85em;margin-left:.6em}}</style></head>
<body><h1>kvlab reports</h1><ul>
{body}
</ul></body></html>
"""
    path = folder / "index.html"
    path.write_text(page, encoding="utf-8")
    return path
